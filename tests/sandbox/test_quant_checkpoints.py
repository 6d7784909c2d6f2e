"""Quantized checkpoints (sandbox/checkpoint_quant.py): the four small files of data/ load,
match their float source exactly where the format is exact, validate through the CLI, and a
checkpoint whose tensors do not match its config fails naming the tensor."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

from sandbox import FusedMoE, MoEWeights, checkpoint, datagen
from sandbox import checkpoint_quant as CQ
from sandbox.checkpoint import CheckpointError
from sandbox.cli import main

NAMES = list(datagen.QUANT_CHECKPOINTS)


@pytest.mark.parametrize("name", NAMES)
def test_loads_and_matches_its_float_source(name):
    layer = FusedMoE.from_safetensors(checkpoint.data_dir() / name, datagen.MOE_LAYER)
    family, fmt, _, sizes = datagen.QUANT_CHECKPOINTS[name]
    assert layer.unloaded() == [] and layer.quant_config is not None
    spec = datagen.dataclasses.replace(datagen.FAMILIES[family], **sizes)
    floats = datagen.make_tensors(spec)
    gate = "w1" if family == "mixtral" else "gate_proj"
    prefix = [n for n in floats if n.endswith(f"experts.3.{gate}.weight")
              and n.startswith(f"model.layers.{datagen.MOE_LAYER}.")][0]
    want = CQ.to_format(fmt, layer.quant_config, floats[prefix].astype(np.float32))
    got = CQ.from_format(fmt, layer.quant_config, want, prefix, *floats[prefix].shape)
    i = layer.intermediate_size
    np.testing.assert_array_equal(layer.w13_weight[3, :i].view(np.uint8), got[0].view(np.uint8))
    scale_rows = slice(0, i // 128) if fmt == "fp8" else slice(0, i)
    np.testing.assert_array_equal(layer.w13_weight_scale[3, scale_rows], got[1])


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq", "awq"])
def test_int4_packing_round_trips_exactly(fmt, rng):
    from sandbox import quant as Q

    cfg = Q.int4_w4a16_moe_quant_config(32, has_zp=fmt == "awq")
    w = rng.standard_normal((48, 64)).astype(np.float32)
    q, s, z = Q.quantize_experts(cfg, w[None])
    got = CQ.from_format(fmt, cfg, CQ.to_format(fmt, cfg, w), "p", 48, 64)
    np.testing.assert_array_equal(got[0], q[0])                    # codes: exact
    np.testing.assert_array_equal(got[1], s[0].astype(np.float16).astype(np.float32))
    if z is not None:
        np.testing.assert_array_equal(got[2], z[0])


def test_weights_alone_load_too():
    w = MoEWeights.from_safetensors(checkpoint.data_dir() / "deepseek_v3_fp8")
    assert w.quant_config.is_block_quantized and w.shared_w13.dtype == np.float32


@pytest.mark.parametrize("name", NAMES)
def test_cli_validate_checkpoint(name, capsys):
    rc = main(["validate", "--checkpoint", str(checkpoint.data_dir() / name), "--backend",
               "reference", "torch", "--tokens", "32", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "dequantized" in out and "no quantized stages" in out


def _broken_copy(tmp_path, name, edit):
    src = checkpoint.data_dir() / name
    dst = tmp_path / name
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    tensors = {n: CQ.read_raw(path, n) for n in json.loads(
        path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")]) if n != "__metadata__"}
    edit(tensors, dst)
    save_file(tensors, str(path))
    return dst


def test_wrong_block_scale_shape_names_the_tensor(tmp_path):
    bad = "model.layers.1.mlp.experts.5.down_proj.weight_scale_inv"

    def edit(t, _):
        t[bad] = np.ones((2, 2), np.float32)
    path = _broken_copy(tmp_path, "deepseek_v3_fp8", edit)
    with pytest.raises(CheckpointError, match=bad.replace(".", r"\.")):
        FusedMoE.from_safetensors(path, datagen.MOE_LAYER)


def test_act_order_g_idx_is_refused_by_name(tmp_path):
    bad = "model.layers.1.mlp.experts.2.up_proj.g_idx"

    def edit(t, _):
        t[bad] = t[bad][::-1].copy()
    path = _broken_copy(tmp_path, "qwen3_moe_gptq", edit)
    with pytest.raises(CheckpointError, match="g_idx: act order"):
        FusedMoE.from_safetensors(path, datagen.MOE_LAYER)


def test_config_that_does_not_match(tmp_path):
    def edit(t, dst):
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"]["group_size"] = 16        # scales are for groups of 32
        (dst / "config.json").write_text(json.dumps(cfg))
    path = _broken_copy(tmp_path, "mixtral_awq", edit)
    with pytest.raises(CheckpointError, match=r"scales: expected"):
        FusedMoE.from_safetensors(path, datagen.MOE_LAYER)


def test_missing_quantized_tensor(tmp_path):
    bad = "model.layers.1.block_sparse_moe.experts.0.w2.qzeros"

    def edit(t, _):
        del t[bad]
    path = _broken_copy(tmp_path, "mixtral_awq", edit)
    with pytest.raises(CheckpointError, match=bad.replace(".", r"\.")):
        FusedMoE.from_safetensors(path, datagen.MOE_LAYER)
