"""The stage pipeline: one forward of a `FusedMoE`, each stage on the backend its mapping names.

    T = tokens, K = top-k, H = hidden, B = block size, P = T*K slots

    route -> align -> gemm1 -> activation -> gemm2 -> combine   (the table of sandbox/layer.py)
    (+ the zero experts' output from route, + the shared experts through gemm1 .. gemm2)

    start(mapping, trace)       a StageRun: {stage: Backend}, each checked once per mapping
    StageRun.call(stage, ...)   the stage's function on its backend, every array argument
                                moved there first (Backend.take: the array's own kind says
                                where it lives, the backend whether it may stay)
    forward(layer, run, hidden_states, router_logits, exact, block)   the whole layer
    quant_experts(layer, run, x, topk_weights, topk_ids, block)   a quantized layer's experts
    route(layer, run, x, logits)                                       the route stage alone
    block_size_for(layer, mapping, T)   B: the layer's, else a quantized format's own, else
                                        the GEMM backend's BLOCK_M, else 64

`layer` is a FusedMoE (sandbox/layer.py): its routing settings and its weights (param_for /
constant_for of sandbox/weights.py give them to a backend as it reads them). When one GPU
backend runs align .. combine and has a `fused_experts` (cuda_kernels.cupy), the experts
run in that one call, launched from a plan cached per shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import arrays
from .registry import QUANT_GEMM_STAGE, STAGES, get_backend
from .weights import FLOAT_DTYPES

_CHECKED_MAPPINGS: dict = {}    # stage -> backend names, checked once: {stage: Backend}


@dataclass
class StageCall:
    """One stage as the layer ran it: what went in and what came out (for the harness)."""

    stage: str
    backend: str
    args: tuple
    kwargs: dict
    outputs: Any
    fn: str | None = None        # the function called, where the stage's name does not say it


class StageRun:
    """One forward: the backend of each stage, and the trace of StageCalls when asked."""

    def __init__(self, backends: dict, trace: list | None = None):
        self.backends = backends
        self.trace = trace

    def call(self, stage, *args, record=True, **kwargs):
        """Run `stage` on its backend: every positional array moved there by its own kind
        (keyword arguments are the layer's constants, placed already), then called; the
        call joins the trace unless record=False (the shared experts' calls)."""
        b = self.backends[stage]
        return self.run(stage, tuple(b.take(a) for a in args), kwargs, record)

    def run(self, stage, args, kwargs, record=True):
        """Run `stage` on arguments that are where they should be (nothing is moved)."""
        b = self.backends[stage]
        out = b.stage_fn(stage)(*args, **kwargs)
        if record and self.trace is not None:
            self.trace.append(StageCall(stage, b.name, args, dict(kwargs), out))
        return out


def start(mapping, trace=None) -> StageRun:
    """A StageRun for a resolved {stage: backend name} mapping. The checks (every backend
    available, every stage function there: RuntimeError / NotImplementedError now rather
    than mid-forward) depend on the mapping only: done once per mapping, since a decode
    step pays the host time of every forward."""
    key = tuple(mapping[stage] for stage in STAGES)
    backends = _CHECKED_MAPPINGS.get(key)
    if backends is not None and any(get_backend(n) is not backends[s]
                                    for n, s in zip(key, STAGES)):
        backends = None                 # the registry was reset (registry.clear_cache)
    if backends is None:
        backends = {}
        for stage in STAGES:
            b = get_backend(mapping[stage])
            if not b.ok:
                raise RuntimeError(f"backend {b.name!r} (stage {stage!r}) is not available "
                                   f"here: {b.reason}")
            b.stage_fn(stage)
            backends[stage] = b
        _CHECKED_MAPPINGS[key] = backends
    return StageRun(dict(backends), trace)


def check_inputs(layer, hidden_states, router_logits, exact):
    """(x, logits) checked against the layer: 2-D float arrays of shapes [T, H] and
    [T, E+Z]; x cast to params_dtype (float64 copies of both when exact; a device x must
    be of params_dtype already)."""
    for name, v in (("hidden_states", hidden_states), ("router_logits", router_logits)):
        if not (hasattr(v, "shape") and hasattr(v, "dtype")):
            raise TypeError(f"{name}: expected an array, got {type(v).__name__}")
        if len(v.shape) != 2:
            raise ValueError(f"{name}: expected 2 dimensions, got shape {tuple(v.shape)}")
        if arrays.dtype_of(v) not in FLOAT_DTYPES:
            raise TypeError(f"{name}: expected a float dtype, got {arrays.dtype_of(v)}")
    t, h = hidden_states.shape
    if h != layer.hidden_size:
        raise ValueError(f"hidden_states: expected shape (T, {layer.hidden_size}), "
                         f"got {tuple(hidden_states.shape)}")
    if tuple(router_logits.shape) != (t, layer.num_router_experts):
        raise ValueError(f"router_logits: expected shape ({t}, {layer.num_router_experts}) "
                         f"(T, experts{' + zero experts' if layer.zero_expert_num else ''}), "
                         f"got {tuple(router_logits.shape)}")
    want = np.dtype(np.float64) if exact else layer.params_dtype
    if arrays.kind(hidden_states) == "numpy":
        hidden_states = hidden_states.astype(want, copy=False)
    elif exact:
        hidden_states = arrays.to_numpy(hidden_states).astype(want)
    elif arrays.dtype_of(hidden_states) != want:
        raise TypeError(f"hidden_states: expected dtype {want} (params_dtype) for a device "
                        f"array, got {arrays.dtype_of(hidden_states)}")
    if exact and arrays.kind(router_logits) != "numpy":
        router_logits = arrays.to_numpy(router_logits)
    return hidden_states, router_logits


def check_memory(layer, run, num_tokens, exact):
    """MemoryError naming T and the bytes, before any stage, when the intermediates
    cannot fit: gemm1's [P, N1], the activation's [P, I_p] and gemm2's [P, H] (P = T*K),
    each counted where the backend that makes it keeps its arrays: host memory for a
    host backend (at least fp32: the reference computes there before it rounds), the
    backend's free device memory for a GPU backend (params_dtype). A lower bound of the
    peak, so it refuses only what cannot fit; free below _checks.CHECK_ABOVE_BYTES."""
    from reference._checks import check_working_set

    dtype = np.dtype(np.float64) if exact else layer.params_dtype
    widths = (("gemm1", layer.w13_weight.shape[1]),
              ("activation", layer.intermediate_size_per_partition),
              ("gemm2", layer.hidden_size))
    pools = {}                        # where -> (backend, bytes, shapes)
    for stage, width in widths:
        b = run.backends[stage]
        host = b.is_host
        item = max(dtype.itemsize, 4) if host else dtype.itemsize
        where = "host memory" if host else f"{b.name} device memory"
        _, nbytes, shapes = pools.get(where, (b, 0, []))
        pools[where] = (b, nbytes + num_tokens * layer.top_k * width * item,
                        shapes + [f"[T*K, {width}]"])
    for where, (b, nbytes, shapes) in pools.items():
        what = f"intermediates ({' + '.join(shapes)}, K={layer.top_k})"
        check_working_set(num_tokens, nbytes, what, where,
                          available=None if where == "host memory" else b.free_memory)


def block_size_for(layer, mapping, num_tokens) -> int:
    """The alignment block B: the layer's block_size, else for a quantized layer its
    format's block (the quantized ladders' measured choice by rows per expert; the bf16
    tiles' BLOCK_M would hand the int4 route a block its configs cannot take), else the GEMM
    backend's config (BLOCK_M), else the backends' default (64; smaller in the CUDA
    simulator)."""
    if layer.block_size is not None:
        return layer.block_size
    if layer.quant_config is not None:
        from cuda_kernels.cupy.quant.configs import block_size_for as quant_block_size
        from reference.quant import quant_format

        flags = layer.quant_config.kernel_flags()
        fmt = quant_format(*(flags[k] for k in ("use_fp8_w8a8", "use_int8_w8a8",
                                                "use_int8_w8a16", "use_int4_w4a16")))
        rows = num_tokens * layer.top_k / max(layer.local_num_experts, 1)
        return quant_block_size(fmt, rows)
    for stage, n in (("gemm1", layer.w13_weight.shape[1]), ("gemm2", layer.hidden_size)):
        b = get_backend(mapping[stage])
        k = layer.hidden_size if stage == "gemm1" else layer.intermediate_size_per_partition
        try:
            cfg = b.gemm_config(num_tokens, n, k, layer.local_num_experts, layer.top_k,
                                layer.params_dtype)
        except Exception:   # a config table that cannot answer: fall back, don't fail
            cfg = None
        if cfg and cfg.get("BLOCK_M"):
            return int(cfg["BLOCK_M"])
    return min(get_backend(mapping[s]).default_block_size for s in STAGES)


def route(layer, run, x, logits):
    """The route stage: (topk_weights, topk_ids, zero_expert_result or None)."""
    b = run.backends["route"]
    bias = layer.constant_for("e_score_correction_bias", layer.e_score_correction_bias, b)
    kwargs = dict(topk_group=layer.topk_group, num_expert_group=layer.num_expert_group,
                  custom_routing_function=layer.custom_routing_function,
                  scoring_func=layer.scoring_func,
                  routed_scaling_factor=layer.routed_scaling_factor,
                  e_score_correction_bias=bias, global_num_experts=layer.num_experts,
                  zero_expert_num=layer.zero_expert_num,
                  zero_expert_type=layer.zero_expert_type)
    # hidden_states only gives the routing its row count on a GPU backend (zero experts,
    # which read it, run on the host): it is not moved there
    x_in = x if not b.is_host and not layer.zero_expert_num else b.take(x)
    return run.run("route", (x_in, b.take(logits), layer.top_k, layer.use_grouped_topk,
                             layer.renormalize), kwargs)


def forward(layer, run, hidden_states, router_logits, exact, block=None):
    """The layer's six stages (or route and the backend's fused_experts), then the zero and
    shared experts; returns out [T, H] in the combine backend's arrays."""
    if layer.quant_config is not None and exact:
        # the exact answer of a quantized layer: its dequantized experts in float64
        layer = layer.dequantized(keep_fp32=True)
    x, logits = check_inputs(layer, hidden_states, router_logits, exact)
    t = x.shape[0]
    check_memory(layer, run, t, exact)
    bk = run.backends
    if block is None:
        block = block_size_for(layer, {s: b.name for s, b in bk.items()}, t)
    if layer.quant_config is not None:
        return _forward_quant(layer, run, x, logits, block)

    topk_weights, topk_ids, zero_result = route(layer, run, x, logits)
    align_map = layer.constant_for("expert_map", layer.expert_map, bk["align"])
    fused = None if exact or run.trace is not None else _fused_experts(layer, bk)
    if fused is not None:
        # the experts in one call of the backend's fused_experts: the same kernels as the
        # stages below, launched from a plan cached per shape (host time of a decode step)
        out = fused(x if arrays.is_device(x) else bk["gemm1"].take(x),
                    layer.param_for("w13_weight", bk["gemm1"]),
                    layer.param_for("w2_weight", bk["gemm2"]),
                    topk_weights, topk_ids, layer.activation,
                    layer.apply_router_weight_on_input, block_size=block,
                    expert_map=align_map)
        return _extras(layer, run, out, x, zero_result, block, exact)
    sorted_ids, expert_ids, ntpp = run.call("align", topk_ids, block, layer.num_experts,
                                            expert_map=align_map)
    cache1 = run.call("gemm1", x, layer.param_for("w13_weight", bk["gemm1"], exact),
                      sorted_ids, expert_ids, ntpp, layer.top_k, block, topk_weights,
                      layer.apply_router_weight_on_input,
                      layer.param_for("w13_bias", bk["gemm1"], exact))
    cache2 = run.call("activation", cache1, layer.activation, layer.is_act_and_mul)
    # the down-projection bias on tp_rank 0 only: the sum over TP ranks counts it once
    w2_bias = layer.param_for("w2_bias", bk["gemm2"], exact) if layer.tp_rank == 0 else None
    cache3 = run.call("gemm2", cache2, layer.param_for("w2_weight", bk["gemm2"], exact),
                      sorted_ids, expert_ids, ntpp, 1, block, topk_weights,
                      not layer.apply_router_weight_on_input, w2_bias)
    cache3 = bk["combine"].take(cache3).reshape(t, layer.top_k, layer.hidden_size)  # [T, K, H]
    # a slot routed nowhere (id -1, or off this rank) adds nothing
    out = run.call("combine", cache3, topk_ids,
                   expert_map=layer.constant_for("expert_map", layer.expert_map, bk["combine"]))
    return _extras(layer, run, out, x, zero_result, block, exact)


def _codes(backend, a, fp8):
    """Quantized codes as `backend` reads them: fp8 travels to a GPU backend as its uint8
    bytes (CuPy has no fp8 dtype) and comes back to the host as ml_dtypes' e4m3fn."""
    from .quant import FP8

    if a is None:
        return None
    if backend.is_host:
        h = arrays.to_numpy(a) if arrays.kind(a) != "numpy" else a
        return h.view(FP8) if fp8 and h.dtype == np.uint8 else h
    if arrays.kind(a) == "numpy" and a.dtype == FP8:
        return backend.put(a.view(np.uint8))
    return backend.take(a)


def quant_arguments(layer, backend, base):
    """What grouped_gemm_quant reads of the layer for `base` ("w13" / "w2") on `backend`:
    the codes, their scales and zero points (device copies cached per load), and the static
    activation scale (the max over the local experts, as vLLM) or None."""
    w = layer.param_for(f"{base}_weight", backend)
    w_scale = layer.param_for(f"{base}_weight_scale", backend)
    w_zp = layer.param_for(f"{base}_weight_zero_point", backend)
    a_scale = None
    s = getattr(layer, f"{base}_input_scale")
    if s is not None:
        if np.isnan(s).any():
            from .quant import MissingActivationScale
            raise MissingActivationScale(
                f"{base}_input_scale: the static scheme needs the activation scale of every "
                f"local expert, found {int(np.isnan(s).sum())} never loaded (NaN)")
        a_scale = backend.put(np.array([np.max(s)], np.float32)) if not backend.is_host \
            else np.array([np.max(s)], np.float32)
    return w, w_scale, w_zp, a_scale


def _forward_quant(layer, run, x, logits, block):
    """A quantized layer: route, then its experts (quant_experts), then the zero and shared
    experts. The quantized stages' functions are looked up before the routing runs, so a
    backend without them fails before any stage."""
    quant_fns(run)
    topk_weights, topk_ids, zero_result = route(layer, run, x, logits)
    out = quant_experts(layer, run, x, topk_weights, topk_ids, block)
    return _extras(layer, run, out, x, zero_result, block, False)


def quant_fns(run) -> dict:
    """{quantize1, gemm1, quantize2, gemm2: function} on each GEMM stage's backend
    (NotImplementedError naming the backend and the reason where it has none)."""
    bk = run.backends
    return {s: bk[QUANT_GEMM_STAGE[s]].quant_fn(s) for s in QUANT_GEMM_STAGE}


def quant_experts(layer, run, x, topk_weights, topk_ids, block):
    """A quantized layer's experts on a routing: align, then per GEMM the activations
    quantized (w8a8) and grouped_gemm_quant on the codes, on the GEMM stage's backend; the
    activation and the combine as usual; returns out [T, H] (no zero or shared experts).
    The trace holds quantize1 / quantize2 as stages of their own. What `moe-sandbox bench`
    times for a quantized candidate (sandbox/bench/quantized.py): the layer without route."""
    qc = layer.quant_config
    bk = run.backends
    fns = quant_fns(run)
    fp8 = qc.weight_dtype == "fp8"
    t = x.shape[0]
    flags = qc.kernel_flags()
    align_map = layer.constant_for("expert_map", layer.expert_map, bk["align"])
    sorted_ids, expert_ids, ntpp = run.call("align", topk_ids, block, layer.num_experts,
                                            expert_map=align_map)

    def gemm(n, a, top_k, mul_routed, bias):
        stage, b = f"gemm{n}", bk[f"gemm{n}"]
        base = "w13" if n == 1 else "w2"
        w, w_scale, w_zp, a_static = quant_arguments(layer, b, base)
        if qc.quant_dtype is not None:
            a_q, a_s = _record(run, f"quantize{n}", fns[f"quantize{n}"],
                               (b.take(a), a_static, qc.quant_dtype, qc.per_act_token_quant,
                                flags["block_shape"]), {})
        else:
            a_q, a_s = b.take(a), None
        args = (_codes(b, a_q, fp8), w, *(b.take(v) for v in (sorted_ids, expert_ids, ntpp)),
                top_k, block, b.take(topk_weights), mul_routed, bias)
        kwargs = dict(a_scale=b.take(a_s), w_scale=w_scale, w_zp=w_zp,
                      out_dtype=layer.params_dtype, **flags)
        return _record(run, stage, fns[stage], args, kwargs)

    w13_bias = layer.param_for("w13_bias", bk["gemm1"])
    cache1 = gemm(1, x, layer.top_k, layer.apply_router_weight_on_input, w13_bias)
    cache2 = run.call("activation", cache1, layer.activation, layer.is_act_and_mul)
    w2_bias = layer.param_for("w2_bias", bk["gemm2"]) if layer.tp_rank == 0 else None
    cache3 = gemm(2, cache2, 1, not layer.apply_router_weight_on_input, w2_bias)
    cache3 = bk["combine"].take(cache3).reshape(t, layer.top_k, layer.hidden_size)  # [T, K, H]
    return run.call("combine", cache3, topk_ids,
                    expert_map=layer.constant_for("expert_map", layer.expert_map, bk["combine"]))


def _record(run, stage, fn, args, kwargs):
    """Call a quantized stage's function and add it to the trace (its function name too:
    validate calls the same function of each backend)."""
    out = fn(*args, **kwargs)
    if run.trace is not None:
        run.trace.append(StageCall(stage, run.backends[QUANT_GEMM_STAGE[stage]].name, args,
                                   dict(kwargs), out, fn.__name__))
    return out


def _fused_experts(layer, bk):
    """The backend's `fused_experts` when one backend runs align .. combine and has one
    for this layer (gated silu / gelu, no biases, a half dtype), else None."""
    names = {bk[s].name for s in ("align", "gemm1", "activation", "gemm2", "combine")}
    if len(names) != 1 or layer.has_bias or not layer.is_act_and_mul:
        return None
    b = bk["gemm1"]
    if b.is_host or layer.params_dtype not in (np.dtype(np.float16), arrays.BF16):
        return None
    fn = getattr(b.module, "fused_experts", None)
    if fn is None or layer.activation not in getattr(fn, "activations", ()):
        return None
    return fn


def _extras(layer, run, out, x, zero_result, block, exact):
    """The zero experts' and the shared experts' outputs added to the routed ones (on
    tp_rank 0 / ep_rank 0 only: the sum over ranks counts them once)."""
    extras = []
    if zero_result is not None and layer.tp_rank == 0 and layer.ep_rank == 0:
        extras.append(zero_result)
    if layer.n_shared_experts and layer.ep_rank == 0:
        extras.append(_shared(layer, run, x, block, exact))
    if extras:
        out = _accumulate(out, run.backends["combine"], extras)
    return out


def _shared(layer, run, x, block, exact):
    """The shared experts: one expert (w13 [1, 2I_s, H], w2 [1, H, I_s]) every token
    visits with weight 1, through the gemm1 / activation / gemm2 backends."""
    from reference import moe_align_block_size

    bk = run.backends
    t = x.shape[0]
    align = moe_align_block_size(np.zeros((t, 1), np.int32), block, 1)   # host, trivial
    w13 = layer.param_for("shared_w13", bk["gemm1"], exact)               # [1, 2I_s, H]
    w2 = layer.param_for("shared_w2", bk["gemm2"], exact)                 # [1, H, I_s]
    s1 = run.call("gemm1", x, w13, *align, 1, block, None, False, None, record=False)
    s2 = run.call("activation", s1, layer.activation, layer.is_act_and_mul, record=False)
    return run.call("gemm2", s2, w2, *align, 1, block, None, False, None, record=False)


def _accumulate(out, backend, extras):
    """out + sum(extras), summed in fp32 (fp64 for fp64) and rounded once to out's dtype."""
    kind = arrays.kind(out)
    if kind == "torch":
        import torch

        cdt = torch.float64 if out.dtype == torch.float64 else torch.float32
        acc = out.to(cdt)
        for v in extras:
            acc = acc + backend.take(v).to(cdt)
        return acc.to(out.dtype)
    # NumPy, or a GPU array library without a dependable bf16 arithmetic: on the host
    host = backend.get(out)
    cdt = np.float64 if host.dtype == np.float64 else np.float32
    acc = host.astype(cdt)
    for v in extras:
        acc = acc + arrays.to_numpy(v).astype(cdt)
    acc = acc.astype(host.dtype)
    return acc if kind == "numpy" else backend.put(acc)
