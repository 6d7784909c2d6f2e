"""The experts (`reference/experts.py`): fused_experts and fused_moe.

    T = tokens, E = experts, K = top-k, H = hidden, I = intermediate, B = block size,
    P = T*K slots (s = t*K + k)

Against the loop over (token, slot) pairs in float64 (`oracles.fused_experts_loop`) for
small shapes and the torch per-expert implementation for vLLM's big ones; relative
Frobenius error keyed by the dtype the reference ran in (oracles.TOL). The stages alone:
test_gemm.py, test_combine.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from tests.oracles import (
    BF16,
    TOL,
    assert_close,
    distinct_topk_ids,
    expert_map_loop,
    fused_experts_loop,
    llama4_loop,
    local_weights,
    moe_weights,
    random_weights,
    rel_err,
    rng_for,
    route_loop,
    torch_fused_moe,
    uniform,
)

from reference import (
    determine_expert_map,
    fused_experts,
    fused_moe,
    llama4_custom_routing_function,
    select_experts,
)

DTYPES = [np.float32, BF16, np.float16, np.float64]
dtype_id = lambda d: np.dtype(d).name


def experts_inputs(rng, num_tokens, num_experts, topk, hidden, inter, dtype=np.float32,
                   gated=True, bias=False):
    """x [T, H], w1 [E, 2I or I, H], w2 [E, H, I], weights [T, K] f32, ids [T, K], biases."""
    x = uniform(rng, (num_tokens, hidden), 1.0, dtype)
    w1, w2, b1, b2 = moe_weights(rng, num_experts, hidden, inter, dtype, gated, bias)
    ids = distinct_topk_ids(rng, num_tokens, num_experts, topk)
    return x, w1, w2, random_weights(rng, num_tokens, topk), ids, b1, b2


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=dtype_id)
@pytest.mark.parametrize("ep", [False, True], ids=["noep", "ep"])
def test_fused_experts_with_slots_routed_nowhere(dtype, ep):
    """topk_ids with -1 (vLLM's marker for masked / padded tokens): those slots add nothing,
    end to end. Alignment skips them, so the GEMMs never write their rows (NaN in the
    reference); the combine leaves them out. A token with every slot -1 gets zeros."""
    rng = rng_for("fused_experts -1", dtype_id(dtype), ep)
    num_experts = 8
    x, w1, w2, weights, ids, _, _ = experts_inputs(rng, 12, num_experts, 3, 32, 24, dtype)
    ids[2] = -1                                        # a padded token
    ids[5, 0] = -1
    ids[9, 2] = -1
    kwargs = {}
    if ep:
        _, expert_map = determine_expert_map(2, 1, num_experts)
        w1, w2 = local_weights(expert_map, w1, w2)
        kwargs = {"expert_map": expert_map, "global_num_experts": num_experts}
    out = fused_experts(x, w1, w2, weights, ids, block_size=4, **kwargs)
    assert np.isfinite(out.astype(np.float32)).all()
    assert (out[2] == 0).all()
    want = fused_experts_loop(x, w1, w2, weights, ids, expert_map=kwargs.get("expert_map"))
    assert_close(out, want, dtype)
    # the same as pointing those slots at any expert with weight 0
    ids0, w0 = ids.copy(), weights.copy()
    w0[ids0 < 0] = 0
    ids0[ids0 < 0] = 0
    assert_close(out, fused_experts(x, w1, w2, w0, ids0, block_size=4, **kwargs), dtype,
                 tol=1e-6 if np.dtype(dtype) == np.float32 else None)


# --------------------------------------------------------------------------------------------
# fused_experts against the loop over (token, slot) pairs
# --------------------------------------------------------------------------------------------

ACTIVATIONS = [("silu", True), ("gelu", True), ("gelu_tanh", True), ("swigluoai", True),
               ("silu", False), ("gelu", False), ("gelu_tanh", False), ("relu2", False)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("activation, is_act_and_mul", ACTIVATIONS,
                         ids=[f"{a}{'' if m else '_no_mul'}" for a, m in ACTIVATIONS])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_fused_experts_matches_loop(dtype, activation, is_act_and_mul, with_bias):
    rng = rng_for("fused_experts", dtype_id(dtype), activation, is_act_and_mul, with_bias)
    x, w1, w2, weights, ids, b1, b2 = experts_inputs(rng, 13, 8, 3, 32, 24, dtype,
                                                     gated=is_act_and_mul, bias=with_bias)
    out = fused_experts(x, w1, w2, weights, ids, activation=activation,
                        is_act_and_mul=is_act_and_mul, w1_bias=b1, w2_bias=b2)
    assert out.dtype == x.dtype and out.shape == x.shape
    want = fused_experts_loop(x, w1, w2, weights, ids, activation, is_act_and_mul,
                              w1_bias=b1, w2_bias=b2)
    assert_close(out, want, dtype)


def test_fused_experts_no_mul_spelling():
    rng = rng_for("no mul spelling")
    x, w1, w2, weights, ids, _, _ = experts_inputs(rng, 5, 4, 2, 16, 8, gated=False)
    a = fused_experts(x, w1, w2, weights, ids, activation="relu2_no_mul")
    b = fused_experts(x, w1, w2, weights, ids, activation="relu2", is_act_and_mul=False)
    np.testing.assert_array_equal(a, b)


def test_down_bias_is_scaled_by_the_router_weight():
    # one token, one slot, w2 = 0: the output is exactly weight * b2 (vLLM adds the bias
    # to the accumulator, then multiplies by the router weight)
    rng = rng_for("bias scaled")
    x, w1, w2, _, _, b1, b2 = experts_inputs(rng, 1, 2, 1, 8, 4, np.float64, bias=True)
    w2[:] = 0.0
    out = fused_experts(x, w1, w2, np.array([[0.25]], np.float32), np.array([[1]]),
                        w1_bias=b1, w2_bias=b2)
    np.testing.assert_allclose(out[0], 0.25 * b2[1], rtol=1e-15)


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float64], ids=dtype_id)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_apply_router_weight_on_input(dtype, with_bias):
    rng = rng_for("weight on input", dtype_id(dtype), with_bias)
    x, w1, w2, weights, ids, b1, b2 = experts_inputs(rng, 17, 6, 1, 32, 16, dtype, bias=with_bias)
    out = fused_experts(x, w1, w2, weights, ids, apply_router_weight_on_input=True,
                        w1_bias=b1, w2_bias=b2)
    want = fused_experts_loop(x, w1, w2, weights, ids, apply_router_weight_on_input=True,
                              w1_bias=b1, w2_bias=b2)
    assert_close(out, want, dtype)
    # and it is not the same as weighing the output (silu is not linear)
    other = fused_experts_loop(x, w1, w2, weights, ids, w1_bias=b1, w2_bias=b2)
    assert rel_err(out, other) > 10 * TOL[np.dtype(dtype)]


@pytest.mark.parametrize("block_size", [1, 5, 16, 64, 256])
def test_block_size_does_not_change_the_result(block_size):
    rng = rng_for("block size", block_size)
    x, w1, w2, weights, ids, _, _ = experts_inputs(rng, 29, 8, 2, 32, 16)
    out = fused_experts(x, w1, w2, weights, ids, block_size=block_size)
    assert_close(out, fused_experts_loop(x, w1, w2, weights, ids), np.float32)


@pytest.mark.parametrize("ep_size", [2, 3, 8])
@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_fused_experts_expert_map_partial_outputs(ep_size, placement, with_bias):
    rng = rng_for("ep partial", ep_size, placement, with_bias)
    num_experts = 8
    x, w1, w2, weights, ids, b1, b2 = experts_inputs(rng, 21, num_experts, 3, 16, 8,
                                                     np.float64, bias=with_bias)
    full = fused_experts(x, w1, w2, weights, ids, w1_bias=b1, w2_bias=b2)
    total = np.zeros_like(full)
    for rank in range(ep_size):
        local, expert_map = determine_expert_map(ep_size, rank, num_experts, placement)
        np.testing.assert_array_equal(expert_map, expert_map_loop(ep_size, rank, num_experts, placement)[1])
        lw1, lw2, lb1, lb2 = local_weights(expert_map, w1, w2, b1, b2)
        assert lw1.shape[0] == local
        part = fused_experts(x, lw1, lw2, weights, ids, global_num_experts=num_experts,
                             expert_map=expert_map, w1_bias=lb1, w2_bias=lb2)
        want = fused_experts_loop(x, lw1, lw2, weights, ids, expert_map=expert_map,
                                  w1_bias=lb1, w2_bias=lb2)
        assert_close(part, want, np.float64, what=f"rank {rank}")
        total += part
    assert_close(total, full, np.float64, what="sum of the ranks")


# --------------------------------------------------------------------------------------------
# Precision modes
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [BF16, np.float16], ids=dtype_id)
def test_engine_mode_low_precision(dtype):
    rng = rng_for("engine", dtype_id(dtype))
    x, w1, w2, weights, ids, b1, b2 = experts_inputs(rng, 40, 8, 2, 64, 48, dtype, bias=True)
    engine = fused_experts(x, w1, w2, weights, ids, w1_bias=b1, w2_bias=b2)
    exact = fused_experts(x, w1, w2, weights, ids, w1_bias=b1, w2_bias=b2, precision="exact")
    assert engine.dtype == np.dtype(dtype)
    assert exact.dtype == np.float64
    assert_close(engine, exact, dtype, what="engine vs exact")
    # exact mode is the oracle's arithmetic on the same (upcast) values
    want = fused_experts_loop(x, w1, w2, weights, ids, w1_bias=b1, w2_bias=b2)
    assert_close(exact, want, np.float64, what="exact vs loop")
    # the engine's roundings are visible: it is not bit-equal to exact rounded once
    assert rel_err(engine, exact) > 0


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_fp32_engine_and_exact(with_bias):
    rng = rng_for("fp32 modes", with_bias)
    x, w1, w2, weights, ids, b1, b2 = experts_inputs(rng, 40, 8, 2, 64, 48, bias=with_bias)
    want = fused_experts_loop(x, w1, w2, weights, ids, w1_bias=b1, w2_bias=b2)
    engine = fused_experts(x, w1, w2, weights, ids, w1_bias=b1, w2_bias=b2)
    exact = fused_experts(x, w1, w2, weights, ids, w1_bias=b1, w2_bias=b2, precision="exact")
    assert engine.dtype == np.float32 and exact.dtype == np.float64
    assert_close(engine, want, np.float32)
    assert_close(exact, want, np.float64)


def test_fused_moe_exact_mode():
    rng = rng_for("fused_moe exact")
    x, w1, w2, _, _, _, _ = experts_inputs(rng, 12, 8, 2, 32, 16, BF16)
    logits = rng.standard_normal((12, 8)).astype(np.float32)
    out = fused_moe(x, w1, w2, logits, 2, True, precision="exact")
    assert out.dtype == np.float64
    # the routing stays fp32 math in every mode (checked against the oracle at fp32's
    # tolerance); the experts after it are exact on those weights
    weights, ids, _ = select_experts(x, logits, 2, False, True)
    want_w, want_ids = route_loop(logits, 2, True)
    np.testing.assert_array_equal(ids, want_ids)
    assert_close(weights, want_w, np.float32)
    assert_close(out, fused_experts_loop(x, w1, w2, weights, ids), np.float64)


# --------------------------------------------------------------------------------------------
# fused_moe end to end
# --------------------------------------------------------------------------------------------

def test_fused_moe_routers_end_to_end():
    rng = rng_for("fused_moe routers")
    num_tokens, num_experts, hidden, inter = 19, 16, 32, 16
    x, w1, w2, _, _, b1, b2 = experts_inputs(rng, num_tokens, num_experts, 1, hidden, inter, bias=True)
    logits = rng.standard_normal((num_tokens, num_experts)).astype(np.float32)
    bias = (rng.standard_normal(num_experts) * 0.1).astype(np.float32)

    def check(out, weights, ids, **kwargs):
        want = fused_experts_loop(x, w1, w2, weights.astype(np.float32), ids, w1_bias=b1,
                                  w2_bias=b2, **kwargs)
        assert_close(out, want, np.float32)

    common = {"w1_bias": b1, "w2_bias": b2}
    check(fused_moe(x, w1, w2, logits, 4, True, **common), *route_loop(logits, 4, True))
    check(fused_moe(x, w1, w2, logits, 4, False, e_score_correction_bias=bias,
                    routed_scaling_factor=2.5, **common),
          *route_loop(logits, 4, False, bias=bias, routed_scaling_factor=2.5))
    check(fused_moe(x, w1, w2, logits, 4, True, use_grouped_topk=True, num_expert_group=4,
                    topk_group=2, scoring_func="sigmoid", e_score_correction_bias=bias,
                    routed_scaling_factor=2.5, **common),
          *route_loop(logits, 4, True, "sigmoid", bias, 4, 2, 2.5))
    check(fused_moe(x, w1, w2, logits, 1, False,
                    custom_routing_function=llama4_custom_routing_function,
                    apply_router_weight_on_input=True, **common),
          *llama4_loop(logits, 1), apply_router_weight_on_input=True)


def test_nan_stays_confined_to_its_token():
    rng = rng_for("nan confined")
    num_tokens, num_experts = 10, 8
    x, w1, w2, _, _, _, _ = experts_inputs(rng, num_tokens, num_experts, 2, 32, 16)
    logits = rng.standard_normal((num_tokens, num_experts)).astype(np.float32)
    logits[3, 5] = np.nan                         # softmax: token 3's weights are all 0
    x[6, 0] = np.nan                               # a NaN activation: token 6 only
    out = fused_moe(x, w1, w2, logits, 2, True)
    assert (out[3] == 0).all() and np.isnan(out[6]).all()
    clean = [t for t in range(num_tokens) if t not in (3, 6)]
    assert np.isfinite(out[clean]).all()
    alone = fused_moe(x[clean], w1, w2, logits[clean], 2, True)
    assert_close(out[clean], alone, np.float32, tol=1e-6, what="the other tokens")
    # sigmoid scoring: the NaN expert is skipped and the token's output stays finite
    out = fused_moe(x[clean], w1, w2, np.where(np.arange(num_experts) == 5, np.nan,
                                              logits[clean]).astype(np.float32), 2, True,
                    scoring_func="sigmoid")
    assert np.isfinite(out).all()


# --------------------------------------------------------------------------------------------
# vLLM's fused_moe grid: (T, I, H) x E x top-k x EP size
# --------------------------------------------------------------------------------------------

NKM = [(1, 128, 128), (1, 2048, 128), (33, 2048, 128), (222, 1024, 1024)]
# EP varies fastest so the two EP sizes of one case share its inputs and oracle (cache below)
FUSED_MOE_GRID = [pytest.param(*shape, e, k, ep, marks=[pytest.mark.slow] if shape[0] == 222 else [],
                               id=f"T{shape[0]}-I{shape[1]}-H{shape[2]}-E{e}-top{k}-ep{ep}")
                  for shape in NKM for e in (8, 64) for k in (2, 6) for ep in (1, 4)]


@functools.lru_cache(maxsize=1)
def grid_case(num_tokens, inter, hidden, num_experts, topk):
    """Inputs (seeded by the case) and the oracle's output: the loop over (token, slot)
    pairs in fp64 for the small shapes, torch per expert in fp32 for T=222 (a loop of 1332
    fp64 matvecs over 8 MB weights each would take most of CI's time budget)."""
    rng = rng_for("fused_moe grid", num_tokens, inter, hidden, num_experts, topk)
    x = uniform(rng, (num_tokens, hidden), 1.0)
    w1, w2, _, _ = moe_weights(rng, num_experts, hidden, inter, pool=True)
    logits = rng.standard_normal((num_tokens, num_experts)).astype(np.float32)
    if num_tokens * topk > 200:
        pytest.importorskip("torch")
        want = torch_fused_moe(x, w1, w2, logits, topk, False, compute_dtype="float32")
    else:
        weights, ids = route_loop(logits, topk, False)
        want = fused_experts_loop(x, w1, w2, weights.astype(np.float32), ids)
    return x, w1, w2, logits, want


@pytest.mark.parametrize("num_tokens, inter, hidden, num_experts, topk, ep_size", FUSED_MOE_GRID)
def test_fused_moe_vllm_grid(num_tokens, inter, hidden, num_experts, topk, ep_size):
    x, w1, w2, logits, want = grid_case(num_tokens, inter, hidden, num_experts, topk)
    if ep_size == 1:
        out = fused_moe(x, w1, w2, logits, topk, False)
        assert out.dtype == np.float32
    else:
        # each rank holds its experts (determine_expert_map) and computes a partial output;
        # their sum is the layer
        out = np.zeros(x.shape)
        for rank in range(ep_size):
            _, expert_map = determine_expert_map(ep_size, rank, num_experts)
            lw1, lw2 = local_weights(expert_map, w1, w2)
            out += fused_moe(x, lw1, lw2, logits, topk, False, global_num_experts=num_experts,
                             expert_map=expert_map)
    assert_close(out, want, np.float32)
