"""The torch backend: every stage of docs/stages.md written in plain torch (CPU and CUDA).

    T = tokens, E = experts (E_local on this rank), K = top-k, H = hidden, I = intermediate,
    B = block size, N = GEMM output width (2I for GEMM1, H for GEMM2), P = T*K slots

It plays two parts. It is the *outside oracle*: an independent implementation (torch's
softmax, sort, bincount and matmul, not NumPy's) that the harness compares with the
reference, so that a bug shared by the reference and a kernel written from it still shows
(only what is not math comes from the reference: the dispatch of select_experts, the
capacity of sorted_token_ids, argument checks).
And it is the *baseline a user would otherwise pick*: `fused_experts(..., impl="loop")`
is the per-expert Python loop of most MoE ports (gpt-fast, Hugging Face), and
`impl="grouped_mm"` runs `torch._grouped_mm` on the contiguous layout where torch has it.

Stages (same names, arguments and returns as `reference/`; arrays are torch tensors, and
NumPy arrays are accepted and converted):
    select_experts, fused_topk, fused_topk_bias, grouped_topk     route
    moe_align_block_size                                          align
    grouped_gemm                                                  gemm1, gemm2
    apply_activation (+ silu_and_mul, ...)                        activation
    moe_sum                                                       combine
    moe_permute, moe_unpermute, grouped_mm                        the contiguous layout
Module functions: availability(), to_device(np_array), to_host(tensor), device().

Precision: like the reference, every stage computes in fp32 (fp64 for fp64 inputs) and
rounds its floating output to the dtype of its main input at the reference's rounding
points (grouped_topk's softmax scores in the logits' dtype; a gated activation's act(gate)
before the multiply, as vLLM's kernels). One exception, on purpose:
`grouped_gemm(..., impl="grouped_mm")` lets `torch._grouped_mm` round the product to the
input dtype before the bias and the routed weight are applied, as a user of it would.

Device: CUDA when torch sees a GPU, else the CPU; `MOE_SANDBOX_TORCH_DEVICE=cpu` (or
`cuda:1`) overrides. GEMM implementation of `grouped_gemm`: "loop" (the default: an fp32
matmul per expert, the most accurate oracle) or "grouped_mm"; `MOE_SANDBOX_TORCH_GEMM`
overrides the default.

Run as a script to compare every stage with the reference: `python -m sandbox.torch_backend`.
"""

from __future__ import annotations

import functools
import math
import os
from types import SimpleNamespace

import numpy as np

# from the reference: what is not math (select_experts' dispatch, sorted_token_ids'
# capacity, grouped_topk's argument checks); every number below is torch's own
from reference.align import max_num_tokens_padded
from reference.routing import check_grouped_topk_args
from reference.routing import select_experts as _reference_select_experts

from . import arrays

GEMM_IMPLS = ("loop", "grouped_mm")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai", "relu2")


# ----------------------------------------------------------------------------- module API
@functools.lru_cache(maxsize=1)
def availability() -> tuple[bool, str]:
    """(True, "torch X on DEVICE") when torch imports, else (False, why)."""
    try:
        import torch
    except Exception as e:  # pragma: no cover - torch is in the project venv
        return False, f"torch is not importable ({type(e).__name__}: {e})"
    return True, f"torch {torch.__version__} on {device()}"


@functools.lru_cache(maxsize=1)
def device():
    """The torch device the backend computes on (a `torch.device`)."""
    import torch

    name = os.environ.get("MOE_SANDBOX_TORCH_DEVICE")
    if not name:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        # tensors report "cuda:0", and torch.device("cuda") != torch.device("cuda:0")
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def to_device(a):
    """A NumPy array as a tensor on the backend's device (zero-copy on the CPU)."""
    if arrays.kind(a) == "torch":
        return a.to(device())
    return arrays.numpy_to_torch(np.asarray(a), device())


def to_host(t) -> np.ndarray:
    """A tensor as a host NumPy array (bf16 as ml_dtypes.bfloat16)."""
    if arrays.kind(t) != "torch":
        return arrays.to_numpy(t)
    return arrays.torch_to_numpy(t)


def default_gemm_impl() -> str:
    impl = os.environ.get("MOE_SANDBOX_TORCH_GEMM", "loop")
    if impl not in GEMM_IMPLS:
        raise ValueError(f"MOE_SANDBOX_TORCH_GEMM: expected one of {GEMM_IMPLS}, got {impl!r}")
    return impl


# ----------------------------------------------------------------------------- helpers
def _t(x, name="x"):
    """Accept a tensor or a NumPy array (converted to the backend device)."""
    import torch

    if x is None or isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return to_device(x)
    raise TypeError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


def _compute_dtype(dtype):
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_float(name, x, ndim=None):
    import torch

    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating dtype, got {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")


def _check_int(name, x, ndim=None):
    import torch

    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype == torch.bool or x.dtype.is_complex:
        raise TypeError(f"{name}: expected an integer dtype, got {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")


def _positive_int(name, v, minimum=1):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {v}")
    return int(v)


def _cdiv(a, b):
    return -(-a // b)


def _index_dtype(indices_type):
    import torch

    if indices_type is None:
        return torch.int32
    if isinstance(indices_type, torch.dtype):
        return indices_type
    return arrays.torch_dtype(indices_type)


# ----------------------------------------------------------------------------- route
def _softmax(logits):
    """exp(x - max) / sum in fp32, written out (not torch.softmax) so that the NaN and inf
    rules are the reference's: NaN anywhere in a row, +inf, or an all -inf row -> NaN row."""
    import torch

    x = logits.float()
    m = x.max(dim=-1, keepdim=True).values if x.shape[-1] else x
    e = torch.exp(x - m)
    return e / e.sum(dim=-1, keepdim=True)


def _sigmoid(logits):
    import torch

    return torch.sigmoid(logits.float())


def _topk_indices(scores, k):
    """k best columns per row, descending, ties to the lowest index, NaN as -inf: a stable
    descending sort keeps equal keys in index order."""
    import torch

    key = torch.where(torch.isnan(scores), torch.full_like(scores, -math.inf), scores)
    return torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k]


def _renormalize(w):
    import torch

    total = w.sum(dim=-1, keepdim=True)
    pos = total > 0
    return torch.where(pos, w / torch.where(pos, total, torch.ones_like(total)), w)


def _check_logits(hidden_states, gating_output, topk):
    _check_float("gating_output", gating_output, ndim=2)
    t, e = gating_output.shape
    if hidden_states is not None:
        _check_float("hidden_states", hidden_states, ndim=2)
        if hidden_states.shape[0] != t:
            raise ValueError(f"hidden_states: expected {t} rows to match gating_output, "
                             f"got shape {tuple(hidden_states.shape)}")
    topk = _positive_int("topk", topk)
    if topk > e:
        raise ValueError(f"topk: expected at most the number of experts ({e}), got {topk}")
    return t, e, topk


def _scoring_func(scoring_func):
    if not isinstance(scoring_func, str):
        raise TypeError(f"scoring_func: expected one of ['sigmoid', 'softmax'], "
                        f"got {type(scoring_func).__name__}")
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func: expected one of ['sigmoid', 'softmax'], "
                         f"got {scoring_func!r}")
    return scoring_func


def _topk_scores(logits, scoring_func):
    """vLLM's topk_softmax / topk_sigmoid scores: fp32, a non-finite score replaced by 0."""
    import torch

    scores = _softmax(logits) if scoring_func == "softmax" else _sigmoid(logits)
    return torch.where(torch.isfinite(scores), scores, torch.zeros_like(scores))


def _grouped_scores(logits, scoring_func):
    """grouped_topk's scores and valid mask: softmax computed in fp32 and rounded to the
    logits' dtype (valid where finite), sigmoid in fp32 (valid where the logit is finite);
    invalid experts score 0."""
    import torch

    if scoring_func == "softmax":
        raw = _softmax(logits)
        valid = torch.isfinite(raw)
        raw = raw.to(logits.dtype).float()
    else:
        valid = torch.isfinite(logits.float())
        raw = _sigmoid(logits)
    return torch.where(valid, raw, torch.zeros_like(raw)), valid


def fused_topk(hidden_states, gating_output, topk, renormalize, indices_type=None,
               scoring_func="softmax"):
    """vLLM's topk_softmax / topk_sigmoid: scores = softmax or sigmoid(logits) [T, E] fp32
    (non-finite -> 0); ids = K best (descending, ties to the lowest id); weights =
    scores[ids] (/ their sum if renormalize); token_expert_indices[t, k] = k*T + t.
    Returns (f32 [T, K], int32 [T, K], int32 [T, K])."""
    import torch

    _scoring_func(scoring_func)
    hidden_states, gating_output = _t(hidden_states, "hidden_states"), _t(gating_output,
                                                                          "gating_output")
    t, _, topk = _check_logits(hidden_states, gating_output, topk)
    scores = _topk_scores(gating_output, scoring_func)                # [T, E]
    ids = _topk_indices(scores, topk)                                 # [T, K]
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = _renormalize(weights)
    dev = gating_output.device
    tei = (torch.arange(topk, device=dev, dtype=torch.int32)[None, :] * t
           + torch.arange(t, device=dev, dtype=torch.int32)[:, None])
    return weights.float(), ids.to(_index_dtype(indices_type)), tei


def fused_topk_bias(hidden_states, gating_output, scoring_func, e_score_correction_bias, topk,
                    renormalize, indices_type=None, routed_scaling_factor=1.0):
    """Experts chosen on scores + bias (scores: softmax or sigmoid, non-finite -> 0),
    weighed by the unbiased scores, renormalized if asked, times routed_scaling_factor.
    Returns (f32 [T, K], int32 [T, K])."""
    _scoring_func(scoring_func)
    hidden_states, gating_output = _t(hidden_states, "hidden_states"), _t(gating_output,
                                                                          "gating_output")
    _, e, topk = _check_logits(hidden_states, gating_output, topk)
    scores = _topk_scores(gating_output, scoring_func)
    choice = scores
    if e_score_correction_bias is not None:
        bias = _t(e_score_correction_bias, "e_score_correction_bias")
        _check_float("e_score_correction_bias", bias, ndim=1)
        if bias.shape[0] != e:
            raise ValueError(f"e_score_correction_bias: expected shape ({e},), "
                             f"got {tuple(bias.shape)}")
        choice = scores + bias.float()[None, :]
    ids = _topk_indices(choice, topk)
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = _renormalize(weights)
    weights = weights * float(routed_scaling_factor)
    return weights.float(), ids.to(_index_dtype(indices_type))


def grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group=0,
                 topk_group=0, scoring_func="softmax", routed_scaling_factor=1.0,
                 e_score_correction_bias=None):
    """DeepSeek group-limited routing: scores (softmax rounded to the logits' dtype, or
    sigmoid), an expert with a non-finite scoring input invalid (ranked last, weight 0);
    group score = max of the group's choices (no bias) or sum of its two best biased ones;
    keep the topk_group best groups; top-K of the (biased) masked choices; weights
    unbiased, renormalized if asked, times routed_scaling_factor; a token with no valid
    expert among its K gets 1/K (renormalize) or 0. Returns (f32 [T, K], int32 [T, K])."""
    import torch

    hidden_states, gating_output = _t(hidden_states, "hidden_states"), _t(gating_output,
                                                                          "gating_output")
    _, e, topk = _check_logits(hidden_states, gating_output, topk)
    g, kg, per = check_grouped_topk_args(e, topk, scoring_func, num_expert_group, topk_group)
    scores, valid = _grouped_scores(gating_output, scoring_func)
    t = scores.shape[0]
    neg_inf = torch.full_like(scores, -math.inf)
    choice = scores
    if e_score_correction_bias is not None:
        bias = _t(e_score_correction_bias, "e_score_correction_bias").float()
        if bias.dim() != 1 or bias.shape[0] != e:
            raise ValueError(f"e_score_correction_bias: expected shape ({e},), "
                             f"got {tuple(bias.shape)}")
        choice = scores + bias[None, :]
    choice = torch.where(valid, choice, neg_inf)
    grouped = choice.reshape(t, g, per)                                   # [T, G, E/G]
    if e_score_correction_bias is not None:
        best = _topk_indices(grouped, min(2, per))
        group_scores = grouped.gather(-1, best).sum(-1)                   # [T, G]
    else:
        # NaN as -inf for selection: amax would propagate a NaN into the group score
        key = torch.where(torch.isnan(grouped), torch.full_like(grouped, -math.inf), grouped)
        group_scores = key.amax(-1)
    kept = _topk_indices(group_scores, kg)                                # [T, topk_group]
    group_mask = torch.zeros((t, g), dtype=torch.bool, device=scores.device)
    group_mask.scatter_(1, kept, True)
    expert_mask = group_mask.repeat_interleave(per, dim=1)                # [T, E]
    masked = torch.where(expert_mask, choice, neg_inf)
    ids = _topk_indices(masked, topk)
    chosen_valid = valid.gather(-1, ids)
    weights = torch.where(chosen_valid, scores.gather(-1, ids), torch.zeros_like(ids,
                                                                                 dtype=torch.float32))
    if renormalize:
        weights = _renormalize(weights)
    weights = weights * float(routed_scaling_factor)
    none_valid = ~chosen_valid.any(-1, keepdim=True)
    weights = torch.where(none_valid, torch.full_like(weights, 1.0 / topk if renormalize else 0.0),
                          weights)
    return weights.float(), ids.int()


def zero_experts_compute(topk_ids, topk_weights, num_experts, zero_expert_type, hidden_states):
    """Zero experts ("identity"): result[t] = sum of the weights of slots with id >= E, times
    x[t]; those slots are then pointed at expert 0 with weight 0, in place."""
    if zero_expert_type != "identity":
        raise ValueError(f"zero_expert_type: expected one of ['identity'], "
                         f"got {zero_expert_type!r}")
    import torch

    is_zero = topk_ids >= num_experts
    # where, not a product: a NaN weight of a real expert must not poison the zero result
    scale = torch.where(is_zero, topk_weights.float(), 0.0).sum(-1)       # [T]
    result = hidden_states.to(_compute_dtype(hidden_states.dtype)) * scale[:, None].to(
        _compute_dtype(hidden_states.dtype))
    topk_ids[is_zero] = 0
    topk_weights[is_zero] = 0.0
    return result.to(hidden_states.dtype)


def _call_custom_routing(fn, hidden_states, router_logits, top_k, renormalize):
    """A custom routing function is user code written against NumPy (the reference's
    convention): it is called with host arrays and its results come back as tensors."""
    w_np, ids_np = fn(hidden_states=to_host(hidden_states), gating_output=to_host(router_logits),
                      topk=top_k, renormalize=renormalize)
    return (to_device(np.asarray(w_np)).to(router_logits.device),
            to_device(np.asarray(ids_np)).to(router_logits.device))


# the ops of reference.routing.select_experts: the three routing functions, and the array
# handling of the dispatcher's tail done on tensors
_TAIL = ("call_custom_routing", "ids_astype", "copy", "zero_experts_compute")
_OPS = SimpleNamespace(fused_topk=fused_topk, fused_topk_bias=fused_topk_bias,
                       grouped_topk=grouped_topk, call_custom_routing=_call_custom_routing,
                       ids_astype=lambda ids, indices_type: ids.to(_index_dtype(indices_type)),
                       copy=lambda t: t.clone(), zero_experts_compute=zero_experts_compute)


def _with_torch_tail(ops):
    """A caller's ops, with this module's tensor handling for whatever of the tail it lacks."""
    merged = SimpleNamespace(**{name: getattr(_OPS, name) for name in _TAIL})
    for name in ("fused_topk", "fused_topk_bias", "grouped_topk") + _TAIL:
        if hasattr(ops, name):
            setattr(merged, name, getattr(ops, name))
    return merged


def select_experts(hidden_states, router_logits, top_k, use_grouped_topk, renormalize,
                   topk_group=None, num_expert_group=None, custom_routing_function=None,
                   scoring_func="softmax", routed_scaling_factor=1.0,
                   e_score_correction_bias=None, indices_type=None, global_num_experts=None,
                   zero_expert_num=0, zero_expert_type=None, ops=None):
    """vLLM's dispatcher, in its router factory's order: grouped_topk; the custom function;
    fused_topk_bias when a correction bias is given; else fused_topk (softmax or sigmoid
    scores). The dispatch is the reference's (reference.routing.select_experts) with
    ops = this module's routing functions and tensor handling, as the CuPy and Numba
    backends do: the routing math stays this module's own. A custom routing function is
    user code written against NumPy: it is called with host NumPy arrays and its results
    come back as tensors. Returns (topk_weights f32 [T, K], topk_ids int32 [T, K],
    zero_expert_result [T, H] or None)."""
    return _reference_select_experts(
        _t(hidden_states, "hidden_states"), _t(router_logits, "router_logits"), top_k,
        use_grouped_topk, renormalize, topk_group=topk_group, num_expert_group=num_expert_group,
        custom_routing_function=custom_routing_function, scoring_func=scoring_func,
        routed_scaling_factor=routed_scaling_factor,
        e_score_correction_bias=e_score_correction_bias, indices_type=indices_type,
        global_num_experts=global_num_experts, zero_expert_num=zero_expert_num,
        zero_expert_type=zero_expert_type, ops=_OPS if ops is None else _with_torch_tail(ops))


# ----------------------------------------------------------------------------- align
def moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None,
                         pad_sorted_ids=False, ignore_invalid_experts=False):
    """Group the P = T*K slots by expert, each expert's run padded to a multiple of B with
    the value P; a slot whose id is outside [0, E) (or, with ignore_invalid_experts, whose
    expert is not local) is skipped. Returns (sorted_token_ids int32 [max_padded], expert_ids int32
    [cdiv(max_padded, B)] (local ids under expert_map, -1 past the end or off-rank),
    num_tokens_post_padded int32 [1]). Same layout as the reference: a stable sort, so slots
    come in increasing s within an expert."""
    import torch

    topk_ids = _t(topk_ids, "topk_ids")
    _check_int("topk_ids", topk_ids, ndim=2)
    b = _positive_int("block_size", block_size)
    e = _positive_int("num_experts", num_experts)
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()                                   # [P]
    p = flat.numel()
    if expert_map is not None:
        expert_map = _t(expert_map, "expert_map").to(dev)
        _check_int("expert_map", expert_map, ndim=1)
        if expert_map.shape[0] != e:
            raise ValueError(f"expert_map: expected shape ({e},), got {tuple(expert_map.shape)}")
    capacity = max_num_tokens_padded(p, b, e, pad_sorted_ids)

    # the slots aligned: ids in [0, E) (vLLM's -1 and ids past E are skipped), and with
    # ignore_invalid_experts only local experts
    scheduled = (flat >= 0) & (flat < e)                                 # [P]
    if expert_map is not None and ignore_invalid_experts:
        scheduled &= expert_map.long()[torch.where(scheduled, flat, 0)] >= 0
    slots = torch.nonzero(scheduled).squeeze(1)                          # increasing s
    experts = flat[slots]
    counts = torch.bincount(experts, minlength=e)                        # [E]
    padded = (counts + b - 1) // b * b                                   # [E]
    padded_starts = torch.cumsum(padded, 0) - padded                     # exclusive scan
    slot_starts = torch.cumsum(counts, 0) - counts
    order = torch.sort(experts, stable=True).indices                     # scheduled, by expert
    expert_of = experts[order]
    rank = torch.arange(slots.numel(), device=dev) - slot_starts[expert_of]
    sorted_token_ids = torch.full((capacity,), p, dtype=torch.int32, device=dev)
    sorted_token_ids[padded_starts[expert_of] + rank] = slots[order].int()

    num_blocks = int(padded.sum()) // b
    expert_ids = torch.full((_cdiv(capacity, b),), -1, dtype=torch.int32, device=dev)
    block_experts = torch.repeat_interleave(torch.arange(e, device=dev), padded // b)
    if expert_map is not None:
        block_experts = expert_map.long()[block_experts]
    expert_ids[:num_blocks] = block_experts.int()
    ntpp = torch.tensor([num_blocks * b], dtype=torch.int32, device=dev)
    return sorted_token_ids, expert_ids, ntpp


# ----------------------------------------------------------------------------- gemm
def grouped_mm_supported(x, w) -> tuple[bool, str]:
    """Whether torch._grouped_mm takes x [M, Kdim] and w [G, N, Kdim] here (and why not)."""
    import torch

    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._grouped_mm"
    size = x.element_size()
    if (x.shape[1] * size) % 16 or (w.shape[1] * size) % 16:
        return False, "torch._grouped_mm needs row strides that are multiples of 16 bytes"
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16:
            return False, "torch._grouped_mm on CUDA takes bf16 only"
        if torch.cuda.get_device_capability(x.device) < (9, 0):
            return False, "torch._grouped_mm on CUDA needs compute capability 9.0+"
    return True, ""


def _grouped_rows(sorted_token_ids, expert_ids, num_tokens_post_padded, block_size, num_slots):
    """The (slot, local expert) pair of every real position below num_tokens_post_padded."""
    import torch

    ntpp = int(num_tokens_post_padded.reshape(-1)[0])
    pos = torch.arange(ntpp, device=sorted_token_ids.device)
    s = sorted_token_ids[:ntpp].long()                                   # [ntpp]
    e = expert_ids.long()[pos // block_size]                             # [ntpp]
    keep = s < num_slots
    return s[keep], e[keep]


def grouped_gemm(a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                 block_size, topk_weights=None, mul_routed_weight=False, bias=None, *,
                 impl=None):
    """vLLM's fused MoE GEMM as a pure function.

    For every position p below num_tokens_post_padded with s = sorted_token_ids[p] < P
    (P = a.shape[0] * top_k) and e = expert_ids[p // B]:
        c[s] = (a[s // top_k] @ w[e].T + bias[e]) * (topk_weights.flat[s] if mul_routed_weight)
    in fp32 (fp64 for fp64 inputs), rounded once to a.dtype; c[s] = 0 where e == -1.
    a [M_a, Kdim], w [E_local, N, Kdim] -> c [M_a * top_k, N]. Rows no position names stay
    NaN (poisoned), so a broken alignment shows.

    impl: "loop" (one matmul per expert) or "grouped_mm" (rows gathered in expert order,
    one torch._grouped_mm; falls back to the loop where torch cannot run it).
    """
    import torch

    impl = impl or default_gemm_impl()
    if impl not in GEMM_IMPLS:
        raise ValueError(f"impl: expected one of {GEMM_IMPLS}, got {impl!r}")
    a, w = _t(a, "a"), _t(w, "w")
    sorted_token_ids = _t(sorted_token_ids, "sorted_token_ids")
    expert_ids = _t(expert_ids, "expert_ids")
    num_tokens_post_padded = _t(num_tokens_post_padded, "num_tokens_post_padded")
    topk_weights, bias = _t(topk_weights, "topk_weights"), _t(bias, "bias")
    _check_float("a", a, ndim=2)
    _check_float("w", w, ndim=3)
    if w.shape[2] != a.shape[1]:
        raise ValueError(f"w: expected inner dimension {a.shape[1]} to match a, "
                         f"got shape {tuple(w.shape)}")
    _check_int("sorted_token_ids", sorted_token_ids, ndim=1)
    _check_int("expert_ids", expert_ids, ndim=1)
    top_k = _positive_int("top_k", top_k)
    block_size = _positive_int("block_size", block_size)
    num_slots = a.shape[0] * top_k
    n = w.shape[1]
    if mul_routed_weight:
        if topk_weights is None:
            raise ValueError("topk_weights: expected weights when mul_routed_weight=True, got None")
        if topk_weights.numel() != num_slots:
            raise ValueError(f"topk_weights: expected {num_slots} entries (a rows * top_k), "
                             f"got shape {tuple(topk_weights.shape)}")
    if bias is not None and tuple(bias.shape) != (w.shape[0], n):
        raise ValueError(f"bias: expected shape {(w.shape[0], n)}, got {tuple(bias.shape)}")

    cdt = _compute_dtype(a.dtype)
    c = torch.full((num_slots, n), math.nan, dtype=cdt, device=a.device)
    s, e = _grouped_rows(sorted_token_ids, expert_ids, num_tokens_post_padded, block_size,
                         num_slots)
    off_rank = e < 0
    if bool(off_rank.any()):
        c[s[off_rank]] = 0                      # experts of other EP ranks: zeros, as vLLM
    s, e = s[~off_rank], e[~off_rank]
    if s.numel():
        ok = impl == "grouped_mm" and grouped_mm_supported(a, w)[0]
        if ok:
            y = _gemm_grouped_mm(a, w, s, e, top_k, cdt)
        else:
            y = _gemm_loop(a, w, s, e, top_k, cdt)
        if bias is not None:
            y = y + bias.to(cdt)[e]
        if mul_routed_weight:
            y = y * topk_weights.reshape(-1).to(cdt)[s][:, None]
        c[s] = y
    return c.to(a.dtype)


def _gemm_loop(a, w, s, e, top_k, cdt):
    """One matmul per expert that has rows: y[i] = a[s_i // top_k] @ w[e_i].T, fp32."""
    import torch

    y = torch.empty((s.numel(), w.shape[1]), dtype=cdt, device=a.device)
    for ex in torch.unique(e).tolist():
        rows = (e == ex).nonzero().squeeze(1)
        y[rows] = a[s[rows] // top_k].to(cdt) @ w[ex].to(cdt).T
    return y


def _gemm_grouped_mm(a, w, s, e, top_k, cdt):
    """Rows gathered in expert order, one torch._grouped_mm, scattered back. On the CPU the
    product is fp32; on CUDA it is bf16 (torch rounds there)."""
    import torch

    order = torch.sort(e, stable=True).indices
    x = a[s[order] // top_k]                                             # [n, Kdim]
    offs = torch.cumsum(torch.bincount(e, minlength=w.shape[0]), 0).int()
    if a.device.type == "cpu":
        x, wt = x.to(cdt), w.to(cdt)
    else:
        wt = w
    y_sorted = torch._grouped_mm(x, wt.transpose(1, 2), offs=offs).to(cdt)
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted
    return y


# ----------------------------------------------------------------------------- activation
def _act(name, x):
    import torch
    import torch.nn.functional as F

    if name == "silu":
        return x * torch.sigmoid(x)
    if name == "gelu":
        return F.gelu(x, approximate="none")
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu2":
        return torch.relu(x) ** 2
    raise ValueError(name)


def _gate_up(x):
    _check_float("x", x, ndim=2)
    if x.shape[1] % 2:
        raise ValueError(f"x: expected an even last dimension (gate and up), "
                         f"got shape {tuple(x.shape)}")
    xc = x.to(_compute_dtype(x.dtype))
    h = x.shape[1] // 2
    return xc[:, :h], xc[:, h:]


def _gated(name, x):
    """act(gate) rounded to x's dtype, times up in fp32, rounded again: vLLM's
    (T)(ACT(gate) * (float)up), where ACT returns a T (exact for fp32 / fp64)."""
    x = _t(x)
    gate, up = _gate_up(x)
    act = _act(name, gate).to(x.dtype).to(gate.dtype)
    return (act * up).to(x.dtype)


def silu_and_mul(x):
    """silu(x[:, :N/2]) * x[:, N/2:] -> [M, N/2]"""
    return _gated("silu", x)


def gelu_and_mul(x):
    """gelu(x[:, :N/2]) (exact erf) * x[:, N/2:] -> [M, N/2]"""
    return _gated("gelu", x)


def gelu_tanh_and_mul(x):
    """gelu_tanh(x[:, :N/2]) * x[:, N/2:] -> [M, N/2]"""
    return _gated("gelu_tanh", x)


def swigluoai_and_mul(x, alpha=1.702, limit=7.0):
    """gpt-oss: gate = min(x[:, 0::2], limit), up = clip(x[:, 1::2], -limit, limit),
    out = ((up + 1) * gate) / (1 + exp(-alpha * gate)) (vLLM's order, one rounding) -> [M, N/2]"""
    import torch

    x = _t(x)
    _check_float("x", x, ndim=2)
    if x.shape[1] % 2:
        raise ValueError(f"x: expected an even last dimension (gate and up), "
                         f"got shape {tuple(x.shape)}")
    xc = x.to(_compute_dtype(x.dtype))
    gate = torch.clamp(xc[:, 0::2], max=limit)
    up = torch.clamp(xc[:, 1::2], -limit, limit)
    return (((up + 1) * gate) / (1 + torch.exp(-alpha * gate))).to(x.dtype)


_GATED = {"silu": silu_and_mul, "gelu": gelu_and_mul, "gelu_tanh": gelu_tanh_and_mul,
          "swigluoai": swigluoai_and_mul}


def apply_activation(x, activation="silu", is_act_and_mul=True):
    """[M, N] -> [M, N/2] (gated: act(gate) * up) or [M, N] (no-mul, elementwise).
    Accepts vLLM's "<name>_no_mul" spelling."""
    x = _t(x)
    if isinstance(activation, str) and activation.endswith("_no_mul"):
        activation, is_act_and_mul = activation[: -len("_no_mul")], False
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if is_act_and_mul:
        if activation not in _GATED:
            raise ValueError(f"activation: {activation!r} has no gated form; expected one of "
                             f"{sorted(_GATED)} with is_act_and_mul=True")
        return _GATED[activation](x)
    if activation == "swigluoai":
        raise ValueError("activation: 'swigluoai' needs is_act_and_mul=True")
    _check_float("x", x, ndim=2)
    return _act(activation, x.to(_compute_dtype(x.dtype))).to(x.dtype)


# ----------------------------------------------------------------------------- combine
def moe_sum(x, topk_ids=None, expert_map=None):
    """[T, K, H] -> [T, H]: fp32 sum over K, rounded once to x.dtype. With topk_ids [T, K]
    (vLLM's pad-aware moe_sum) a slot with a negative id, or with expert_map a non-local
    expert, is skipped (its row is never read)."""
    import torch

    x = _t(x)
    _check_float("x", x, ndim=3)
    acc = x.to(_compute_dtype(x.dtype))
    if topk_ids is None:
        return acc.sum(dim=1).to(x.dtype)
    ids = _t(topk_ids, "topk_ids").to(x.device).long()
    _check_int("topk_ids", ids, ndim=2)
    if tuple(ids.shape) != tuple(x.shape[:2]):
        raise ValueError(f"topk_ids: expected shape {tuple(x.shape[:2])}, got {tuple(ids.shape)}")
    live = ids >= 0
    if expert_map is not None:
        emap = _t(expert_map, "expert_map").to(x.device).long()
        inside = live & (ids < emap.numel())
        live = inside & (emap[torch.where(inside, ids, 0)] >= 0)
    return torch.where(live[:, :, None], acc, torch.zeros((), dtype=acc.dtype,
                                                          device=acc.device)).sum(1).to(x.dtype)


# ----------------------------------------------------------------------------- contiguous layout
def moe_permute(hidden_states, topk_ids, num_experts):
    """Rows of hidden_states grouped by expert (stable in s). Returns (x_grouped [P, H],
    expert_offsets int32 [E+1], inv_permuted_idx int32 [P])."""
    import torch

    hidden_states, topk_ids = _t(hidden_states, "hidden_states"), _t(topk_ids, "topk_ids")
    _check_float("hidden_states", hidden_states, ndim=2)
    _check_int("topk_ids", topk_ids, ndim=2)
    e = _positive_int("num_experts", num_experts)
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices                         # grouped row -> s
    inv = torch.empty_like(order)
    inv[order] = torch.arange(flat.numel(), device=flat.device)
    offsets = torch.zeros(e + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(torch.bincount(flat, minlength=e), 0)
    return hidden_states[order // k], offsets, inv.int()


def moe_unpermute(y_grouped, topk_weights, inv_permuted_idx):
    """out[t] = sum_k w[t, k] * y_grouped[inv[t*K + k]] in fp32, rounded once."""
    y_grouped, topk_weights = _t(y_grouped, "y_grouped"), _t(topk_weights, "topk_weights")
    inv = _t(inv_permuted_idx, "inv_permuted_idx")
    t, k = topk_weights.shape
    cdt = _compute_dtype(y_grouped.dtype)
    y = y_grouped.to(cdt)[inv.long()].reshape(t, k, -1)
    return (y * topk_weights.to(cdt)[:, :, None]).sum(1).to(y_grouped.dtype)


def grouped_mm(x_grouped, w, expert_offsets, *, impl=None):
    """y[rows of e] = x_grouped[rows of e] @ w[e].T; x [P, Kdim], w [E, N, Kdim],
    expert_offsets [E+1] -> [P, N] in x's dtype. impl "loop" or "grouped_mm"."""
    import torch

    x_grouped, w = _t(x_grouped, "x_grouped"), _t(w, "w")
    offs = _t(expert_offsets, "expert_offsets")
    impl = impl or default_gemm_impl()
    cdt = _compute_dtype(x_grouped.dtype)
    if impl == "grouped_mm" and grouped_mm_supported(x_grouped, w)[0] and x_grouped.shape[0]:
        if x_grouped.device.type == "cpu":
            y = torch._grouped_mm(x_grouped.to(cdt), w.to(cdt).transpose(1, 2),
                                  offs=offs[1:].int())
        else:
            y = torch._grouped_mm(x_grouped, w.transpose(1, 2), offs=offs[1:].int())
        return y.to(x_grouped.dtype)
    y = torch.zeros((x_grouped.shape[0], w.shape[1]), dtype=cdt, device=x_grouped.device)
    bounds = offs.tolist()
    for ex in range(w.shape[0]):
        lo, hi = bounds[ex], bounds[ex + 1]
        if hi > lo:
            y[lo:hi] = x_grouped[lo:hi].to(cdt) @ w[ex].to(cdt).T
    return y.to(x_grouped.dtype)


# ----------------------------------------------------------------------------- whole layer
def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
                  is_act_and_mul=True, w1_bias=None, w2_bias=None, *, impl="loop"):
    """The whole expert computation the way a torch user writes it, for benchmarks.

    impl="loop": for each expert, its tokens' rows; act(x @ w1[e].T) @ w2[e].T; scatter-add
        weighted into the output (the loop of gpt-fast / Hugging Face ports).
    impl="grouped_mm": moe_permute, two torch._grouped_mm with the activation between,
        moe_unpermute (falls back to a loop per expert where _grouped_mm cannot run); it
        needs every id in [0, E), where the loop skips a -1 slot.
    hidden_states [T, H], w1 [E, 2I, H], w2 [E, H, I], topk_weights / topk_ids [T, K]
    -> [T, H] in hidden_states' dtype.
    """
    import torch

    hidden_states, w1, w2 = _t(hidden_states), _t(w1), _t(w2)
    topk_weights, topk_ids = _t(topk_weights), _t(topk_ids)
    w1_bias, w2_bias = _t(w1_bias), _t(w2_bias)
    if impl == "grouped_mm":
        num_experts = w1.shape[0]
        x, offsets, inv = moe_permute(hidden_states, topk_ids, num_experts)
        h = grouped_mm(x, w1, offsets, impl="grouped_mm")
        if w1_bias is not None:
            h = _add_row_bias(h, w1_bias, offsets)
        h = apply_activation(h, activation, is_act_and_mul)
        y = grouped_mm(h, w2, offsets, impl="grouped_mm")
        if w2_bias is not None:
            y = _add_row_bias(y, w2_bias, offsets)
        return moe_unpermute(y, topk_weights, inv)
    if impl != "loop":
        raise ValueError(f"impl: expected one of {GEMM_IMPLS}, got {impl!r}")
    t, k = topk_ids.shape
    cdt = _compute_dtype(hidden_states.dtype)
    out = torch.zeros((t, w2.shape[1]), dtype=cdt, device=hidden_states.device)
    flat = topk_ids.reshape(-1).long()
    for ex in torch.unique(flat).tolist():
        if not 0 <= ex < w1.shape[0]:
            continue                          # -1: a slot routed nowhere adds nothing
        slots = (flat == ex).nonzero().squeeze(1)                          # [n]
        tok = slots // k
        h = hidden_states[tok].to(cdt) @ w1[ex].to(cdt).T
        if w1_bias is not None:
            h = h + w1_bias[ex].to(cdt)
        h = apply_activation(h.to(hidden_states.dtype), activation, is_act_and_mul).to(cdt)
        y = h @ w2[ex].to(cdt).T
        if w2_bias is not None:
            y = y + w2_bias[ex].to(cdt)
        out.index_add_(0, tok, y * topk_weights.reshape(-1)[slots].to(cdt)[:, None])
    return out.to(hidden_states.dtype)


def _add_row_bias(y, bias, offsets):
    import torch

    counts = (offsets[1:] - offsets[:-1]).long()
    rows_expert = torch.repeat_interleave(torch.arange(bias.shape[0], device=y.device), counts)
    return (y.float() + bias.float()[rows_expert]).to(y.dtype)


# ----------------------------------------------------------------------------- script
def _main():  # pragma: no cover - a demo
    from .layer import FusedMoE
    from .validate import validate

    moe = FusedMoE.random(seed=0, num_experts=8, top_k=2, hidden_size=64, intermediate_size=96)
    x, logits = moe.random_inputs(33, seed=1)
    print(validate(moe, x, logits, backends=["reference", "torch"]).table())


if __name__ == "__main__":  # pragma: no cover
    _main()
