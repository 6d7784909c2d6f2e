"""Routing on the GPU: softmax / sigmoid (/ sqrt-softplus) scores, optional bias and expert
groups, top-k (routing.cu).

Shapes: T tokens, E experts (<= 1024), K top-k (<= 32).

    fused_topk        softmax / sigmoid top-k        -> topk_weights f32 [T, K], topk_ids
                                                        int32 [T, K], token_expert_indices
    fused_topk_bias   the same with a correction bias added before the choice (DeepSeek-V3),
                      and sqrt(softplus) scores too (DeepSeek-V4)
    grouped_topk      top-k of the best topk_group of num_expert_group groups
    select_experts    the FusedMoE dispatcher over the three
(the signatures, the reference's: docs/stages.md)

All three are one kernel, `route_topk_kernel<VPT>` (one warp per token row, the row in
registers: lane l holds experts l, l + 32, ...; VPT = values per lane = cdiv(E, 32) rounded up
to a power of two). Launch: block = WARPS_PER_BLOCK * 32, grid = cdiv(T, WARPS_PER_BLOCK),
shared memory = WARPS_PER_BLOCK * (even(E + E/32 + 1) + 2G) * 4 bytes when there are G > 1 groups.

Run as a script to validate against reference/ and time: python -m cuda_kernels.cupy.routing
"""
from __future__ import annotations

import numpy as np

from . import _arrays as A
from . import _compile as C
from ._geometry import cdiv
from ._script import rel_err, script_start

# Tunables are data: one dict per kernel, injected as #defines.
CONFIGS = {"route_topk_kernel": {"WARPS_PER_BLOCK": 4}}
VPTS = (1, 2, 4, 8, 16, 32)  # values per lane: E <= 32 * VPT
MAX_EXPERTS = 32 * VPTS[-1]
MAX_TOPK = 32  # lane k keeps the k-th winner
_NAMES = tuple(f"route_topk_kernel<{v}>" for v in VPTS)
_SCORING = {"softmax": 0, "sigmoid": 1}            # fused_topk, grouped_topk
_BIAS_SCORING = {**_SCORING, "sqrtsoftplus": 2}    # fused_topk_bias
MODE_TOPK, MODE_GROUPED = 0, 1   # the non-finite rule of a launch (routing.cu)


def _defines(dtype) -> dict:
    return {"IN_T": A.ctype_of(dtype), **CONFIGS["route_topk_kernel"]}


def _in_dtypes():
    return A.float_dtypes(with_f64=True)


# Every instantiation launched below, for the CPU compile checks (tests/cupy/test_nvrtc.py).
# fp64 logits are rounded to fp32 before the launch (the kernel would do the same first).
for _dt in A.float_dtypes():
    C.register_compile_case("routing.cu", _defines(_dt), _NAMES)


def _vpt(E: int) -> int:
    for v in VPTS:
        if 32 * v >= E:
            return v
    raise ValueError(f"gating_output: expected at most {MAX_EXPERTS} experts (a row lives in "
                     f"one warp's registers), got {E}")


def _check_common(hidden_states, gating_output, topk):
    A.check_array("gating_output", gating_output, ndim=2, dtypes=_in_dtypes())
    T, E = gating_output.shape
    if hidden_states is not None:
        if getattr(hidden_states, "ndim", 0) < 1 or hidden_states.shape[0] != T:
            raise ValueError(f"hidden_states: expected {T} rows to match gating_output "
                             f"{gating_output.shape}, got shape "
                             f"{getattr(hidden_states, 'shape', None)}")
    if E < 1:
        raise ValueError(f"gating_output: expected at least one expert, got shape {gating_output.shape}")
    _vpt(E)
    topk = A.check_int("topk", topk, 1, min(E, MAX_TOPK))
    A.check_fits_int32("topk", T * topk, "T * topk")
    return T, E, topk


def _bias_f32(name, bias, E):
    if bias is None:
        return None
    A.check_array(name, bias, ndim=1, dtypes=_in_dtypes(), shape=(E,))
    return A.as_f32(bias)


def _launch(gating, bias, topk, num_groups, topk_group, scoring, renormalize, scale,
            want_indices, mode=MODE_TOPK):
    """Allocate the outputs and launch once (the kernel writes every element)."""
    T, E = gating.shape
    if gating.dtype == np.float64:
        gating = gating.astype(np.float32)  # round to nearest: what the kernel's load would do
    weights = A.empty((T, topk), np.float32)  # [T, K]
    ids = A.empty((T, topk), np.int32)         # [T, K]
    tei = A.empty((T, topk), np.int32) if want_indices else None
    if T == 0:
        return weights, ids, tei
    vpt = _vpt(E)
    defines = _defines(gating.dtype)
    kernel = C.get_kernel("routing.cu", f"route_topk_kernel<{vpt}>", defines, _NAMES)
    warps = defines["WARPS_PER_BLOCK"]
    # per warp: the padded sel row (even float count) and one 8-byte key per group (routing.cu)
    row_floats = (E + E // 32 + 1 + 1) & ~1
    smem = warps * (row_floats + 2 * num_groups) * 4 if num_groups > 1 else 0
    if smem > 48 * 1024:  # beyond the default dynamic shared memory limit: opt in
        kernel.max_dynamic_shared_size_bytes = smem
    kernel((cdiv(T, warps),), (warps * 32,),
           (A.raw(gating), bias if bias is not None else A.null_ptr(), weights, ids,
            tei if tei is not None else A.null_ptr(),
            np.int32(T), np.int32(E), np.int32(topk), np.int32(num_groups),
            np.int32(topk_group), np.int32(scoring), np.int32(1 if renormalize else 0),
            np.int32(mode), np.float32(scale)),
           shared_mem=smem)
    return weights, ids, tei


def _ids_as(ids, indices_type):
    if indices_type is None or np.dtype(indices_type) == np.int32:
        return ids
    dt = np.dtype(indices_type)
    if dt.kind not in "iu":
        raise TypeError(f"indices_type: expected an integer dtype, got {dt}")
    return ids.astype(dt)


def _scoring(scoring_func, codes=_SCORING) -> int:
    if not isinstance(scoring_func, str):
        raise TypeError(f"scoring_func: expected one of {sorted(codes)}, "
                        f"got {type(scoring_func).__name__}")
    if scoring_func not in codes:
        raise ValueError(f"scoring_func: expected one of {sorted(codes)}, got {scoring_func!r}")
    return codes[scoring_func]


def fused_topk(hidden_states, gating_output, topk, renormalize, indices_type=None,
               scoring_func="softmax"):
    """Softmax (or sigmoid) over all E experts in fp32, a non-finite score 0 (vLLM's
    topk_softmax / topk_sigmoid), then the top-k, descending, ties to the lowest id.

    Returns topk_weights f32 [T, K], topk_ids int32 [T, K] (or `indices_type`),
    token_expert_indices int32 [T, K] with token_expert_indices[t, k] = k * T + t.
    """
    scoring = _scoring(scoring_func)
    _, _, topk = _check_common(hidden_states, gating_output, topk)
    w, ids, tei = _launch(gating_output, None, topk, 1, 1, scoring, renormalize, 1.0, True)
    return w, _ids_as(ids, indices_type), tei


def fused_topk_bias(hidden_states, gating_output, scoring_func, e_score_correction_bias, topk,
                    renormalize, indices_type=None, routed_scaling_factor=1.0):
    """Softmax, sigmoid or sqrt(softplus) scores, a non-finite one 0; experts chosen on
    scores + bias (the scores when the bias is None); weights the unbiased scores,
    renormalized if asked, then * routed_scaling_factor. Returns topk_weights, topk_ids."""
    scoring = _scoring(scoring_func, _BIAS_SCORING)
    _, E, topk = _check_common(hidden_states, gating_output, topk)
    bias = _bias_f32("e_score_correction_bias", e_score_correction_bias, E)
    w, ids, _ = _launch(gating_output, bias, topk, 1, 1, scoring, renormalize,
                        float(routed_scaling_factor), False)
    return w, _ids_as(ids, indices_type)


def grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group=0,
                 topk_group=0, scoring_func="softmax", routed_scaling_factor=1.0,
                 e_score_correction_bias=None):
    """DeepSeek-V2/V3 routing: scores (softmax rounded to the logits' dtype | sigmoid), an
    expert with a non-finite scoring input invalid (ranked last, weight 0); groups of
    E / num_expert_group consecutive experts scored by their max (no bias) or top-2 biased
    sum (bias), the topk_group best kept, top-k on the kept (biased) scores, weights the
    unbiased scores, renormalized if asked, always * routed_scaling_factor; a row with no
    valid expert among its K gets 1/K (renormalize) or 0. Returns topk_weights, topk_ids."""
    _, E, topk = _check_common(hidden_states, gating_output, topk)
    _scoring(scoring_func)
    groups = A.check_int("num_expert_group", num_expert_group, 1)
    if E % groups:
        raise ValueError(f"num_expert_group: expected a divisor of the number of experts ({E}), "
                         f"got {groups}")
    tg = A.check_int("topk_group", topk_group, 1)
    if tg > groups:
        raise ValueError(f"topk_group: expected at most num_expert_group ({groups}), got {tg}")
    if topk > tg * (E // groups):
        raise ValueError(f"topk: expected at most topk_group * experts per group "
                         f"({tg} * {E // groups}), got {topk}")
    bias = _bias_f32("e_score_correction_bias", e_score_correction_bias, E)
    w, ids, _ = _launch(gating_output, bias, topk, groups, tg, _SCORING[scoring_func],
                        renormalize, float(routed_scaling_factor), False, MODE_GROUPED)
    return w, ids


def select_experts(hidden_states, router_logits, top_k, use_grouped_topk, renormalize,
                   topk_group=None, num_expert_group=None, custom_routing_function=None,
                   scoring_func="softmax", routed_scaling_factor=1.0,
                   e_score_correction_bias=None, indices_type=None, global_num_experts=None,
                   zero_expert_num=0, zero_expert_type=None, ops=None):
    """FusedMoE.select_experts on this module's kernels: the reference's dispatcher
    (reference.routing.select_experts) with `ops` = this module, so both backends dispatch
    by the same code. Returns (topk_weights, topk_ids, None).

    Zero experts (zero_expert_num > 0) are computed on the host by the reference and are not
    offered here: NotImplementedError.
    """
    from reference.routing import select_experts as reference_select_experts

    if zero_expert_num and zero_expert_type is not None:
        raise NotImplementedError("zero_expert_num: zero experts are not implemented by the "
                                  "CuPy backend (use the reference)")
    return reference_select_experts(
        hidden_states, router_logits, top_k, use_grouped_topk, renormalize,
        topk_group=topk_group, num_expert_group=num_expert_group,
        custom_routing_function=custom_routing_function, scoring_func=scoring_func,
        routed_scaling_factor=routed_scaling_factor,
        e_score_correction_bias=e_score_correction_bias, indices_type=indices_type,
        global_num_experts=global_num_experts, zero_expert_num=0, zero_expert_type=None,
        ops=ops if ops is not None else _THIS)


class _This:
    """This module's three routing functions, as the `ops` namespace of select_experts."""

    fused_topk = staticmethod(fused_topk)
    fused_topk_bias = staticmethod(fused_topk_bias)
    grouped_topk = staticmethod(grouped_topk)


_THIS = _This()


# ----------------------------------------------------------------------------- script
def _main(argv=None):
    quick, timed = script_start(argv)  # --quick: small shapes, 3 timed calls (sanitizers)
    import reference

    rng = np.random.default_rng(0)
    bf16 = A.bf16_dtype()
    print(f"{'case (bf16 logits)':40s} {'ids same':>9s} {'w err':>9s} {'median us':>10s} "
          f"{'GB/s':>8s}")
    cases = [  # (name, T, E, K, groups, topk_group, scoring, bias)
        ("mixtral fused_topk", 4096, 8, 2, 0, 0, "softmax", False),
        ("qwen3 fused_topk", 4096, 128, 8, 0, 0, "softmax", False),
        ("deepseek-v3 grouped sigmoid+bias", 4096, 256, 8, 8, 4, "sigmoid", True),
        ("biased softmax E=512 K=22", 1000, 512, 22, 0, 0, "softmax", True),
    ]
    if quick:
        cases = [(n, 37, E, K, G, TG, sc, b) for n, _, E, K, G, TG, sc, b in cases]
    for name, T, E, K, G, TG, scoring, has_bias in cases:
        logits = rng.standard_normal((T, E)).astype(bf16)                    # [T, E]
        bias = (0.1 * rng.standard_normal(E)).astype(np.float32) if has_bias else None
        args = (A.to_device(logits), A.to_device(bias) if has_bias else None)
        if G:
            def run(a=args, K=K, G=G, TG=TG, scoring=scoring):
                return grouped_topk(None, a[0], K, True, G, TG, scoring, 2.5, a[1])
            ref = reference.grouped_topk(None, logits, K, True, G, TG, scoring, 2.5, bias)
        elif has_bias:
            def run(a=args, K=K):
                return fused_topk_bias(None, a[0], "softmax", a[1], K, True)
            ref = reference.fused_topk_bias(None, logits, "softmax", bias, K, True)
        else:
            def run(a=args, K=K):
                return fused_topk(None, a[0], K, True)[:2]
            ref = reference.fused_topk(None, logits, K, True)[:2]
        w, ids = run()
        same = float((A.to_host(ids) == ref[1]).all(axis=1).mean())
        err = rel_err(A.to_host(w), ref[0])
        ms = timed(run).median
        # bytes it must move: the logits in, weights and ids out (and the bias)
        nbytes = T * E * logits.itemsize + T * K * 8 + (E * 4 if has_bias else 0)
        print(f"{name:40s} {same:9.4f} {err:9.2e} {ms * 1e3:10.1f} {nbytes / ms / 1e6:8.1f}")


if __name__ == "__main__":
    _main()
