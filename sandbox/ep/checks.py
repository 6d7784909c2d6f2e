"""Checks that run inside launched ranks: parity against the single-device layer, EPLB,
refusals, and injected faults. The tests, the GPU tests and `moe-sandbox ep check` all
launch these functions (they must be importable by name in a spawned process).

Parity: every rank builds the same random single-device `FusedMoE` (same seed), computes
its output for the whole batch, and compares the rows of its own tokens with what the
expert-parallel layer returns for them: relative Frobenius error in float64,
||out - ref||_F / ||ref||_F, and NaN never passes.
"""
from __future__ import annotations

import itertools
import os
import time

import numpy as np

from .errors import EPError

# tolerances by dtype (docs/stages.md): the EP layer changes the summation order and, in
# the all-gather scheme, rounds each rank's partial sum before the reduce-scatter
TOLERANCE = {"float32": 1e-5, "float64": 1e-10, "float16": 1e-2, "bfloat16": 1e-2}


def rel_error(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        return float("inf")
    if out.size == 0:
        return 0.0
    if np.isnan(out).any():
        return float("nan")
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))


def token_split(total: int, world_size: int, seed: int, with_empty: bool = True) -> list[int]:
    """Uneven tokens per rank summing to `total`; one rank gets none when `with_empty`."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, total + 1, size=world_size - 1))
    split = np.diff(np.concatenate([[0], cuts, [total]])).astype(int).tolist()
    if with_empty and world_size > 1:
        empty = int(rng.integers(world_size))
        donor = (empty + 1) % world_size
        split[donor] += split[empty]
        split[empty] = 0
    return split


def parity_cases(world_size: int, quick: bool = False) -> list[dict]:
    """Every scheme x placement x EPLB setting (and a few dtypes / layer variants)."""
    W = world_size
    E = max(8, 2 * W)
    cases = []
    schemes = ("allgather", "alltoall")
    placements = ("linear", "round_robin")
    eplb = ("off", "replicas", "rebalance")
    for i, (scheme, placement, mode) in enumerate(itertools.product(schemes, placements, eplb)):
        R = 0 if mode == "off" else W  # (E + W) % W == 0 since E % W == 0 for W | 8, 2W
        cases.append(dict(
            name=f"{scheme}-{placement}-eplb_{mode}-fp32", seed=100 + i,
            config=dict(num_experts=E, top_k=2, hidden_size=32, intermediate_size=48,
                        dtype="float32", scheme=scheme, placement=placement,
                        num_redundant_experts=R),
            tokens=3 * W + 5, rebalance=(mode == "rebalance")))
    # the all-to-all-v scheme sends one row per (token, rank) by default; its per-slot
    # variant (alltoall_rows="slot") keeps one case here
    cases.append(dict(
        name="alltoall_slot-round_robin-eplb_replicas-fp32", seed=140,
        config=dict(num_experts=E, top_k=3, hidden_size=32, intermediate_size=48,
                    dtype="float32", scheme="alltoall", alltoall_rows="slot",
                    placement="round_robin", num_redundant_experts=W),
        tokens=3 * W + 2))
    if quick:
        return cases
    cases.append(dict(
        name="alltoall_slot-linear-top1_on_input-bf16", seed=141,
        config=dict(num_experts=E, top_k=1, hidden_size=32, intermediate_size=24,
                    dtype="bfloat16", scheme="alltoall", alltoall_rows="slot",
                    apply_router_weight_on_input=True),
        tokens=3 * W + 1))
    # bf16, the weight-loader path, biases and grouped routing, top-1 on input, activation
    for i, scheme in enumerate(schemes):
        cases.append(dict(
            name=f"{scheme}-linear-eplb_rebalance-bf16", seed=200 + i,
            config=dict(num_experts=E, top_k=3, hidden_size=64, intermediate_size=40,
                        dtype="bfloat16", scheme=scheme, num_redundant_experts=2 * W),
            tokens=4 * W + 3, rebalance=True))
        cases.append(dict(
            name=f"{scheme}-round_robin-weight_loader-bias-grouped-fp32", seed=210 + i,
            config=dict(num_experts=E, top_k=2, hidden_size=24, intermediate_size=16,
                        dtype="float32", scheme=scheme, placement="round_robin",
                        has_bias=True, use_grouped_topk=True, num_expert_group=2,
                        topk_group=1, renormalize=True),
            tokens=2 * W + 1, load="weight_loader"))
        cases.append(dict(
            name=f"{scheme}-linear-top1_on_input-gelu-fp16", seed=220 + i,
            config=dict(num_experts=E, top_k=1, hidden_size=32, intermediate_size=32,
                        dtype="float16", scheme=scheme, activation="gelu",
                        apply_router_weight_on_input=True, num_redundant_experts=W),
            tokens=3 * W, rebalance=True))
    return cases


def _reference_layer(case):
    from .layer import EPConfig

    cfg = EPConfig(**case["config"])
    kwargs = dict(num_experts=cfg.num_experts, top_k=cfg.top_k, hidden_size=cfg.hidden_size,
                  intermediate_size=cfg.intermediate_size, params_dtype=cfg.np_dtype,
                  renormalize=cfg.renormalize, use_grouped_topk=cfg.use_grouped_topk,
                  num_expert_group=cfg.num_expert_group, topk_group=cfg.topk_group,
                  scoring_func=cfg.scoring_func, routed_scaling_factor=cfg.routed_scaling_factor,
                  activation=cfg.activation, is_act_and_mul=cfg.is_act_and_mul,
                  apply_router_weight_on_input=cfg.apply_router_weight_on_input,
                  has_bias=cfg.has_bias)
    return cfg, kwargs


def _checkpoint(kwargs, seed):
    """A synthetic checkpoint, Qwen/DeepSeek names: (name, tensor) for every expert."""
    rng = np.random.default_rng(seed)
    E, H, I = kwargs["num_experts"], kwargs["hidden_size"], kwargs["intermediate_size"]
    out = []
    for e in range(E):
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            out.append((f"model.layers.0.mlp.experts.{e}.{proj}.weight",
                        (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)))
            if kwargs.get("has_bias"):
                out.append((f"model.layers.0.mlp.experts.{e}.{proj}.bias",
                            (0.1 * rng.standard_normal(shape[0])).astype(np.float32)))
    return out


def _skewed_logits(logits, num_experts, seed):
    """Make two experts hot so that EPLB has something to balance."""
    rng = np.random.default_rng(seed)
    hot = rng.choice(num_experts, size=2, replace=False)
    logits = logits.copy()
    logits[:, hot] += 2.5
    return logits


def run_parity(comm, cases, backend: str = "reference") -> list[dict]:
    """Run every case in this rank; return one dict per case (this rank's view)."""
    from sandbox.layer import FusedMoE

    from .layer import EPMoE

    results = []
    for case in cases:
        t0 = time.perf_counter()
        cfg, kwargs = _reference_layer(case)
        W, r = comm.world_size, comm.rank
        if case.get("load") == "weight_loader":
            ckpt = _checkpoint(kwargs, case["seed"])
            ref = FusedMoE(**kwargs)
            ref.load_weights(ckpt)
        else:
            ckpt = None
            ref = FusedMoE.random(case["seed"], **kwargs)
        # every third case leaves one rank without tokens (it still serves its experts)
        split = token_split(case["tokens"], W, case["seed"], with_empty=case["seed"] % 3 == 0)
        x, logits = ref.random_inputs(sum(split), seed=case["seed"] + 1)
        logits = _skewed_logits(logits, cfg.num_experts, case["seed"] + 2)
        lo = sum(split[:r])
        mine = slice(lo, lo + split[r])
        expected = ref.forward(x, logits)                         # [T_all, H] single device

        layer = EPMoE(comm, cfg, backend=backend)
        if ckpt is not None:
            layer.load_weights(ckpt)
        else:
            layer.load_from(ref)
        info = {"name": case["name"], "rank": r, "tokens": split[r]}
        if cfg.num_redundant_experts == 0 and ckpt is None:
            # the local weights are exactly the reference expert_map's share
            twin = FusedMoE(**kwargs, ep_size=W, ep_rank=r, expert_placement=cfg.placement)
            twin.w13_weight[...] = ref.w13_weight[twin.local_to_global]
            info["same_local_experts_as_expert_map"] = bool(
                np.array_equal(layer.local_logical_experts(), twin.local_to_global)
                and np.array_equal(layer.w13_weight, twin.w13_weight))
        out = comm.to_host(layer.forward(x[mine], logits[mine]))
        info["error"] = rel_error(out, expected[mine])
        if case.get("rebalance"):
            old = layer.placement
            global_load = layer.load.global_load(comm)
            new = layer.rebalance(global_load)
            from reference.eplb import gpu_loads

            info["moved"] = not np.array_equal(old.phys2log, new.phys2log)
            info["max_gpu_load_before"] = float(gpu_loads(global_load, old.phys2log, W).max())
            info["max_gpu_load_after"] = float(gpu_loads(global_load, new.phys2log, W).max())
            info["load_total"] = int(global_load.sum())
            # fresh inputs after the move: the output must not notice the new placement
            x2, logits2 = ref.random_inputs(sum(split), seed=case["seed"] + 3)
            logits2 = _skewed_logits(logits2, cfg.num_experts, case["seed"] + 2)
            out2 = comm.to_host(layer.forward(x2[mine], logits2[mine]))
            info["error_after_rebalance"] = rel_error(out2, ref.forward(x2, logits2)[mine])
        info["tolerance"] = TOLERANCE[cfg.dtype]
        info["seconds"] = time.perf_counter() - t0
        results.append(info)
    comm.barrier()
    return results


# ---------------------------------------------------------------------------------------
# the modular kernel interface (sandbox/modular/) over this communicator
# ---------------------------------------------------------------------------------------
MODULAR_CASES = (  # E experts (linear placement), K top-k, masked: slots routed nowhere
    dict(name="bf16-silu-masked", dtype="bfloat16", activation="silu", K=2, masked=True,
         on_input=False),
    dict(name="fp32-swigluoai", dtype="float32", activation="swigluoai", K=3, masked=False,
         on_input=False),
    dict(name="fp32-relu2-no-mul-top1-on-input", dtype="float32", activation="relu2_no_mul",
         K=1, masked=True, on_input=True),
)


def run_modular_parity(comm, experts=("reference", "torch"), cases=MODULAR_CASES) -> list[dict]:
    """Every (dispatching prepare/finalize of sandbox/modular/, experts, reduce) against
    the reference fused_experts of the whole batch in float64, on this rank's rows: the
    same weights and routing on every rank (same seed), each rank holding its linear share
    of the experts (reference.determine_expert_map), uneven tokens (the first case leaves one
    rank without any)."""
    import ml_dtypes

    import reference
    from sandbox import modular as mk

    W, r = comm.world_size, comm.rank
    dtypes = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
    results = []
    for i, case in enumerate(cases):
        seed = 1000 + i
        rng = np.random.default_rng(seed)
        dt = dtypes[case["dtype"]]
        E, K, H, I = 2 * W, case["K"], 16, 8
        N = I if case["activation"].endswith("_no_mul") else 2 * I
        split = token_split(5 * W + 1, W, seed, with_empty=i == 0)
        T = sum(split)
        x = rng.standard_normal((T, H)).astype(dt)
        w1 = (rng.standard_normal((E, N, H)) / np.sqrt(H)).astype(dt)
        w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(dt)
        tw, ids, _ = reference.fused_topk(x, rng.standard_normal((T, E)).astype(np.float32),
                                          K, True)
        if case["masked"]:   # padded tokens / dropped slots: vLLM's -1
            ids = ids.copy()
            ids.reshape(-1)[::4] = -1
        want = reference.fused_experts(x, w1, w2, tw, ids, case["activation"],
                                       case["on_input"], precision="exact")     # [T, H]
        _, emap = reference.determine_expert_map(W, r, E)
        local = np.arange(E)[emap >= 0] if emap is not None else np.arange(E)
        lo = sum(split[:r])
        mine = slice(lo, lo + split[r])
        for pf_cls in (mk.MoEPrepareAndFinalizeNaiveDPEPModular, mk.AllToAllPrepareAndFinalize):
            for name in experts:
                for reduce in (True, False):
                    kernel = mk.FusedMoEKernel(pf_cls(comm),
                                               mk.EXPERTS[name](block_size=4, reduce=reduce))
                    out = kernel.apply(x[mine], w1[local], w2[local], tw[mine], ids[mine],
                                       case["activation"], E, emap, case["on_input"])
                    results.append(dict(
                        case=case["name"], prepare_finalize=pf_cls.__name__, experts=name,
                        reduce=reduce, rank=r, tokens=split[r],
                        error=rel_error(comm.to_host(out), want[mine]),
                        tolerance=TOLERANCE[case["dtype"]]))
    comm.barrier()
    return results


# ---------------------------------------------------------------------------------------
# the two all-to-all-v implementations against each other (any backend)
# ---------------------------------------------------------------------------------------
IMPL_CASES = (  # (tokens on rank r: T0 + 7 r, or 0 on the last rank when empty_last), E, K, H
    dict(T0=37, E=16, K=4, H=40, dtype="bfloat16", empty_last=False),
    dict(T0=5, E=8, K=3, H=24, dtype="float32", empty_last=True),
    dict(T0=64, E=32, K=8, H=136, dtype="bfloat16", empty_last=False),
)


def run_impl_parity(comm, backend: str = "reference") -> list[dict]:
    """alltoall_dispatch / alltoall_combine with impl="fused" (combine in one go and in 3
    token chunks) against impl="stages", both row modes: the received rows, ids, weights and counts must be identical (same send order),
    the combined outputs equal (rel. error <= 1e-6: the same fp32 sums in the same order).
    One dict per (case, rows) with the checks' booleans."""
    import ml_dtypes

    from sandbox.registry import get_backend

    from .dispatch import alltoall_combine, alltoall_dispatch
    from .layer import _OnHost
    from .wire import raw, view_as

    xp = comm.xp
    W, r = comm.world_size, comm.rank
    ops = get_backend(backend)
    if backend == "reference" and xp is not np:
        ops = _OnHost(ops, comm)

    def dev(a):
        a = np.ascontiguousarray(a)
        return view_as(xp.asarray(raw(a)), a.dtype)

    def host(a):
        return None if a is None else np.asarray(comm.to_host(raw(a)))

    out = []
    for ci, case in enumerate(IMPL_CASES):
        dtype = np.dtype(ml_dtypes.bfloat16) if case["dtype"] == "bfloat16" else \
            np.dtype(case["dtype"])
        E, K, H = case["E"], case["K"], case["H"]
        T = 0 if (case["empty_last"] and r == W - 1) else case["T0"] + 7 * r
        rng = np.random.default_rng(100 * ci + r)
        x = rng.standard_normal((T, H)).astype(dtype)
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)      # [T, K]
        w = rng.random((T, K)).astype(np.float32)
        for rows in ("token", "slot"):
            got = {}
            for impl, chunks in (("stages", 1), ("fused", 1), ("fused", 3)):
                x_recv, ids_recv, w_recv, st = alltoall_dispatch(
                    comm, ops, dev(x), dev(ids), E // W, topk_weights=dev(w), rows=rows,
                    impl=impl, combine_chunks=chunks)
                # the experts' stand-in: y = 2 x (token rows: one partial per token)
                y = dev((host(x_recv).view(dtype).astype(np.float32) * 2).astype(dtype))
                o = alltoall_combine(comm, ops, y, st, dev(w))
                got[impl if chunks == 1 else f"{impl}{chunks}"] = dict(x=host(x_recv), ids=host(ids_recv), w=host(w_recv),
                                 send=st.send_counts.tolist(), recv=st.recv_counts.tolist(),
                                 out=host(o).view(dtype).astype(np.float64), impl=st.impl,
                                 lean=st.gpu is not None)
            # the same shape again with the tokens permuted: on the GPU the second call reuses
            # the first one's plan and send buffers; each token's output must follow it
            perm = rng.permutation(T)
            x_recv, _, _, st = alltoall_dispatch(comm, ops, dev(x[perm]), dev(ids[perm]),
                                                 E // W, topk_weights=dev(w[perm]), rows=rows,
                                                 impl="fused")
            y = dev((host(x_recv).view(dtype).astype(np.float32) * 2).astype(dtype))
            again = host(alltoall_combine(comm, ops, y, st, dev(w[perm]))).view(dtype)
            a, b = got["stages"], got["fused"]
            want = np.zeros((T, H))      # the loop: what the combine must return
            x2 = (x.astype(np.float32) * 2).astype(dtype).astype(np.float64)   # y = 2 x
            for t in range(T):
                held = [k for k in range(K) if 0 <= ids[t, k] < E]
                if rows == "slot":       # sum_k w[t, k] * y_k
                    want[t] = sum(float(w[t, k]) * x2[t] for k in held) if held else 0
                else:                    # one partial (2 x here) per destination rank
                    want[t] = len({int(ids[t, k]) // (E // W) for k in held}) * x2[t]
            out.append({
                "case": ci, "rows": rows, "rank": r, "impl": b["impl"],
                "x": bool(np.array_equal(a["x"], b["x"])),
                "ids": bool(np.array_equal(a["ids"], b["ids"])),
                "w": bool((a["w"] is None and b["w"] is None) or np.array_equal(a["w"], b["w"])),
                "counts": a["send"] == b["send"] and a["recv"] == b["recv"],
                "out_vs_stages": rel_error(b["out"], a["out"]),
                "chunked_vs_stages": rel_error(got["fused3"]["out"], a["out"]),
                "chunked_x": bool(np.array_equal(got["fused3"]["x"], a["x"])),
                "out_vs_loop": rel_error(b["out"], want),
                "lean": b["lean"],                  # the GPU's plan path ran (always on a GPU)
                "reuse_vs_fused": rel_error(again.astype(np.float64), b["out"][perm]),
                "tolerance": TOLERANCE[case["dtype"]]})
    comm.barrier()
    return out


# ---------------------------------------------------------------------------------------
# the communicator's collectives against their definitions (any backend)
# ---------------------------------------------------------------------------------------
COLLECTIVE_CHECKS = ("all_gather", "all_gather_bf16", "reduce_scatter", "reduce_scatter_bf16",
                     "all_reduce", "all_reduce_identical", "all_to_all_v", "all_to_all_v_counts",
                     "ring", "self_send", "counts", "exchange_rows")


def run_collectives(comm) -> dict:
    """Every collective against its definition, computed on the host from what each rank
    sends (each rank regenerates its peers' data from their seeds)."""
    import ml_dtypes

    from .wire import view_as

    bf16 = np.dtype(ml_dtypes.bfloat16)
    xp = comm.xp
    r, W = comm.rank, comm.world_size

    def dev(a):  # host -> the communicator's array module (bf16 through its bytes)
        a = np.ascontiguousarray(a)
        return view_as(xp.asarray(a.view(np.uint16) if a.dtype == bf16 else a), a.dtype)

    def host(a):
        return np.asarray(comm.to_host(a))

    def rng(p):
        return np.random.default_rng(1000 + p)

    res = {}
    xs = [rng(p).standard_normal((3, 5)).astype(np.float32) for p in range(W)]
    res["all_gather"] = np.array_equal(host(comm.all_gather(dev(xs[r]))), np.stack(xs))
    bs = [x.astype(bf16) for x in xs]
    got = host(comm.all_gather(dev(bs[r])))
    res["all_gather_bf16"] = np.array_equal(got.view(np.uint16), np.stack(bs).view(np.uint16))
    big = [rng(p).standard_normal((W, 64, 33)).astype(np.float32) for p in range(W)]
    want = sum(b[r].astype(np.float64) for b in big)
    res["reduce_scatter"] = bool(np.allclose(host(comm.reduce_scatter(dev(big[r]))), want,
                                             rtol=1e-5, atol=1e-5))
    got = host(comm.reduce_scatter(dev(big[r].astype(bf16)), dtype=bf16))
    res["reduce_scatter_bf16"] = bool(np.allclose(got.view(bf16).astype(np.float64), want,
                                                  rtol=3e-2, atol=3e-2))
    ar = comm.all_reduce(dev(xs[r]))
    res["all_reduce"] = bool(np.allclose(host(ar), sum(x.astype(np.float64) for x in xs),
                                         rtol=1e-5, atol=1e-6))
    # every rank must hold bit-identical sums
    res["all_reduce_identical"] = bool(np.all(host(comm.all_gather(ar)) == host(ar)))
    # variable splits, zeros included: rank p sends (p + q) % 3 rows to rank q
    counts = [np.array([(p + q) % 3 for q in range(W)]) for p in range(W)]
    rows = [np.concatenate([np.full((counts[p][q], 4), 100 * p + q, dtype=np.int32)
                            for q in range(W)]) for p in range(W)]
    meta = [(rows[p][:, 0] * 0.5).astype(bf16) for p in range(W)]
    (out, out_meta), rc = comm.all_to_all_v([dev(rows[r]), dev(meta[r])], counts[r])
    want_rows = np.concatenate([np.full((counts[p][r], 4), 100 * p + r, dtype=np.int32)
                                for p in range(W)])
    res["all_to_all_v"] = bool(np.array_equal(host(out), want_rows) and np.array_equal(
        host(out_meta).view(np.uint16), (want_rows[:, 0] * 0.5).astype(bf16).view(np.uint16)))
    res["all_to_all_v_counts"] = rc.tolist() == [int(counts[p][r]) for p in range(W)]
    # explicit offsets, two arrays in one group: rank p sends rows to q from a buffer with a
    # gap of q rows before each block, and q receives them after a gap of p + 1 rows
    def block(p, q):   # the (p + q) % 3 + 1 rows that p sends to q
        return np.full(((p + q) % 3 + 1, 3), 10 * p + q, dtype=np.int32)

    def layout(blocks, gap):
        offs, parts, at = [], [], 0
        for q, b in enumerate(blocks):
            parts += [np.full((gap(q), 3), -1, dtype=np.int32), b]
            offs.append(at + gap(q))
            at += gap(q) + len(b)
        return np.concatenate(parts), offs

    src, s_off = layout([block(r, q) for q in range(W)], lambda q: q)
    dst_want, r_off = layout([block(p, r) for p in range(W)], lambda p: p + 1)
    sc = [len(block(r, q)) for q in range(W)]
    rc = [len(block(p, r)) for p in range(W)]
    got = dev(np.full(dst_want.shape, -1, dtype=np.int32))
    got2 = dev(np.full(dst_want.shape, -1, dtype=np.int32).astype(bf16))
    comm.exchange_rows([dev(src), dev(src.astype(bf16))], s_off, sc, [got, got2], r_off, rc)
    res["exchange_rows"] = bool(np.array_equal(host(got), dst_want) and np.array_equal(
        host(got2).view(np.uint16), dst_want.astype(bf16).view(np.uint16)))
    # grouped send/recv in a ring, both directions at once, payloads larger than a socket
    # buffer (a blocking implementation would deadlock here)
    n = 1 << 19
    right, left = (r + 1) % W, (r - 1) % W
    from_left = xp.empty(n, dtype=np.float32)
    from_right = xp.empty(n, dtype=np.float32)
    to_right = dev(np.full(n, r, dtype=np.float32))
    to_left = dev(np.full(n, -r, dtype=np.float32))
    with comm.group():
        comm.send(to_right, right)
        comm.send(to_left, left)
        comm.recv(from_left, left)
        comm.recv(from_right, right)
    res["ring"] = bool(np.all(host(from_left) == left) and np.all(host(from_right) == -right))
    # a send to oneself inside a group is a copy
    mine = xp.empty(3, dtype=np.int64)
    ours = dev(np.array([r, r, r], dtype=np.int64))
    with comm.group():
        comm.send(ours, r)
        comm.recv(mine, r)
    res["self_send"] = host(mine).tolist() == [r, r, r]
    send, recv = comm.counts_phase(dev(np.arange(W) + r))
    res["counts"] = send.tolist() == list(range(r, r + W)) and \
        recv.tolist() == [r + p for p in range(W)]
    comm.barrier()
    return res


# ---------------------------------------------------------------------------------------
# refusals (each raises before any collective, so one launched group checks them all)
# ---------------------------------------------------------------------------------------
def run_refusals(comm) -> dict:
    from .layer import EPConfig, EPMoE

    out = {}
    base = dict(num_experts=8, top_k=2, hidden_size=16, intermediate_size=16, dtype="float32")

    def attempt(key, fn):
        try:
            fn()
            out[key] = None
        except (ValueError, TypeError, EPError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"

    W = comm.world_size
    # experts not divisible by the world size (no redundancy) -> refused
    attempt("indivisible", lambda: EPMoE(comm, EPConfig(**{**base, "num_experts": 2 * W + 1})))
    # redundancy that does not round up to a multiple of W -> refused
    attempt("indivisible_redundant", lambda: EPMoE(
        comm, EPConfig(**{**base, "num_experts": 2 * W, "num_redundant_experts": 1})))
    # ranks disagree on the config -> every rank refuses, naming the field
    attempt("mismatch", lambda: EPMoE(
        comm, EPConfig(**{**base, "hidden_size": 16 + (comm.rank == W - 1) * 8})))
    attempt("mismatch_scheme", lambda: EPMoE(
        comm, EPConfig(**{**base, "scheme": "alltoall" if comm.rank else "allgather"})))
    # the group is still healthy: a collective works afterwards
    total = comm.all_reduce(comm.xp.ones(1, dtype=np.float32))
    out["healthy_after"] = float(comm.to_host(total)[0]) == W
    return out


# ---------------------------------------------------------------------------------------
# injected faults
# ---------------------------------------------------------------------------------------
def run_with_fault(comm, fault: str, bad_rank: int = 1, scheme: str = "alltoall"):
    """Two forwards of a tiny EP layer; before the second, `bad_rank` raises / exits /
    hangs. The other ranks are inside the second forward's exchange when it happens."""
    from sandbox.layer import FusedMoE

    from .layer import EPConfig, EPMoE

    E = 2 * comm.world_size
    cfg = EPConfig(num_experts=E, top_k=2, hidden_size=16, intermediate_size=16,
                   dtype="float32", scheme=scheme)
    ref = FusedMoE.random(5, num_experts=E, top_k=2, hidden_size=16, intermediate_size=16)
    layer = EPMoE(comm, cfg)
    layer.load_from(ref)
    x, logits = ref.random_inputs(4, seed=comm.rank)
    layer.forward(x, logits)
    if comm.rank == bad_rank:
        if fault == "raise":
            raise RuntimeError(f"injected failure on rank {bad_rank}")
        if fault == "exit":
            os._exit(7)
        if fault == "hang":
            time.sleep(3600)
    layer.forward(x, logits)
    comm.barrier()
    return "finished"


def rank_pid(comm):
    """This rank's process id (the tests check that no child outlives a launch)."""
    return os.getpid()


def fault_and_report_pid(comm, fault, bad_rank=1, pid_dir=None):
    """Write this rank's pid to pid_dir, then run_with_fault."""
    if pid_dir:
        with open(os.path.join(pid_dir, f"rank{comm.rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    return run_with_fault(comm, fault, bad_rank)
