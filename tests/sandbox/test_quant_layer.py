"""The quantized layer: FusedMoE(quant_config=...) (sandbox/quant.py, weights.py, pipeline.py).

CPU: every scheme through the reference path against reference.fused_experts_quant on the
layer's own codes (exact: the same function); the quantized parameters and their shapes;
the named errors; validate's quantized rows. GPU (`gpu`): the CuPy quantized layer against
the reference on each format, within vLLM's tolerances (sandbox.quant.tolerance).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import reference
from sandbox import FusedMoE, validate
from sandbox import quant as Q

BF16 = np.dtype(ml_dtypes.bfloat16)
SIZES = dict(num_experts=8, top_k=2, hidden_size=256, intermediate_size=256)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def layer_for(scheme, dtype=BF16, **kw):
    return FusedMoE.random(seed=0, quant_config=scheme, params_dtype=dtype, **{**SIZES, **kw})


def fused_experts_quant_of(layer, x, logits):
    """The dumb path: route with the reference, then reference.fused_experts_quant on the
    layer's codes and scales."""
    tw, ids, _ = layer.select_experts(x, logits)
    qc = layer.quant_config
    flags = qc.kernel_flags()
    a1 = a2 = None
    if qc.static_input_scale:
        a1 = np.array([layer.w13_input_scale.max()], np.float32)
        a2 = np.array([layer.w2_input_scale.max()], np.float32)
    return reference.fused_experts_quant(
        x.astype(layer.params_dtype), layer.w13_weight, layer.w2_weight, tw, ids,
        w1_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale,
        w1_zp=layer.w13_weight_zero_point, w2_zp=layer.w2_weight_zero_point,
        a1_scale=a1, a2_scale=a2, block_size=64, **flags)


@pytest.mark.parametrize("scheme", list(Q.SCHEMES))
def test_layer_is_fused_experts_quant(scheme):
    layer = layer_for(scheme)
    layer.block_size = 64
    x, logits = layer.random_inputs(13)
    got = layer(x, logits)
    want = fused_experts_quant_of(layer, x, logits)
    assert got.dtype == BF16
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


@pytest.mark.parametrize("scheme", list(Q.SCHEMES))
def test_quantized_close_to_its_dequantized_experts(scheme):
    layer = layer_for(scheme)
    x, logits = layer.random_inputs(16)
    exact, _ = layer.run_stages(x, logits, exact=True)
    assert rel(layer(x, logits), exact) < 2 * Q.tolerance(layer.quant_config)


@pytest.mark.parametrize("scheme,codes,scale", [
    ("fp8_tensor", (Q.FP8, (8, 512, 256)), (8,)),
    ("fp8_token", (Q.FP8, (8, 512, 256)), (8, 512)),
    ("fp8_block", (Q.FP8, (8, 512, 256)), (8, 4, 2)),
    ("int8_channel", (np.int8, (8, 512, 256)), (8, 512)),
    ("w4a16", (np.uint8, (8, 512, 128)), (8, 512, 2)),
    ("w8a16", (np.uint8, (8, 512, 256)), (8, 512, 2)),
])
def test_parameters_held_quantized(scheme, codes, scale):
    layer = layer_for(scheme)
    assert layer.w13_weight.dtype == np.dtype(codes[0]) and layer.w13_weight.shape == codes[1]
    assert layer.w13_weight_scale.shape == scale and layer.w13_weight_scale.dtype == np.float32
    assert layer.unloaded() == []
    names = dict(layer.named_parameters())
    assert "w13_weight_scale" in names and "w2_weight_scale" in names


def test_an_expert_never_loaded_is_nan_and_listed():
    layer = FusedMoE(quant_config="fp8_block", params_dtype=BF16, top_k=2, **{
        k: v for k, v in SIZES.items() if k != "top_k"})
    assert "w13_weight_scale[expert 0]" in layer.unloaded()
    x, logits = layer.random_inputs(2)
    assert np.isnan(layer(x, logits).astype(np.float32)).all()


def test_weight_loader_fills_gate_up_and_blocks():
    """Loading expert by expert (a checkpoint's way) gives the layer quantized whole."""
    src = layer_for("fp8_block")
    dst = FusedMoE(quant_config="fp8_block", params_dtype=BF16, **SIZES)
    i = SIZES["intermediate_size"]
    for e in range(SIZES["num_experts"]):
        for shard, rows, brows in (("w1", slice(0, i), slice(0, i // 128)),
                                   ("w3", slice(i, 2 * i), slice(i // 128, 2 * i // 128))):
            dst.weight_loader(dst.w13_weight, src.w13_weight[e, rows], "w", shard, e)
            dst.weight_loader(dst.w13_weight_scale, src.w13_weight_scale[e, brows], "s",
                              shard, e)
        dst.weight_loader(dst.w2_weight, src.w2_weight[e], "w", "w2", e)
        dst.weight_loader(dst.w2_weight_scale, src.w2_weight_scale[e], "s", "w2", e)
    assert dst.unloaded() == []
    np.testing.assert_array_equal(dst.w13_weight.view(np.uint8), src.w13_weight.view(np.uint8))
    np.testing.assert_array_equal(dst.w13_weight_scale, src.w13_weight_scale)


def test_expert_parallel_ranks_hold_their_experts():
    whole = layer_for("w4a16")
    rank = FusedMoE.random(seed=0, quant_config="w4a16", params_dtype=BF16, ep_size=2,
                           ep_rank=1, **SIZES)
    np.testing.assert_array_equal(rank.w13_weight, whole.w13_weight[rank.local_to_global])


# ----------------------------------------------------------------------------- named errors
def test_scale_of_the_wrong_shape_names_the_tensor():
    layer = FusedMoE(quant_config="fp8_block", params_dtype=BF16, **SIZES)
    with pytest.raises(Q.QuantShapeError, match=r"experts\.0\.gate_proj\.weight_scale_inv"):
        layer.weight_loader(layer.w13_weight_scale, np.ones((3, 2), np.float32),
                            "experts.0.gate_proj.weight_scale_inv", "w1", 0)


@pytest.mark.parametrize("cfg,dims,match", [
    (Q.fp8_w8a8_moe_quant_config(block_shape=(128, 128)), dict(hidden_size=192),
     "= 128 to divide hidden_size = 192"),
    (Q.fp8_w8a8_moe_quant_config(block_shape=(128, 128)), dict(intermediate_size=64),
     "bn = 128 to divide intermediate_size = 64"),
    (Q.int4_w4a16_moe_quant_config(group_size=96), {}, "group_size: expected a divisor"),
])
def test_block_or_group_that_does_not_divide(cfg, dims, match):
    with pytest.raises(Q.QuantBlockError, match=match):
        FusedMoE(quant_config=cfg, **{**SIZES, **dims})


def test_w13_and_w2_in_different_formats():
    layer = FusedMoE(quant_config="fp8_block", params_dtype=BF16, **SIZES)
    with pytest.raises(Q.QuantFormatMismatch, match="experts.0.down_proj.weight"):
        layer.weight_loader(layer.w2_weight, np.zeros((256, 256), np.int8),
                            "experts.0.down_proj.weight", "w2", 0)
    with pytest.raises(Q.QuantFormatMismatch, match="quant_dtype"):
        Q.FusedMoEQuantConfig("int8", "fp8")


def test_static_scheme_without_its_activation_scale():
    layer = layer_for("fp8_static")
    layer.w13_input_scale[...] = np.nan
    layer.invalidate_device_cache()
    assert "w13_input_scale" in " ".join(layer.unloaded())
    x, logits = layer.random_inputs(4)
    with pytest.raises(Q.MissingActivationScale, match="w13_input_scale"):
        layer(x, logits)


def test_other_refusals_are_named():
    with pytest.raises(Q.QuantConfigError, match="tensor parallelism"):
        FusedMoE(quant_config="w4a16", tp_size=2, **SIZES)
    with pytest.raises(Q.QuantConfigError, match="quant_config: expected"):
        FusedMoE(quant_config="fp4", **SIZES)
    with pytest.raises(Q.QuantConfigError, match="block_shape"):
        Q.fp8_w8a8_moe_quant_config(per_act_token_quant=True, block_shape=(128, 128))


# ----------------------------------------------------------------------------- validate
@pytest.mark.parametrize("scheme", ["fp8_block", "w4a16_zp"])
def test_validate_rows_of_a_quantized_layer(scheme):
    layer = layer_for(scheme)
    x, logits = layer.random_inputs(8)
    report = validate(layer, x, logits, backends=["reference", "torch"], quiet=True)
    assert report.ok, report.table()
    rows = {(r["backend"], r["stage"]): r for r in report.rows}
    tol = Q.tolerance(layer.quant_config)
    assert rows[("reference", "gemm1")]["tol"] == tol
    assert rows[("reference", "end_to_end")]["tol"] == tol
    assert rows[("reference", "dequantized")]["status"] == "ok"
    if layer.quant_config.quant_dtype is not None:
        assert rows[("reference", "quantize1")]["detail"].startswith("exact")
    else:
        assert ("reference", "quantize1") not in rows
    assert rows[("torch", "gemm1")]["status"] == "skipped"
    assert "no quantized stages" in rows[("torch", "gemm1")]["detail"]


def test_validate_catches_a_wrong_quantized_gemm(monkeypatch):
    """A GEMM that forgets the weight scale's last block must fail its row."""
    import sandbox.validate_quant as VQ

    layer = layer_for("fp8_block")
    x, logits = layer.random_inputs(8)
    real = reference.grouped_gemm_quant

    def broken(*args, **kwargs):
        kwargs = dict(kwargs, w_scale=kwargs["w_scale"] * np.float32(1.2))
        return real(*args, **kwargs)
    def run_call(b, call, fp8):
        if call.fn == "moe_kernel_quantize_input":
            return call.outputs
        return broken(*call.args, **call.kwargs)
    monkeypatch.setattr(VQ, "run_call", run_call)
    report = validate(layer, x, logits, backends=["reference"], quiet=True,
                      end_to_end=False)
    assert report.first_divergence["reference"] == "gemm1"


# ----------------------------------------------------------------------------- GPU
GPU_SCHEMES = ["fp8_tensor", "fp8_static", "fp8_token", "fp8_block", "int8_channel", "w4a16",
               "w4a16_zp", "w8a16"]


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 37, 256])
@pytest.mark.parametrize("scheme", GPU_SCHEMES)
def test_cupy_quantized_layer_matches_reference(scheme, T):
    layer = layer_for(scheme)
    x, logits = layer.random_inputs(T)
    want = layer(x, logits)
    got = layer.with_backend("cupy")(x, logits)
    assert got.dtype == BF16
    assert rel(got, want) < Q.tolerance(layer.quant_config)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", GPU_SCHEMES)
def test_cupy_validate_rows(scheme):
    layer = layer_for(scheme)
    x, logits = layer.random_inputs(32)
    report = validate(layer, x, logits, backends=["reference", "cupy"], quiet=True)
    assert report.ok, report.table()
    assert report.first_divergence["cupy"] is None


@pytest.mark.parametrize("scheme,tokens,block", [("w4a16", 4096, 64), ("w4a16", 64, 48),
                                                  ("w4a16", 1, 16), ("fp8_block", 4096, 64),
                                                  ("fp8_block", 1, 16)])
def test_quantized_layer_aligns_to_its_formats_block(scheme, tokens, block):
    """A quantized layer aligns to its format's block (cuda_kernels/cupy/quant/configs.py
    block_size_for, by rows per expert), not to the bf16 tiles' BLOCK_M: the int4 route
    cannot take a 128-row block (a config error on the GPU at Qwen3's T = 1024)."""
    from sandbox import pipeline

    layer = FusedMoE(quant_config=scheme, params_dtype=BF16, **SIZES)
    mapping = {s: "reference" for s in pipeline.STAGES}
    rows = tokens * layer.top_k / layer.local_num_experts
    assert pipeline.block_size_for(layer, mapping, tokens) == block, rows
