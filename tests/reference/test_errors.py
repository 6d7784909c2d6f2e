"""Bad inputs and empty batches.

A bad call raises ValueError or TypeError whose message starts with the argument's name
and says what was expected (and what came), so that it fails at the line that made it.
An empty batch (T = 0) returns empty outputs of the right shapes and dtypes everywhere.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from tests.oracles import BF16, distinct_topk_ids, random_weights, uniform

from reference import (
    apply_activation,
    determine_expert_map,
    fused_experts,
    fused_moe,
    fused_topk,
    fused_topk_bias,
    grouped_gemm,
    grouped_mm,
    grouped_topk,
    llama4_custom_routing_function,
    moe_align_block_size,
    moe_permute,
    moe_sum,
    moe_unpermute,
    select_experts,
)

T, E, K, H, I, B = 5, 8, 2, 16, 12, 4
rng = np.random.default_rng(2024)
X = uniform(rng, (T, H))                                   # [T, H]
LOGITS = rng.standard_normal((T, E)).astype(np.float32)    # [T, E]
IDS = distinct_topk_ids(rng, T, E, K)                      # [T, K]
WEIGHTS = random_weights(rng, T, K)                        # [T, K]
W1 = uniform(rng, (E, 2 * I, H), 0.25)                     # [E, 2I, H]
W2 = uniform(rng, (E, H, I), 0.25)                         # [E, H, I]
ALIGNED = moe_align_block_size(IDS, B, E)


def experts(**overrides):
    kwargs = {"hidden_states": X, "w1": W1, "w2": W2, "topk_weights": WEIGHTS, "topk_ids": IDS}
    kwargs.update(overrides)
    return lambda: fused_experts(**kwargs)


def gemm(**overrides):
    kwargs = {"a": X, "w": W1, "sorted_token_ids": ALIGNED[0], "expert_ids": ALIGNED[1],
                  "num_tokens_post_padded": ALIGNED[2], "top_k": K, "block_size": B}
    kwargs.update(overrides)
    return lambda: grouped_gemm(**kwargs)


# (id, call, exception, the argument the message must name)
BAD = [
    # routing
    ("logits_1d", lambda: fused_topk(None, LOGITS[0], K, True), ValueError, "gating_output"),
    ("logits_list", lambda: fused_topk(None, LOGITS.tolist(), K, True), TypeError, "gating_output"),
    ("logits_int", lambda: fused_topk(None, IDS, 1, True), TypeError, "gating_output"),
    ("hidden_rows", lambda: fused_topk(X[:3], LOGITS, K, True), ValueError, "hidden_states"),
    ("topk_0", lambda: fused_topk(None, LOGITS, 0, True), ValueError, "topk"),
    ("topk_over_E", lambda: fused_topk(None, LOGITS, E + 1, True), ValueError, "topk"),
    ("topk_float", lambda: fused_topk(None, LOGITS, 2.0, True), TypeError, "topk"),
    ("bias_shape", lambda: fused_topk_bias(None, LOGITS, "softmax", np.zeros(E + 1, np.float32),
                                           K, True), ValueError, "e_score_correction_bias"),
    ("bias_int", lambda: fused_topk_bias(None, LOGITS, "softmax", np.zeros(E, np.int32), K, True),
     TypeError, "e_score_correction_bias"),
    ("bias_scoring_func", lambda: fused_topk_bias(None, LOGITS, "softplus", np.zeros(E, np.float32),
                                                  K, True), ValueError, "scoring_func"),
    # the pre-scoring_func argument order: a bias where scoring_func goes
    ("bias_old_order", lambda: fused_topk_bias(None, LOGITS, np.zeros(E, np.float32), K, True, 2.5),
     TypeError, "scoring_func"),
    ("topk_scoring_func", lambda: fused_topk(None, LOGITS, K, True, scoring_func="tanh"),
     ValueError, "scoring_func"),
    ("groups_not_dividing", lambda: grouped_topk(None, LOGITS, K, True, 3, 1), ValueError,
     "num_expert_group"),
    ("groups_0", lambda: grouped_topk(None, LOGITS, K, True, 0, 0), ValueError, "num_expert_group"),
    ("topk_group_over_groups", lambda: grouped_topk(None, LOGITS, K, True, 4, 5), ValueError,
     "topk_group"),
    ("topk_over_kept_experts", lambda: grouped_topk(None, LOGITS, 3, True, 4, 1), ValueError, "topk"),
    ("grouped_topk_over_E", lambda: grouped_topk(None, LOGITS, E + 1, True, 1, 1), ValueError, "topk"),
    ("scoring_unknown", lambda: grouped_topk(None, LOGITS, K, True, 1, 1, scoring_func="tanh"),
     ValueError, "scoring_func"),
    ("select_scoring_unknown", lambda: select_experts(X, LOGITS, K, False, True, scoring_func="relu"),
     ValueError, "scoring_func"),
    ("select_grouped_without_groups", lambda: select_experts(X, LOGITS, K, True, True),
     ValueError, "use_grouped_topk"),
    ("select_zero_without_E", lambda: select_experts(X, LOGITS, K, False, True, zero_expert_num=2,
                                                     zero_expert_type="identity"),
     ValueError, "global_num_experts"),
    ("zero_type_unknown", lambda: select_experts(X, LOGITS, K, False, True, zero_expert_num=2,
                                                 zero_expert_type="copy", global_num_experts=6),
     ValueError, "zero_expert_type"),
    ("llama4_topk_over_E", lambda: llama4_custom_routing_function(None, LOGITS, E + 1, False),
     ValueError, "topk"),
    # alignment and the contiguous layout
    ("ids_float", lambda: moe_align_block_size(IDS.astype(np.float32), B, E), TypeError, "topk_ids"),
    ("ids_1d", lambda: moe_align_block_size(IDS.ravel(), B, E), ValueError, "topk_ids"),
    ("block_0", lambda: moe_align_block_size(IDS, 0, E), ValueError, "block_size"),
    ("num_experts_0", lambda: moe_align_block_size(IDS, B, 0), ValueError, "num_experts"),
    ("expert_map_shape", lambda: moe_align_block_size(IDS, B, E, expert_map=np.zeros(E - 1, np.int32)),
     ValueError, "expert_map"),
    ("expert_map_below_minus_1",
     lambda: moe_align_block_size(IDS, B, E, expert_map=np.full(E, -2, np.int32)), ValueError,
     "expert_map"),
    ("permute_rows", lambda: moe_permute(X[:3], IDS, E), ValueError, "topk_ids"),
    ("permute_ids_over_E", lambda: moe_permute(X, IDS, 4), ValueError, "topk_ids"),
    ("unpermute_rows", lambda: moe_unpermute(X, WEIGHTS, np.arange(T * K, dtype=np.int32)),
     ValueError, "y_grouped"),
    ("unpermute_inv_shape", lambda: moe_unpermute(uniform(rng, (T * K, H)), WEIGHTS,
                                                  np.arange(T, dtype=np.int32)),
     ValueError, "inv_permuted_idx"),
    ("grouped_mm_inner", lambda: grouped_mm(uniform(rng, (T * K, H + 1)), W1,
                                            np.zeros(E + 1, np.int32)), ValueError, "w"),
    ("grouped_mm_offsets", lambda: grouped_mm(uniform(rng, (T * K, H)), W1, np.zeros(E, np.int32)),
     ValueError, "expert_offsets"),
    # activation
    ("activation_unknown", lambda: apply_activation(uniform(rng, (3, 8)), "tanh"), ValueError,
     "activation"),
    ("activation_odd_width", lambda: apply_activation(uniform(rng, (3, 7)), "silu"), ValueError, "x"),
    ("activation_3d", lambda: apply_activation(uniform(rng, (3, 2, 8)), "silu"), ValueError, "x"),
    ("activation_int", lambda: apply_activation(IDS, "silu"), TypeError, "x"),
    ("relu2_gated", lambda: apply_activation(uniform(rng, (3, 8)), "relu2"), ValueError, "activation"),
    ("swigluoai_no_mul", lambda: apply_activation(uniform(rng, (3, 8)), "swigluoai", False),
     ValueError, "activation"),
    # grouped_gemm and moe_sum
    ("gemm_w_dtype", gemm(w=W1.astype(np.float64)), TypeError, "w"),
    ("gemm_w_inner", gemm(w=W2), ValueError, "w"),
    ("gemm_post_padded", gemm(num_tokens_post_padded=ALIGNED[2] + 1), ValueError,
     "num_tokens_post_padded"),
    ("gemm_expert_ids", gemm(expert_ids=ALIGNED[1] + E), ValueError, "expert_ids"),
    ("gemm_mul_without_weights", gemm(mul_routed_weight=True), ValueError, "topk_weights"),
    ("gemm_weights_size", gemm(mul_routed_weight=True, topk_weights=WEIGHTS[:2]), ValueError,
     "topk_weights"),
    ("gemm_bias_shape", gemm(bias=np.zeros((E, 3), np.float32)), ValueError, "bias"),
    ("moe_sum_2d", lambda: moe_sum(X), ValueError, "x"),
    # fused_experts
    ("hidden_3d", experts(hidden_states=X[None]), ValueError, "hidden_states"),
    ("hidden_int", experts(hidden_states=IDS), TypeError, "hidden_states"),
    ("w1_hidden", experts(w1=W1[:, :, :-1]), ValueError, "w1"),
    ("w1_not_2I", experts(w1=W1[:, :-1]), ValueError, "w1"),
    ("w2_experts", experts(w2=W2[:-1]), ValueError, "w2"),
    ("w2_hidden", experts(w2=W2[:, :-1]), ValueError, "w2"),
    ("w1_dtype", experts(w1=W1.astype(np.float64)), TypeError, "w1"),
    ("w2_dtype", experts(w2=W2.astype(BF16)), TypeError, "w2"),
    ("experts_ids_rows", experts(topk_ids=IDS[:3]), ValueError, "topk_ids"),
    ("experts_ids_float", experts(topk_ids=IDS.astype(np.float32)), TypeError, "topk_ids"),
    ("weights_shape", experts(topk_weights=WEIGHTS[:, :1]), ValueError, "topk_weights"),
    ("w1_bias_shape", experts(w1_bias=np.zeros((E, I), np.float32)), ValueError, "w1_bias"),
    ("w2_bias_shape", experts(w2_bias=np.zeros((E, I), np.float32)), ValueError, "w2_bias"),
    ("experts_activation", experts(activation="mish"), ValueError, "activation"),
    ("router_weight_on_input_topk2", experts(apply_router_weight_on_input=True), ValueError,
     "apply_router_weight_on_input"),
    ("precision_unknown", experts(precision="half"), ValueError, "precision"),
    ("global_experts_without_map", experts(global_num_experts=2 * E), ValueError,
     "global_num_experts"),
    ("experts_block_negative", experts(block_size=-1), ValueError, "block_size"),
    ("fused_moe_topk_over_E", lambda: fused_moe(X, W1, W2, LOGITS, E + 1, True), ValueError, "topk"),
    ("fused_moe_logits_rows", lambda: fused_moe(X, W1, W2, LOGITS[:2], K, True), ValueError,
     "hidden_states"),
    # the router's width against the experts: 6 columns for 8 experts used to route silently
    # to experts 0..5, 10 columns to fail at topk_ids
    ("fused_moe_logits_narrow", lambda: fused_moe(X, W1, W2, LOGITS[:, :6], K, True), ValueError,
     "gating_output"),
    ("fused_moe_logits_wide", lambda: fused_moe(X, W1, W2, np.tile(LOGITS, 2), K, True),
     ValueError, "gating_output"),
    ("fused_moe_logits_vs_global", lambda: fused_moe(
        X, W1[:4], W2[:4], LOGITS[:, :6], K, True, global_num_experts=E,
        expert_map=np.r_[np.arange(4), np.full(4, -1)].astype(np.int32)), ValueError,
     "gating_output"),
    ("select_logits_vs_global", lambda: select_experts(X, LOGITS[:, :6], K, False, True,
                                                       global_num_experts=E),
     ValueError, "router_logits"),
    ("select_logits_vs_zero_experts", lambda: select_experts(
        X, LOGITS, K, False, True, global_num_experts=E, zero_expert_num=2,
        zero_expert_type="identity"), ValueError, "router_logits"),
    ("select_grouped_logits_vs_global", lambda: select_experts(
        X, LOGITS[:, :4], K, True, True, topk_group=1, num_expert_group=2,
        global_num_experts=E), ValueError, "router_logits"),
    # expert map
    ("ep_rank_over", lambda: determine_expert_map(4, 4, E), ValueError, "ep_rank"),
    ("ep_size_0", lambda: determine_expert_map(0, 0, E), ValueError, "ep_size"),
    ("ep_size_over_E", lambda: determine_expert_map(E + 1, 0, E), ValueError, "ep_size"),
    ("placement_unknown", lambda: determine_expert_map(2, 0, E, "random"), ValueError, "placement"),
]


BAD.append(("experts_block_0", experts(block_size=0), ValueError, "block_size"))


def _case_id(case):
    return case.values[0] if hasattr(case, "values") else case[0]


def _case_args(case):
    if hasattr(case, "values"):
        return pytest.param(*case.values[1:], marks=case.marks)
    return case[1:]


@pytest.mark.parametrize("call, exc, name", [_case_args(c) for c in BAD], ids=[_case_id(c) for c in BAD])
def test_bad_input_names_the_argument(call, exc, name):
    with pytest.raises(exc, match=rf"^{re.escape(name)}: ") as info:
        call()
    message = str(info.value)
    assert re.search(r"expected|needs", message), f"does not say what was expected: {message}"
    assert re.search(r"got|'", message), f"does not say what came: {message}"


def test_cupy_select_experts_checks_the_width_before_any_device():
    """The CuPy backend's dispatcher is the reference's: a router of the wrong width is
    refused by name before anything touches CuPy (none is needed to see it)."""
    import importlib

    routing = importlib.import_module("cuda_kernels.cupy.routing")
    with pytest.raises(ValueError, match=r"^router_logits: expected 8 columns"):
        routing.select_experts(None, LOGITS[:, :6], K, False, True, global_num_experts=E)


# --------------------------------------------------------------------------------------------
# Batches too big for memory: refused before the first intermediate is allocated
# --------------------------------------------------------------------------------------------

def _tiny_memory(monkeypatch, nbytes):
    from reference import _checks

    monkeypatch.setattr(_checks, "CHECK_ABOVE_BYTES", 0, raising=False)   # check any size
    monkeypatch.setattr(_checks, "available_host_memory", lambda: nbytes, raising=False)


def test_a_batch_that_cannot_fit_fails_at_once_naming_T_and_the_bytes(monkeypatch):
    """A huge T used to run for seconds and end in NumPy's bare MemoryError: the working set
    ([P, 2I] + [P, I] + [P, H] in fp32, P = T*K) is checked first."""
    _tiny_memory(monkeypatch, 1000)
    need = T * K * (2 * I + I + H) * 4
    for call in (experts(), lambda: fused_moe(X, W1, W2, LOGITS, K, True)):
        with pytest.raises(MemoryError, match=rf"^hidden_states: expected .* got T={T} tokens, "
                                              rf"which need at least .*\({need:,} bytes\)"):
            call()
    with pytest.raises(MemoryError, match=rf"\({2 * need:,} bytes\)"):
        experts(precision="exact")()                        # float64 intermediates
    assert fused_experts(X0, W1, W2, WEIGHTS0, IDS0).shape == (0, H)   # T = 0 needs nothing
    _tiny_memory(monkeypatch, need)
    assert experts()().shape == (T, H)                       # exactly enough is enough


def test_available_host_memory_is_a_plausible_number():
    from reference import _checks

    n = _checks.available_host_memory()
    assert n is None or (isinstance(n, int) and 0 <= n < 1 << 60)


# --------------------------------------------------------------------------------------------
# Empty batches
# --------------------------------------------------------------------------------------------

X0 = np.zeros((0, H), np.float32)
LOGITS0 = np.zeros((0, E), np.float32)
IDS0 = np.zeros((0, K), np.int32)
WEIGHTS0 = np.zeros((0, K), np.float32)


def _route_shapes(weights, ids):
    assert weights.shape == (0, K) and weights.dtype == np.float32
    assert ids.shape == (0, K) and ids.dtype == np.int32


def test_empty_batch_routing():
    weights, ids, tei = fused_topk(X0, LOGITS0, K, True)
    _route_shapes(weights, ids)
    assert tei.shape == (0, K)
    _route_shapes(*fused_topk_bias(X0, LOGITS0, "softmax", np.zeros(E, np.float32), K, True))
    _route_shapes(*grouped_topk(X0, LOGITS0, K, True, 4, 2, "sigmoid", 2.5, np.zeros(E, np.float32)))
    _route_shapes(*llama4_custom_routing_function(X0, LOGITS0, K, False))
    weights, ids, zero = select_experts(X0, LOGITS0, K, False, True)
    _route_shapes(weights, ids)
    weights, ids, zero = select_experts(X0, LOGITS0, K, False, True, zero_expert_num=2,
                                        zero_expert_type="identity", global_num_experts=E - 2)
    _route_shapes(weights, ids)
    assert zero.shape == (0, H) and zero.dtype == np.float32


@pytest.mark.parametrize("expert_map", [None, determine_expert_map(2, 1, E)[1]], ids=["full", "ep"])
@pytest.mark.parametrize("pad_sorted_ids", [False, True])
def test_empty_batch_alignment(expert_map, pad_sorted_ids):
    sorted_ids, expert_ids, num_post = moe_align_block_size(IDS0, B, E, expert_map=expert_map,
                                                            pad_sorted_ids=pad_sorted_ids)
    assert sorted_ids.shape == (0,) and expert_ids.shape == (0,) and num_post.tolist() == [0]


def test_empty_batch_permute_and_grouped_mm():
    x_grouped, offsets, inv = moe_permute(X0, IDS0, E)
    assert x_grouped.shape == (0, H) and inv.shape == (0,)
    assert offsets.tolist() == [0] * (E + 1)
    assert grouped_mm(x_grouped, W1, offsets).shape == (0, 2 * I)


def test_empty_batch_unpermute():
    out = moe_unpermute(np.zeros((0, H), np.float32), WEIGHTS0, np.zeros(0, np.int32))
    assert out.shape == (0, H) and out.dtype == np.float32


def test_empty_batch_gemm_activation_sum():
    aligned = moe_align_block_size(IDS0, B, E)
    c = grouped_gemm(X0, W1, *aligned, K, B)
    assert c.shape == (0, 2 * I) and c.dtype == np.float32
    for activation in ("silu", "gelu", "swigluoai"):
        assert apply_activation(c, activation).shape == (0, I)
    assert apply_activation(c, "relu2", False).shape == (0, 2 * I)
    assert moe_sum(np.zeros((0, K, H), BF16)).shape == (0, H)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("precision", ["engine", "exact"])
def test_empty_batch_layer(dtype, precision):
    x0 = X0.astype(dtype)
    w1, w2 = W1.astype(dtype), W2.astype(dtype)
    want_dtype = np.float64 if precision == "exact" else np.dtype(dtype)
    out = fused_experts(x0, w1, w2, WEIGHTS0, IDS0, precision=precision)
    assert out.shape == (0, H) and out.dtype == want_dtype
    local, expert_map = determine_expert_map(2, 0, E)
    out = fused_experts(x0, w1[:local], w2[:local], WEIGHTS0, IDS0, global_num_experts=E,
                        expert_map=expert_map, precision=precision)
    assert out.shape == (0, H) and out.dtype == want_dtype
    out = fused_moe(x0, w1, w2, LOGITS0, K, True, use_grouped_topk=True, num_expert_group=2,
                    topk_group=1, scoring_func="sigmoid", precision=precision)
    assert out.shape == (0, H) and out.dtype == want_dtype
