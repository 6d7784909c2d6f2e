"""The FusedMoE layer: forward against the reference and a hand-written loop, weight loading
(vLLM's rules, TP shards, EP experts), shared and zero experts, NaN on unloaded experts.

    T = tokens, E = experts, K = top-k, H = hidden, I = intermediate, I_p = I / tp_size
"""

from __future__ import annotations

import math
import zlib

import ml_dtypes
import numpy as np
import pytest

import reference
from sandbox import FusedMoE
from sandbox.arrays import BF16

TOL = {np.dtype(np.float32): 1e-5, BF16: 1e-2, np.dtype(np.float16): 1e-2,
       np.dtype(np.float64): 1e-12}


def rng_for(*key):
    """Seeded by the test's own key: fresh data per check, reproducible runs."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{got.shape} != {want.shape}"
    assert np.isfinite(got).all() and np.isfinite(want).all(), "NaN/inf never passes"
    den = np.linalg.norm(want)
    num = np.linalg.norm(got - want)
    return 0.0 if num == 0 else (math.inf if den == 0 else float(num / den))


def inputs(layer, t, *key):
    rng = rng_for("inputs", t, *key)
    x = rng.standard_normal((t, layer.hidden_size)).astype(layer.params_dtype)
    logits = rng.standard_normal((t, layer.num_router_experts)).astype(np.float32)
    return x, logits


# ----------------------------------------------------------------------------- the loop oracle
def _act_f64(v, activation, is_act_and_mul):
    """act on one row (float64), written from docs/stages.md."""
    def silu(z):
        return z / (1 + np.exp(-z))

    def gelu(z):
        return 0.5 * z * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))

    if activation == "swigluoai":
        gate, up = np.minimum(v[0::2], 7.0), np.clip(v[1::2], -7.0, 7.0)
        return (up + 1) * gate / (1 + np.exp(-1.702 * gate))
    fn = {"silu": silu, "gelu": gelu, "relu2": lambda z: np.maximum(z, 0) ** 2}[activation]
    if is_act_and_mul:
        half = v.size // 2
        return fn(v[:half]) * v[half:]
    return fn(v)


def loop_layer(full_w13, full_w2, x, logits, layer, b13=None, b2=None, sh13=None, sh2=None):
    """out[t] = sum_k w[t,k] (W2[e] act(W13[e] x[t] + b13[e]) + b2[e]) + zero + shared, one
    token and one slot at a time in float64 (the routing comes from the reference)."""
    tw, ids, _ = reference.select_experts(
        x, logits, layer.top_k, layer.use_grouped_topk, layer.renormalize,
        topk_group=layer.topk_group, num_expert_group=layer.num_expert_group,
        scoring_func=layer.scoring_func, routed_scaling_factor=layer.routed_scaling_factor,
        e_score_correction_bias=layer.e_score_correction_bias)
    xs = x.astype(np.float64)
    out = np.zeros((x.shape[0], layer.hidden_size))
    for t in range(x.shape[0]):
        for k in range(layer.top_k):
            e, w = int(ids[t, k]), float(tw[t, k])
            if e >= layer.num_experts:                       # a zero expert: identity
                out[t] += w * xs[t]
                continue
            h = full_w13[e].astype(np.float64) @ xs[t]
            if b13 is not None:
                h += b13[e]
            y = full_w2[e].astype(np.float64) @ _act_f64(h, layer.activation, layer.is_act_and_mul)
            if b2 is not None:
                y += b2[e]
            out[t] += w * y
        if sh13 is not None:
            out[t] += sh2.astype(np.float64) @ _act_f64(sh13.astype(np.float64) @ xs[t],
                                                         layer.activation, layer.is_act_and_mul)
    return out


# ----------------------------------------------------------------------------- forward
CONFIGS = {
    "mixtral": dict(num_experts=8, top_k=2),
    "qwen_no_renorm": dict(num_experts=12, top_k=4, renormalize=False),
    "deepseek": dict(num_experts=16, top_k=4, use_grouped_topk=True, num_expert_group=4,
                     topk_group=2, scoring_func="sigmoid", routed_scaling_factor=2.5),
    "deepseek_v4": dict(num_experts=16, top_k=6, scoring_func="sqrtsoftplus",
                        routed_scaling_factor=1.5),
    "gpt_oss": dict(num_experts=8, top_k=2, activation="swigluoai", has_bias=True),
    "gelu": dict(num_experts=6, top_k=2, activation="gelu"),
    "relu2_no_mul": dict(num_experts=6, top_k=2, activation="relu2", is_act_and_mul=False),
    "llama4_on_input": dict(num_experts=5, top_k=1, apply_router_weight_on_input=True),
}


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_equals_reference_fused_moe(name, dtype):
    cfg = dict(CONFIGS[name], hidden_size=32, intermediate_size=48, params_dtype=dtype)
    if name.startswith("deepseek"):
        cfg["e_score_correction_bias"] = (rng_for("bias").standard_normal(16) * 0.1).astype(
            np.float32)
    layer = FusedMoE.random(seed=zlib.crc32(name.encode()), **cfg)
    x, logits = inputs(layer, 29, name, str(dtype))
    got = layer(x, logits)
    want = reference.fused_moe(
        x, layer.w13_weight, layer.w2_weight, logits, layer.top_k, layer.renormalize,
        activation=layer.activation, use_grouped_topk=layer.use_grouped_topk,
        num_expert_group=layer.num_expert_group, topk_group=layer.topk_group,
        scoring_func=layer.scoring_func, routed_scaling_factor=layer.routed_scaling_factor,
        e_score_correction_bias=layer.e_score_correction_bias,
        apply_router_weight_on_input=layer.apply_router_weight_on_input,
        w1_bias=layer.w13_bias, w2_bias=layer.w2_bias, is_act_and_mul=layer.is_act_and_mul)
    assert got.dtype == np.dtype(dtype) and got.shape == x.shape
    assert np.array_equal(got, want)            # the same reference stages, bit for bit


def test_forward_against_loop_with_bias_and_swigluoai():
    """The layer's w13 layout (interleaved for swigluoai) against the token loop."""
    layer = FusedMoE.random(seed=5, num_experts=6, top_k=2, hidden_size=24,
                            intermediate_size=20, activation="swigluoai", has_bias=True)
    full = FusedMoE.random(seed=5, num_experts=6, top_k=2, hidden_size=24,
                           intermediate_size=20, has_bias=True)   # same draws, halves layout
    i = 20
    w1, w3 = full.w13_weight[:, :i], full.w13_weight[:, i:]
    w13_interleaved = np.empty_like(full.w13_weight)
    w13_interleaved[:, 0::2], w13_interleaved[:, 1::2] = w1, w3
    assert np.array_equal(layer.w13_weight, w13_interleaved)
    b13 = np.empty_like(full.w13_bias)
    b13[:, 0::2], b13[:, 1::2] = full.w13_bias[:, :i], full.w13_bias[:, i:]
    x, logits = inputs(layer, 19, "swiglu")
    x = x * 3                                               # reach the clamp at 7
    want = loop_layer(layer.w13_weight, layer.w2_weight, x, logits, layer, b13, full.w2_bias)
    assert rel(layer(x, logits), want) <= 1e-5


def _masking_router(gating_output, topk, renormalize, **_):
    """A custom routing function that routes some slots nowhere (id -1), as vLLM's padded
    tokens (VLLM_MOE_SKIP_PADDING) and other ranks' experts are: rows 3 and 7 entirely,
    every fifth slot of the rest. NumPy in, NumPy out; torch in, torch out."""
    host = np.asarray(gating_output.cpu() if hasattr(gating_output, "cpu") else gating_output)
    w, ids, _ = reference.fused_topk(None, host, topk, renormalize)
    ids = ids.copy()
    ids.reshape(-1)[::5] = -1
    ids[[3, 7]] = -1
    if hasattr(gating_output, "cpu"):
        import torch

        return torch.from_numpy(w), torch.from_numpy(ids)
    return w, ids


@pytest.mark.parametrize("backend", ["reference", "torch",
                                     {"align": "torch", "gemm1": "torch", "gemm2": "torch"},
                                     {"combine": "torch"}])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_slots_routed_nowhere_add_nothing(backend, dtype):
    """topk_ids -1 (issue 38): align skips the slot, its GEMM rows stay unwritten and the
    combine leaves it out, so a fully masked token's output is exactly 0 and every other
    token is the sum over its live slots (the loop oracle skipping -1)."""
    layer = FusedMoE.random(seed=21, num_experts=8, top_k=3, hidden_size=32,
                            intermediate_size=48, params_dtype=dtype,
                            custom_routing_function=_masking_router, backend=backend)
    x, logits = inputs(layer, 23, "masked", str(dtype))
    got = np.asarray(layer(x, logits))
    tw, ids = _masking_router(logits, layer.top_k, layer.renormalize)
    assert (ids == -1).any()
    assert not got[[3, 7]].any()                             # routed nowhere: exactly 0
    want = np.zeros((x.shape[0], layer.hidden_size))
    xs = x.astype(np.float64)
    for t in range(x.shape[0]):
        for k in range(layer.top_k):
            e = int(ids[t, k])
            if e < 0:
                continue
            h = layer.w13_weight[e].astype(np.float64) @ xs[t]
            want[t] += float(tw[t, k]) * (layer.w2_weight[e].astype(np.float64)
                                          @ _act_f64(h, "silu", True))
    assert rel(got, want) <= TOL[np.dtype(dtype)]
    assert np.array_equal(got, reference.fused_experts(
        x, layer.w13_weight, layer.w2_weight, tw, ids, block_size=layer.block_size_for(
            "reference", x.shape[0]))) or backend != "reference"


@pytest.mark.parametrize("backend", ["torch", {"route": "torch", "gemm1": "torch"},
                                     {"activation": "torch", "combine": "torch"}])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_backend_mappings_agree(backend, dtype):
    layer = FusedMoE.random(seed=2, params_dtype=dtype, has_bias=True)
    x, logits = inputs(layer, 37, "mapping", str(dtype))
    want = layer.run_stages(x, logits, exact=True)[0]
    got = layer.with_backend(backend)(x, logits)
    assert got.dtype == np.dtype(dtype)
    assert rel(got, want) <= TOL[np.dtype(dtype)]
    moe = FusedMoE.random(seed=2, params_dtype=dtype, has_bias=True, backend=backend)
    assert moe.stage_backends == layer.with_backend(backend).stage_backends
    assert np.array_equal(moe(x, logits), got)


def test_assigning_backend_takes_effect():
    """`layer.backend = {...}` re-resolves the stage mapping (it used to be a plain attribute
    that the forward never read)."""
    layer = FusedMoE.random(seed=2)
    x, logits = inputs(layer, 9, "assign")
    layer.backend = {"route": "torch", "gemm1": "torch"}
    assert layer.backend == {"route": "torch", "gemm1": "torch"}
    assert layer.stage_backends == {"route": "torch", "align": "reference", "gemm1": "torch",
                                    "activation": "reference", "gemm2": "reference",
                                    "combine": "reference"}
    _, trace = layer.run_stages(x, logits)
    assert [c.backend for c in trace] == ["torch", "reference", "torch", "reference",
                                          "reference", "reference"]
    assert "backend={'route': 'torch', 'gemm1': 'torch'}" in repr(layer)
    layer.backend = "torch"
    assert set(layer.stage_backends.values()) == {"torch"}
    assert {c.backend for c in layer.run_stages(x, logits)[1]} == {"torch"}


def test_each_stage_takes_its_arguments_by_their_own_kind():
    """The pipeline keeps no record of which backend made an array: each stage's backend
    takes every argument by the array's kind (Backend.take), so a mixed mapping hands torch
    stages torch tensors and reference stages NumPy arrays, whatever came before."""
    torch = pytest.importorskip("torch")
    from sandbox import pipeline

    layer = FusedMoE.random(seed=2, backend={"gemm1": "torch", "combine": "torch"})
    x, logits = inputs(layer, 7, "kinds")
    _, trace = layer.run_stages(x, logits)
    for call in trace:
        lib = torch.Tensor if call.backend == "torch" else np.ndarray
        assert all(isinstance(a, lib) for a in call.args if hasattr(a, "shape")), call.stage
    run = pipeline.start({**layer.stage_backends, "activation": "torch"}, trace=[])
    cache1 = np.ones((4, 2 * layer.intermediate_size), np.float32)
    out = run.call("activation", cache1, "silu", True)
    assert isinstance(run.trace[0].args[0], torch.Tensor) and isinstance(out, torch.Tensor)
    assert run.call("activation", out, "silu", True, record=False) is not None
    assert len(run.trace) == 1                           # record=False leaves no StageCall


def test_backend_assignment_errors_leave_the_layer_unchanged():
    layer = FusedMoE.random(seed=2, backend="torch")
    with pytest.raises(ValueError, match=r"backend: unknown stage 'gemm'.*'gemm1'"):
        layer.backend = {"gemm": "torch"}
    with pytest.raises(ValueError, match=r"backend: unknown backend 'tpu' for stage 'route'"):
        layer.backend = {"route": "tpu"}
    with pytest.raises(ValueError, match=r"backend: expected one of \['reference'.*got 'jax'"):
        layer.backend = "jax"
    with pytest.raises(TypeError, match="backend: expected a backend name"):
        layer.backend = 3
    assert layer.backend == "torch" and set(layer.stage_backends.values()) == {"torch"}
    # the resolved mapping is read-only: writing into it would bypass the checks
    with pytest.raises(TypeError, match="layer.backend"):
        layer.stage_backends["gemm1"] = "reference"
    # a dict given to the setter is copied: changing it later changes nothing
    spec = {"gemm1": "torch"}
    layer.backend = spec
    spec["gemm2"] = "torch"
    assert layer.stage_backends["gemm2"] == "reference"


def test_backend_change_drops_device_copies_of_unused_backends():
    layer = FusedMoE.random(seed=2, backend={"gemm1": "cupy", "gemm2": "numba"})
    layer._device_params[("cupy", "w13_weight")] = (layer._version, layer.w13_weight, "dev")
    layer._device_params[("numba", "w2_weight")] = (layer._version, layer.w2_weight, "dev")
    layer.backend = {"gemm2": "numba"}
    assert list(layer._device_params) == [("numba", "w2_weight")]
    other = layer.with_backend("cupy")               # the copy starts with no device copies
    assert other._device_params == {} and other.stage_backends["route"] == "cupy"
    assert layer.stage_backends["route"] == "reference"
    assert list(layer._device_params) == [("numba", "w2_weight")]


def test_select_experts_method():
    layer = FusedMoE.random(seed=3, zero_expert_num=2, zero_expert_type="identity")
    x, logits = inputs(layer, 11, "select")
    tw, ids, zr = layer.select_experts(x, logits)
    assert isinstance(tw, np.ndarray) and ids.dtype == np.int32 and zr.shape == x.shape
    assert ids.max() < layer.num_experts


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_empty_batch(backend):
    layer = FusedMoE.random(seed=4, backend=backend, n_shared_experts=1,
                            zero_expert_num=1, zero_expert_type="identity")
    x, logits = inputs(layer, 0, "empty")
    out = layer(x, logits)
    assert out.shape == (0, layer.hidden_size) and out.dtype == layer.params_dtype


def test_input_errors():
    layer = FusedMoE.random(seed=6)
    x, logits = inputs(layer, 5, "err")
    with pytest.raises(ValueError, match="hidden_states"):
        layer(x[:, :-1], logits)
    with pytest.raises(ValueError, match="router_logits"):
        layer(x, logits[:, :-1])
    with pytest.raises(TypeError, match="router_logits"):
        layer(x, logits.astype(np.int32))
    with pytest.raises(ValueError, match="tp_rank"):
        FusedMoE(8, 2, 16, 32, tp_size=2, tp_rank=2)
    with pytest.raises(ValueError, match="intermediate_size"):
        FusedMoE(8, 2, 16, 33, tp_size=2)
    with pytest.raises(ValueError, match="apply_router_weight_on_input"):
        FusedMoE(8, 2, 16, 32, apply_router_weight_on_input=True)
    with pytest.raises(ValueError, match="backend"):
        FusedMoE(8, 2, 16, 32, backend={"gemm": "torch"})
    with pytest.raises(ValueError, match="scoring_func: grouped_topk"):
        FusedMoE(8, 2, 16, 32, scoring_func="sqrtsoftplus", use_grouped_topk=True,
                 num_expert_group=2, topk_group=1)
    # sqrtsoftplus needs a correction bias, which load_weights may still bring: the forward
    # without one is refused, naming scoring_func
    v4 = FusedMoE.random(seed=6, scoring_func="sqrtsoftplus")
    with pytest.raises(ValueError, match="scoring_func: fused_topk"):
        v4(x, logits)
    v4.load_weights([("experts.e_score_correction_bias",
                      np.zeros(v4.num_experts, np.float32))])
    assert np.isfinite(v4(x, logits)).all()


def test_a_batch_that_cannot_fit_fails_before_any_stage(monkeypatch):
    """The layer checks its intermediates ([P, 2I_p], [P, I_p], [P, H]) against the memory of
    the backends that hold them (host: available memory; a GPU backend: its free memory)."""
    from reference import _checks
    from sandbox import pipeline, registry
    from sandbox.registry import STAGES

    monkeypatch.setattr(_checks, "CHECK_ABOVE_BYTES", 0, raising=False)
    monkeypatch.setattr(_checks, "available_host_memory", lambda: 1000, raising=False)
    layer = FusedMoE.random(seed=6)                         # E=8 K=2 H=64 I=96, fp32
    x, logits = inputs(layer, 64, "memory")
    need = 64 * 2 * (2 * 96 + 96 + 64) * 4
    calls = []
    monkeypatch.setattr(registry.Backend, "stage_fn",
                        lambda self, stage: calls.append(stage) or (lambda *a, **k: None))
    monkeypatch.setattr(pipeline, "_CHECKED_MAPPINGS", {})
    for run in (lambda: layer(x, logits), lambda: layer.run_stages(x, logits)):
        with pytest.raises(MemoryError, match=rf"^hidden_states: expected .*host memory.* got "
                                              rf"T=64 tokens, which need at least .*\({need:,} "
                                              rf"bytes\)"):
            run()
    # _start's look-up of each stage, once per mapping; no stage ran
    assert calls == list(STAGES)
    # a device backend: its own free memory, not the host's
    monkeypatch.setattr(_checks, "available_host_memory", lambda: 1 << 40, raising=False)
    monkeypatch.setattr(registry.Backend, "is_host",
                        property(lambda self: self.name == "reference"))
    monkeypatch.setattr(registry.Backend, "free_memory", lambda self: 1000, raising=False)
    layer.backend = {"gemm1": "torch"}
    with pytest.raises(MemoryError, match=r"torch device memory.*T=64 tokens"):
        layer(x, logits)


# ----------------------------------------------------------------------------- NaN params
def test_unloaded_params_make_forward_nan():
    layer = FusedMoE(num_experts=4, top_k=2, hidden_size=16, intermediate_size=24)
    assert np.isnan(layer.w13_weight).all() and np.isnan(layer.w2_weight).all()
    x, logits = inputs(layer, 9, "nan-all")
    assert np.isnan(layer(x, logits)).all()
    assert len(layer.unloaded()) == 2 * 4

    # load every expert but 2: exactly the tokens routed to expert 2 come out NaN
    full = FusedMoE.random(seed=7, num_experts=4, top_k=2, hidden_size=16, intermediate_size=24)
    for e in (0, 1, 3):
        layer.weight_loader(layer.w13_weight, full.w13_weight[e, :24], "w1.weight", "w1", e)
        layer.weight_loader(layer.w13_weight, full.w13_weight[e, 24:], "w3.weight", "w3", e)
        layer.weight_loader(layer.w2_weight, full.w2_weight[e], "w2.weight", "w2", e)
    assert layer.unloaded() == ["w13_weight[expert 2]", "w2_weight[expert 2]"]
    x, logits = inputs(layer, 40, "nan-one")
    _, ids, _ = layer.select_experts(x, logits)
    out = layer(x, logits)
    hits = (ids == 2).any(axis=1)
    assert hits.any() and (~hits).any()
    assert np.isnan(out[hits]).all(axis=1).all()
    assert np.isfinite(out[~hits]).all()
    assert np.array_equal(out[~hits], full(x, logits)[~hits])


# ----------------------------------------------------------------------------- weight loading
def test_weight_loader_single_expert_and_mapping():
    full = FusedMoE.random(seed=8, num_experts=4, top_k=2, hidden_size=16, intermediate_size=24,
                           has_bias=True)
    i = 24
    ckpt = {}
    for e in range(4):
        ckpt[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = full.w13_weight[e, :i]
        ckpt[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = full.w13_weight[e, i:]
        ckpt[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = full.w2_weight[e]
        ckpt[f"model.layers.0.mlp.experts.{e}.gate_proj.bias"] = full.w13_bias[e, :i]
        ckpt[f"model.layers.0.mlp.experts.{e}.up_proj.bias"] = full.w13_bias[e, i:]
        ckpt[f"model.layers.0.mlp.experts.{e}.down_proj.bias"] = full.w2_bias[e]
    ckpt["model.layers.0.mlp.gate.weight"] = np.ones((4, 16), np.float32)   # not an expert
    layer = FusedMoE(4, 2, 16, 24, has_bias=True)
    loaded = layer.load_weights(ckpt.items())
    assert loaded == set(ckpt) - {"model.layers.0.mlp.gate.weight"}
    for name, p in full.named_parameters():
        assert np.array_equal(getattr(layer, name), p), name

    # the Mixtral naming works without being told, and through an explicit mapping
    mix = {f"block_sparse_moe.experts.{e}.{w}.weight": v
           for e in range(4) for w, v in (("w1", full.w13_weight[e, :i]),
                                          ("w3", full.w13_weight[e, i:]),
                                          ("w2", full.w2_weight[e]))}
    layer2 = FusedMoE(4, 2, 16, 24)
    assert layer2.load_weights(mix.items()) == set(mix)
    assert np.array_equal(layer2.w13_weight, full.w13_weight)
    layer3 = FusedMoE(4, 2, 16, 24)
    layer3.expert_mapping = FusedMoE.make_expert_params_mapping("w1", "w2", "w3", 4)
    assert layer3.load_weights(mix.items()) == set(mix)
    assert np.array_equal(layer3.w2_weight, full.w2_weight)


def test_make_expert_params_mapping():
    m = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", 2)
    assert m == [
        ("experts.w13_", "experts.0.gate_proj.", 0, "w1"),
        ("experts.w2_", "experts.0.down_proj.", 0, "w2"),
        ("experts.w13_", "experts.0.up_proj.", 0, "w3"),
        ("experts.w13_", "experts.1.gate_proj.", 1, "w1"),
        ("experts.w2_", "experts.1.down_proj.", 1, "w2"),
        ("experts.w13_", "experts.1.up_proj.", 1, "w3"),
    ]


def test_weight_loader_errors_name_the_weight():
    layer = FusedMoE(4, 2, 16, 24)
    w = np.ones((24, 16), np.float32)
    with pytest.raises(ValueError, match=r"experts\.1\.gate_proj\.weight.*shard_id.*'w4'"):
        layer.weight_loader(layer.w13_weight, w, "experts.1.gate_proj.weight", "w4", 1)
    with pytest.raises(ValueError, match=r"experts\.1\.gate_proj\.weight.*expected shape "
                                         r"\(24, 16\).*got \(16, 24\)"):
        layer.weight_loader(layer.w13_weight, w.T, "experts.1.gate_proj.weight", "w1", 1)
    with pytest.raises(ValueError, match=r"experts\.0\.down_proj\.weight.*\(16, 24\).*\(16, 12\)"):
        layer.weight_loader(layer.w2_weight, np.ones((16, 12), np.float32),
                            "experts.0.down_proj.weight", "w2", 0)
    with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight.*dtype int32"):
        layer.weight_loader(layer.w13_weight, w.astype(np.int32), "experts.0.w1.weight", "w1", 0)
    with pytest.raises(ValueError, match=r"experts\.0\.w2\.weight.*'w2'.*w13_weight"):
        layer.weight_loader(layer.w13_weight, w, "experts.0.w2.weight", "w2", 0)
    with pytest.raises(ValueError, match="expert_id"):
        layer.weight_loader(layer.w13_weight, w, "experts.9.w1.weight", "w1", 9)
    with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight.*\(4, 24, 16\).*\(3, 24, 16\)"):
        layer.weight_loader(layer.w13_weight, np.ones((3, 24, 16), np.float32),
                            "experts.0.w1.weight", "w1", 0)
    assert np.isnan(layer.w13_weight).all()                 # nothing half-written


def test_weight_loader_casts_to_params_dtype():
    layer = FusedMoE(2, 1, 8, 8, params_dtype=ml_dtypes.bfloat16)
    w = rng_for("cast").standard_normal((8, 8))              # float64 in
    assert layer.weight_loader(layer.w13_weight, w, "experts.0.w1.weight", "w1", 0)
    assert layer.w13_weight.dtype == BF16
    assert np.array_equal(layer.w13_weight[0, :8], w.astype(BF16))


@pytest.mark.parametrize("with_extras", [False, True])
def test_tensor_parallel_shards_join_and_outputs_sum(with_extras):
    kw = dict(num_experts=6, top_k=2, hidden_size=24, intermediate_size=32, has_bias=True)
    if with_extras:
        kw.update(n_shared_experts=1, zero_expert_num=2, zero_expert_type="identity")
    full = FusedMoE.random(seed=9, **kw)
    ranks = [FusedMoE.random(seed=9, tp_size=2, tp_rank=r, **kw) for r in range(2)]
    i, ip = 32, 16
    assert ranks[0].w13_weight.shape == (6, 2 * ip, 24) and ranks[0].w2_weight.shape == (6, 24, ip)
    gate = np.concatenate([r.w13_weight[:, :ip] for r in ranks], axis=1)
    up = np.concatenate([r.w13_weight[:, ip:] for r in ranks], axis=1)
    assert np.array_equal(gate, full.w13_weight[:, :i])
    assert np.array_equal(up, full.w13_weight[:, i:])
    assert np.array_equal(np.concatenate([r.w2_weight for r in ranks], axis=2), full.w2_weight)
    assert np.array_equal(np.concatenate([r.w13_bias[:, :ip] for r in ranks], 1),
                          full.w13_bias[:, :i])
    for r in ranks:                                          # the down bias is not narrowed
        assert np.array_equal(r.w2_bias, full.w2_bias)
    if with_extras:
        ips = ranks[0].shared_w2.shape[1]
        assert np.array_equal(np.concatenate([r.shared_w2 for r in ranks], 1), full.shared_w2)
        assert np.array_equal(np.concatenate([r.shared_w13[:ips] for r in ranks], 0),
                              full.shared_w13[:2 * ips])
    x, logits = inputs(full, 23, "tp", with_extras)
    total = sum(r(x, logits).astype(np.float64) for r in ranks)
    assert rel(total, full.run_stages(x, logits, exact=True)[0]) <= 1e-5


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("ep_size", [2, 3])
def test_expert_parallel_ranks_hold_their_experts_and_sum(placement, ep_size):
    kw = dict(num_experts=8, top_k=3, hidden_size=16, intermediate_size=24, has_bias=True,
              n_shared_experts=1, zero_expert_num=1, zero_expert_type="identity")
    full = FusedMoE.random(seed=10, **kw)
    ranks = [FusedMoE.random(seed=10, ep_size=ep_size, ep_rank=r, expert_placement=placement,
                             **kw) for r in range(ep_size)]
    held = []
    for r, layer in enumerate(ranks):
        _, expert_map = reference.determine_expert_map(ep_size, r, 8, placement)
        mine = np.flatnonzero(expert_map >= 0)
        assert layer.local_num_experts == mine.size == layer.w13_weight.shape[0]
        for g in mine:
            local = expert_map[g]
            assert np.array_equal(layer.w13_weight[local], full.w13_weight[g])
            assert np.array_equal(layer.w2_weight[local], full.w2_weight[g])
            assert np.array_equal(layer.w2_bias[local], full.w2_bias[g])
        held += mine.tolist()
        # a non-local expert is skipped, not an error
        other = next(g for g in range(8) if g not in mine)
        assert layer.weight_loader(layer.w2_weight, full.w2_weight[other], "experts.w2.weight",
                                   "w2", other) is False
    assert sorted(held) == list(range(8))                    # every expert on exactly one rank
    x, logits = inputs(full, 31, "ep", placement, ep_size)
    total = sum(r(x, logits).astype(np.float64) for r in ranks)
    assert rel(total, full.run_stages(x, logits, exact=True)[0]) <= 1e-5


def test_shared_and_zero_experts_against_loop():
    layer = FusedMoE.random(seed=11, num_experts=6, top_k=3, hidden_size=16,
                            intermediate_size=12, n_shared_experts=2,
                            zero_expert_num=2, zero_expert_type="identity")
    assert layer.shared_w13.shape == (2 * 24, 16) and layer.shared_w2.shape == (16, 24)
    x, logits = inputs(layer, 25, "shared-zero")
    logits[:6, 6:] += 3.0                                    # these tokens pick zero experts
    want = loop_layer(layer.w13_weight, layer.w2_weight, x, logits, layer,
                      sh13=layer.shared_w13, sh2=layer.shared_w2)
    assert rel(layer(x, logits), want) <= 1e-5
    assert rel(layer.with_backend("torch")(x, logits), want) <= 1e-5
    # the zero experts did contribute to the first tokens
    _, _, zr = layer.select_experts(x, logits)
    assert np.abs(zr[:6]).sum() > 0


def test_shared_experts_load_weights():
    src = FusedMoE.random(seed=12, num_experts=4, top_k=2, hidden_size=16, intermediate_size=8,
                          n_shared_experts=1, shared_intermediate_size=20)
    names = {"mlp.shared_experts.gate_proj.weight": src.shared_w13[:20],
             "mlp.shared_experts.up_proj.weight": src.shared_w13[20:],
             "mlp.shared_experts.down_proj.weight": src.shared_w2,
             "mlp.gate.e_score_correction_bias": np.arange(4, dtype=np.float32)}
    dst = FusedMoE(4, 2, 16, 8, n_shared_experts=1, shared_intermediate_size=20)
    assert dst.load_weights(names.items()) == set(names)
    assert np.array_equal(dst.shared_w13, src.shared_w13)
    assert np.array_equal(dst.shared_w2, src.shared_w2)
    assert np.array_equal(dst.e_score_correction_bias, np.arange(4, dtype=np.float32))


def test_to_dtype_and_repr():
    layer = FusedMoE.random(seed=13, ep_size=2, ep_rank=1, has_bias=True)
    low = layer.to_dtype("bfloat16")
    assert low.w13_weight.dtype == BF16 and layer.w13_weight.dtype == np.float32
    assert "ep=1/2" in repr(layer) and "bias" in repr(layer)


def test_block_size_from_gemm_backend_config(monkeypatch):
    from sandbox import registry

    layer = FusedMoE.random(seed=14, backend="torch")
    tb = registry.get_backend("torch")
    monkeypatch.setattr(type(tb), "gemm_config",
                        lambda self, M, N, K, E, top_k, dtype: {"BLOCK_M": 16})
    x, logits = inputs(layer, 10, "block")
    _, trace = layer.run_stages(x, logits)
    assert trace[1].args[1] == 16                            # align got the GEMM's BLOCK_M
    assert trace[2].args[6] == 16 and trace[4].args[6] == 16
    fixed = FusedMoE.random(seed=14, backend="torch", block_size=8)
    assert fixed.run_stages(x, logits)[1][1].args[1] == 8


@pytest.mark.skipif(not __import__("pathlib").Path("data/mixtral/config.json").exists(),
                    reason="data/ checkpoints not present")
def test_from_safetensors_delegates():
    layer = FusedMoE.from_safetensors("data/mixtral", 0)
    assert isinstance(layer, FusedMoE) and not layer.unloaded()


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_gpu_backends_and_mixed_mappings(dtype):
    """Every available GPU backend end to end, and stage mixes that move arrays between
    libraries on the device."""
    from sandbox.registry import available_backends

    avail = [n for n, (ok, _) in available_backends().items() if ok and n != "reference"]
    layer = FusedMoE.random(seed=15, num_experts=16, top_k=4, hidden_size=256,
                            intermediate_size=512, params_dtype=dtype, has_bias=True,
                            n_shared_experts=1)
    x, logits = inputs(layer, 300, "gpu", str(dtype))
    want = layer.run_stages(x, logits, exact=True)[0]
    mixes = [b for b in avail] + [
        {"route": a, "align": b, "gemm1": a, "activation": b, "gemm2": a, "combine": b}
        for a in avail for b in avail if a != b]
    for spec in mixes:
        try:
            got = layer.with_backend(spec)(x, logits)
        except NotImplementedError:
            continue                                          # a stage not written yet
        assert rel(got, want) <= TOL[np.dtype(dtype)], spec
