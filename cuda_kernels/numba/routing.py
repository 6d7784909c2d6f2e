"""Routing in Numba: softmax / sigmoid (/ sqrt-softplus) scores, optional bias and expert
groups, top-k.

    T = tokens, E = experts, K = top-k, G = expert groups (num_expert_group)

    fused_topk(hidden_states, gating_output, topk, renormalize, indices_type=None,
               scoring_func="softmax")
        -> topk_weights f32 [T, K], topk_ids int32 [T, K], token_expert_indices int32 [T, K]
    fused_topk_bias(hidden_states, gating_output, scoring_func, e_score_correction_bias, topk,
                    renormalize, indices_type=None, routed_scaling_factor=1.0)
        -> topk_weights, topk_ids
    grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group=0,
                 topk_group=0, scoring_func="softmax", routed_scaling_factor=1.0,
                 e_score_correction_bias=None) -> topk_weights, topk_ids
    select_experts(...)   vLLM's dispatcher: reference.routing.select_experts(ops=this module)

The math (reference/routing.py), per token row t, all in fp32:
    scores[e] = softmax(logits[t])[e] = exp(x_e - max x) / sum_e' exp(x_e' - max x)
                or sigmoid(x_e) = 1 / (1 + exp(-x_e))
                or sqrt(softplus(x_e)), softplus = log(1 + exp(x)) or x above 20
                (fused_topk_bias only: DeepSeek-V4)
    mode MODE_TOPK (fused_topk, fused_topk_bias): a non-finite score becomes 0
    mode MODE_GROUPED (grouped_topk): softmax scores rounded to the logits' dtype; an expert
                whose scoring input is not finite (the logit for sigmoid, the score for
                softmax) is invalid: choice -inf, weight 0; a row with no valid expert among
                its K gets 1/K (renormalize) or 0
    choice[e] = scores[e] + bias[e]   (or scores[e])
    groups:   group score = max of its scores, NaN as -inf (no bias) | sum of its two best
              choices (bias: ranked with NaN as -inf, summed as they are);
              keep the topk_group best groups, choice = -inf outside them
    topk_ids  = the K best experts by choice: descending, ties to the lowest id, NaN as -inf
    topk_weights[t, k] = scores[topk_ids[t, k]], / their sum if renormalize and the sum > 0,
                         then * routed_scaling_factor
    token_expert_indices[t, k] = k * T + t

One kernel serves all three functions, in flavours that differ in how a row's threads
reduce (max, sum, argmax) and synchronise:

    kernel       threads of a row   reductions                    launch
    "keys"       one warp           routing.cu's: 64-bit keys,     grid = cdiv(T, W), block = 32 W
                                    one shuffled max per step      (route_keys_kernel)
    "warp"       one warp           butterfly cuda.shfl_xor_sync   grid = cdiv(T, W), block = 32 W
    "block"      one block of NT    shared-memory tree + syncthreads  grid = T, block = NT

"keys" is the GPU default (E <= 1024, K <= 32, G <= 32; else "warp"); the simulator has no
shuffles, so it always runs "block". W = WARPS_PER_BLOCK rows per block, NT = THREADS. The
kernels, and how a row lives in registers, are routing_kernels.py's; this module picks the
flavour and the geometry and holds the stages. Dynamic shared memory per row, fp32 words:
scores [E], raw choices [E] and group scores [G], reduction scratch [2 NT] ("block" only);
bytes = rows per block * (2E + G + 2 NT) * 4 ("keys": one padded row of choices per warp,
with groups only).

dtypes: gating_output fp32, fp16, bf16 (as uint16 bits, converted in the kernel by a shift:
see _device.py) or fp64; bias any of those; everything after the load is fp32.

Run as a script to validate against reference/ and time: python -m cuda_kernels.numba.routing
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np

from reference.routing import BIAS_SCORING_FUNCS, SCORING_FUNCS  # the choices: one source

from . import _arrays as A
from ._device import SIMULATOR
from .routing_kernels import MODE_GROUPED, MODE_TOPK, route_kernel, route_keys_kernel

# Tunables are data: one dict per flavour (the simulator gets small blocks: 2,000 threads/s).
CONFIGS = {"keys": {"WARPS_PER_BLOCK": 4}, "warp": {"WARPS_PER_BLOCK": 4},
           "block": {"THREADS": 128}}
SIM_CONFIGS = {"block": {"THREADS": 32}}
DEFAULT_FLAVOR = "block" if SIMULATOR else "keys"
SHARED_LIMIT = 48 * 1024   # bytes of dynamic shared memory without an opt-in
_SCORING_CODE = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}   # the kernels' `scoring`


def _config(flavor):
    if SIMULATOR and flavor in SIM_CONFIGS:
        return SIM_CONFIGS[flavor]
    return CONFIGS[flavor]


# ----------------------------------------------------------------------------- launch
def _keys_fits(E, K, G):
    """The "keys" kernel's limits: a row in one warp's registers, a winner per lane, a group
    per lane."""
    return E <= 1024 and K <= 32 and G <= 32


def values_per_thread(E, lanes):
    """The smallest power of two VPT with E <= VPT * lanes (a kernel is compiled per VPT)."""
    vpt = 1
    while vpt * lanes < E:
        vpt *= 2
    return vpt


def _geometry(flavor, T, E, G):
    """(grid, block, shared bytes) of a launch, from the formulas in the module docstring."""
    if flavor == "keys":
        rows = CONFIGS["keys"]["WARPS_PER_BLOCK"]
        smem = rows * (E + E // 32 + 1) * 4 if G > 1 else 0
        return A.cdiv(T, rows), rows * 32, smem
    if flavor == "warp":
        stride = 2 * E + G
        rows = CONFIGS["warp"]["WARPS_PER_BLOCK"]
        while rows > 1 and rows * stride * 4 > SHARED_LIMIT:
            rows //= 2
        smem = rows * stride * 4
        geometry = (A.cdiv(T, rows), rows * 32, smem)
    else:
        nt = _config("block")["THREADS"]
        smem = (2 * E + G + 2 * nt) * 4
        geometry = (T, nt, smem)
    if geometry[2] > SHARED_LIMIT:
        raise ValueError(f"gating_output: expected at most {(SHARED_LIMIT // 4 - 256) // 2} "
                         f"experts (a row lives in shared memory), got {E}")
    return geometry


def _launch(call, gating_output, bias, topk, num_groups, topk_group, scoring, renormalize,
            scale, want_tei, ids_dtype, flavor=None, mode=MODE_TOPK):
    flavor = flavor or DEFAULT_FLAVOR
    T, E = A.shape_of(gating_output)
    weights = call.empty((T, topk), np.float32)     # [T, K]
    ids = call.empty((T, topk), ids_dtype)          # [T, K]
    tei = call.empty((T, topk), np.int32) if want_tei else None
    if flavor == "keys" and not _keys_fits(E, topk, num_groups):
        flavor = "warp"
    if T > 0:
        grid, block, smem = _geometry(flavor, T, E, num_groups)
        lanes = 32 if flavor in ("warp", "keys") else block
        if flavor == "keys":
            kernel = route_keys_kernel(block // 32, values_per_thread(E, 32))
        else:
            kernel = route_kernel(flavor, block // 32 if flavor == "warp" else block,
                                  values_per_thread(E, lanes))
        logits = call.dev("gating_output", gating_output)
        bias_d = (call.dev("e_score_correction_bias", bias) if bias is not None
                  else A.dummy(np.float32))
        kernel[grid, block, A.launch_stream(), smem](
            logits, bias_d, weights, ids, tei if tei is not None else A.dummy(np.int32, 2),
            T, E, topk, num_groups, topk_group, _SCORING_CODE[scoring],
            1 if renormalize else 0, 1 if bias is not None else 0, 1 if want_tei else 0,
            mode, np.float32(scale))
    out = (call.result(weights), call.result(ids))
    return out + ((call.result(tei),) if want_tei else ())


# ----------------------------------------------------------------------------- argument checks
def _check_logits(hidden_states, gating_output, topk):
    A.check_float("gating_output", gating_output, ndim=2, with_f64=True)
    T, E = A.shape_of(gating_output)
    if hidden_states is not None:
        A.check_float("hidden_states", hidden_states, ndim=2, with_f64=True)
        if A.shape_of(hidden_states)[0] != T:
            raise ValueError(f"hidden_states: expected {T} rows to match gating_output, "
                             f"got shape {A.shape_of(hidden_states)}")
    topk = A.check_int("topk", topk, minimum=1)
    if topk > E:
        raise ValueError(f"topk: expected at most the number of experts ({E}), got {topk}")
    return T, E, topk


def _check_bias(bias, E):
    return A.check_float("e_score_correction_bias", bias, ndim=1, shape=(E,), with_f64=True)


def _ids_dtype(indices_type):
    if indices_type is None:
        return np.dtype(np.int32)
    if type(indices_type).__module__.split(".")[0] == "torch":
        dt = A._torch_dtypes()[0].get(indices_type)
    else:
        try:
            dt = np.dtype(indices_type)
        except TypeError:
            dt = None
    if dt is None or dt.kind not in "iu":
        raise TypeError(f"indices_type: expected an integer dtype, got {indices_type!r}")
    return dt


# ----------------------------------------------------------------------------- the stages
def fused_topk(hidden_states, gating_output, topk, renormalize, indices_type=None,
               scoring_func="softmax"):
    """Softmax (or sigmoid) top-k routing (Mixtral, Qwen3-MoE): vLLM's topk_softmax /
    topk_sigmoid.

    scores = softmax | sigmoid(gating_output) [T, E] fp32, a non-finite score 0; topk_ids =
    the K best, descending, ties to the lowest id; topk_weights = scores[topk_ids] (/ their
    sum if renormalize); token_expert_indices[t, k] = k * T + t. Kernel: `route_kernel`
    (module docstring).

    Returns topk_weights f32 [T, K], topk_ids int32 (or indices_type) [T, K],
    token_expert_indices int32 [T, K].
    """
    _check_scoring_func(scoring_func)
    _, _, topk = _check_logits(hidden_states, gating_output, topk)
    call = A.Call("gating_output", gating_output)
    return _launch(call, gating_output, None, topk, 1, 1, scoring_func, renormalize, 1.0, True,
                   _ids_dtype(indices_type))


def fused_topk_bias(hidden_states, gating_output, scoring_func, e_score_correction_bias, topk,
                    renormalize, indices_type=None, routed_scaling_factor=1.0):
    """Softmax, sigmoid or sqrt(softplus) scores, a non-finite one 0; experts chosen on
    scores + bias; weights are the unbiased scores, renormalized if asked, then
    * routed_scaling_factor. Returns topk_weights f32 [T, K], topk_ids int32 (or
    indices_type) [T, K]."""
    _check_scoring_func(scoring_func, BIAS_SCORING_FUNCS)
    _, E, topk = _check_logits(hidden_states, gating_output, topk)
    if e_score_correction_bias is not None:
        _check_bias(e_score_correction_bias, E)
    call = A.Call("gating_output", gating_output)
    return _launch(call, gating_output, e_score_correction_bias, topk, 1, 1, scoring_func,
                   renormalize, float(routed_scaling_factor), False, _ids_dtype(indices_type))


def _check_scoring_func(scoring_func, choices=SCORING_FUNCS):
    if not isinstance(scoring_func, str):
        raise TypeError(f"scoring_func: expected one of {sorted(choices)}, "
                        f"got {type(scoring_func).__name__}")
    A.check_choice("scoring_func", scoring_func, choices)


def grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group=0,
                 topk_group=0, scoring_func="softmax", routed_scaling_factor=1.0,
                 e_score_correction_bias=None):
    """DeepSeek-V2/V3 group-limited routing.

    scores = softmax (rounded to the logits' dtype) | sigmoid(gating_output), an expert with
    a non-finite scoring input invalid; choice = scores (+ bias), -inf when invalid; groups
    of E / num_expert_group consecutive experts scored by their max choice (no bias) or the
    sum of their two best choices (bias); the topk_group best groups kept; top-K of the kept
    choices; weights the unbiased scores (0 when invalid), renormalized if asked, always
    * routed_scaling_factor; no valid expert among the K: 1/K (renormalize) or 0.
    Returns topk_weights f32 [T, K], topk_ids int32 [T, K].
    """
    _, E, topk = _check_logits(hidden_states, gating_output, topk)
    _check_scoring_func(scoring_func)
    G = A.check_int("num_expert_group", num_expert_group, minimum=1)
    topk_group = A.check_int("topk_group", topk_group, minimum=1)
    if E % G:
        raise ValueError(f"num_expert_group: expected a divisor of the number of experts "
                         f"({E}), got {G}")
    if topk_group > G:
        raise ValueError(f"topk_group: expected at most num_expert_group ({G}), got {topk_group}")
    per = E // G
    if topk > topk_group * per:
        raise ValueError(f"topk: expected at most topk_group * experts per group "
                         f"({topk_group} * {per}), got {topk}")
    if e_score_correction_bias is not None:
        _check_bias(e_score_correction_bias, E)
    call = A.Call("gating_output", gating_output)
    return _launch(call, gating_output, e_score_correction_bias, topk, G, topk_group,
                   scoring_func, renormalize, float(routed_scaling_factor), False,
                   np.dtype(np.int32), mode=MODE_GROUPED)


def _ids_astype(ids, dt):
    """Cast topk_ids of any kind (used after a custom routing function)."""
    root = type(ids).__module__.split(".")[0]
    if root == "torch":
        return ids.to(A._torch_dtypes()[1][dt])
    if hasattr(ids, "astype"):
        return ids.astype(dt)
    host = A.to_host(ids).astype(dt)
    return A.to_device(host)


def select_experts(hidden_states, router_logits, top_k, use_grouped_topk, renormalize,
                   topk_group=None, num_expert_group=None, custom_routing_function=None,
                   scoring_func="softmax", routed_scaling_factor=1.0,
                   e_score_correction_bias=None, indices_type=None, global_num_experts=None,
                   zero_expert_num=0, zero_expert_type=None, ops=None):
    """vLLM's FusedMoE.select_experts with this module's kernels: the reference's dispatcher
    (reference.routing.select_experts) called with ops=<these functions>.

    Returns (topk_weights f32 [T, K], topk_ids [T, K], zero_expert_result or None). Zero
    experts (LongCat-Flash) run through the reference on host arrays only.
    """
    from reference import routing as ref_routing

    kind = A.kind_of("router_logits", router_logits)
    zero = bool(zero_expert_num) and zero_expert_type is not None
    if zero and kind != "host":
        raise NotImplementedError("zero_expert_num: zero experts run on host (NumPy) arrays "
                                  "only in the numba backend")
    ids_dt = _ids_dtype(indices_type)
    if ops is None:
        # the dispatcher's ops, producing ids of the asked dtype directly (no extra cast)
        ops = SimpleNamespace(
            fused_topk=lambda h, g, k, r, indices_type=None, scoring_func="softmax":
                fused_topk(h, g, k, r, ids_dt, scoring_func=scoring_func),
            fused_topk_bias=lambda h, g, sf, b, k, r, indices_type=None,
                routed_scaling_factor=1.0: fused_topk_bias(
                    h, g, sf, b, k, r, ids_dt, routed_scaling_factor=routed_scaling_factor),
            grouped_topk=grouped_topk)
    weights, ids, zero_result = ref_routing.select_experts(
        hidden_states, router_logits, top_k, use_grouped_topk, renormalize,
        topk_group=topk_group, num_expert_group=num_expert_group,
        custom_routing_function=custom_routing_function, scoring_func=scoring_func,
        routed_scaling_factor=routed_scaling_factor,
        e_score_correction_bias=e_score_correction_bias, indices_type=None,
        global_num_experts=global_num_experts, zero_expert_num=zero_expert_num,
        zero_expert_type=zero_expert_type, ops=ops)
    if indices_type is not None and A.dtype_of(ids) != ids_dt:
        ids = _ids_astype(ids, ids_dt)
    return weights, ids, zero_result


# ----------------------------------------------------------------------------- compile checks
def compile_cases():
    """(label, kernel, argument types) of every launch above, for the PTX checks (_ptx.py)."""
    from numba import types as t

    def arr(dt, nd):
        return t.Array(dt, nd, "C")

    def sig(dt, ids_dt=t.int32):
        return ((arr(dt, 2), arr(t.float32, 1), arr(t.float32, 2), arr(ids_dt, 2),
                 arr(t.int32, 2)) + (t.int64,) * 10 + (t.float32,))

    warp = CONFIGS["warp"]["WARPS_PER_BLOCK"]
    block = CONFIGS["block"]["THREADS"]
    keys = CONFIGS["keys"]["WARPS_PER_BLOCK"]
    cases = [(f"routing keys VPT={v} logits={dt}", route_keys_kernel(keys, v), sig(dt))
             for v, dt in ((8, t.uint16), (4, t.uint16), (1, t.float32), (32, t.float16),
                           (8, t.float64))]
    # every logits dtype at E = 256 (VPT 8) on the default flavour; the other row widths
    # (E = 8, 128, 1024) once; the block flavour (shares all but the reductions) twice
    cases += [(f"routing warp VPT=8 logits={dt}", route_kernel("warp", warp, 8), sig(dt))
              for dt in (t.float32, t.float16, t.uint16, t.float64)]
    cases.append(("routing warp VPT=8 logits=float32 ids=int64", route_kernel("warp", warp, 8),
                  sig(t.float32, t.int64)))
    cases += [(f"routing warp VPT={v} logits=uint16", route_kernel("warp", warp, v),
               sig(t.uint16)) for v in (1, 4, 32)]
    cases += [(f"routing block VPT=2 logits={dt}", route_kernel("block", block, 2), sig(dt))
              for dt in (t.float32, t.uint16)]
    return cases


# ----------------------------------------------------------------------------- as a script
def _main():
    import reference

    from . import _script as S

    this = sys.modules[__name__]

    def lines(rng):
        cases = ([(5, 8, 2), (3, 16, 4)] if SIMULATOR
                 else [(1, 8, 2), (256, 128, 8), (4096, 256, 8), (1024, 160, 6)])
        for T, E, K in cases:
            logits = rng.standard_normal((T, E)).astype(np.float32)   # [T, E]
            bias = (rng.standard_normal(E) * 0.1).astype(np.float32)   # [E]
            G = 8 if E % 8 == 0 else 1
            TG = min(4, G)
            stages = {   # (module, logits, bias) -> (weights, ids)
                "fused_topk": lambda m, x, b: m.fused_topk(None, x, K, True)[:2],
                "fused_topk_bias": lambda m, x, b: m.fused_topk_bias(
                    None, x, "softmax", b, K, True, routed_scaling_factor=2.5),
                "grouped_topk": lambda m, x, b: m.grouped_topk(None, x, K, True, G, TG, "sigmoid",
                                                               2.5, b),
            }
            for name, run in stages.items():
                (w, ids), (rw, rids) = run(this, logits, bias), run(reference, logits, bias)
                same = np.array_equal(ids, rids)
                err = S.rel_err(w, rw)
                yield (f"  {name:16s} T={T:5d} E={E:4d} K={K}: "
                       f"ids {'exact' if same else 'DIFFER'}, weights rel err {err:.1e}"
                       + S.timed(lambda x, b: run(this, x, b), logits, bias,
                                 nbytes=T * E * 4 + T * K * 8),   # the logits in, weights + ids out
                       same and err <= 1e-5)

    return S.main("routing", lines)


if __name__ == "__main__":
    sys.exit(_main())
