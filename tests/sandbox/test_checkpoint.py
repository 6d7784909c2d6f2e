"""The checkpoint loader: every family of data/ gives the reference's answer on the raw
tensors; sharded checkpoints; tensor and expert parallel loading; broken checkpoints raise
CheckpointError naming the tensor and leave no layer behind."""
from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import reference
from sandbox import FusedMoE, datagen
from sandbox.checkpoint import (CheckpointError, CheckpointFiles, data_dir,
                                default_checkpoint_path, router_logits)

DATA = data_dir()
FAMILIES = list(datagen.FAMILIES)
LAYER = datagen.MOE_LAYER


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def raw(family: str) -> dict[str, np.ndarray]:
    """Every tensor of data/<family> as fp32 (bf16 -> fp32 is exact), read directly."""
    with safe_open(str(DATA / family / "model.safetensors"), framework="numpy") as f:
        return {k: f.get_tensor(k).astype(np.float32) for k in f.keys()}


def silu(v):
    return v / (1.0 + np.exp(-v))


def reference_output(family, x, logits, layer_idx=LAYER):
    """reference.fused_moe fed the raw checkpoint tensors (plus DeepSeek's shared expert)."""
    t = raw(family)
    spec = datagen.FAMILIES[family]
    E, K = spec.num_experts, spec.top_k
    p = f"model.layers.{layer_idx}."
    if family == "gpt_oss":
        w1 = t[p + "mlp.experts.gate_up_proj"].transpose(0, 2, 1).copy()  # [E, 2I, H] interleaved
        w2 = t[p + "mlp.experts.down_proj"].transpose(0, 2, 1).copy()        # [E, H, I]
        return reference.fused_moe(x, w1, w2, logits, K, True, activation="swigluoai",
                                   w1_bias=t[p + "mlp.experts.gate_up_proj_bias"],
                                   w2_bias=t[p + "mlp.experts.down_proj_bias"])
    if family == "mixtral":
        q, (g, u, d) = p + "block_sparse_moe.experts.", ("w1", "w3", "w2")
    else:
        q, (g, u, d) = p + "mlp.experts.", ("gate_proj", "up_proj", "down_proj")
    w1 = np.stack([np.concatenate([t[f"{q}{e}.{g}.weight"], t[f"{q}{e}.{u}.weight"]])
                   for e in range(E)])                                        # [E, 2I, H]
    w2 = np.stack([t[f"{q}{e}.{d}.weight"] for e in range(E)])               # [E, H, I]
    if family != "deepseek_v3":
        return reference.fused_moe(x, w1, w2, logits, K, True)
    out = reference.fused_moe(x, w1, w2, logits, K, True, use_grouped_topk=True,
                              num_expert_group=spec.n_group, topk_group=spec.topk_group,
                              scoring_func="sigmoid",
                              routed_scaling_factor=spec.routed_scaling_factor,
                              e_score_correction_bias=t[p + "mlp.gate.e_score_correction_bias"])
    s = p + "mlp.shared_experts."
    xf = x.astype(np.float32)
    shared = (silu(xf @ t[s + "gate_proj.weight"].T) * (xf @ t[s + "up_proj.weight"].T)) \
        @ t[s + "down_proj.weight"].T
    return out + shared


def trace(family, dist="zipf", n=48):
    x, logits = datagen.load_trace(DATA / "traces" / f"{family}_{dist}.npz")
    return x[:n], logits[:n]


# ----------------------------------------------------------------------------- the families

@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_reference_on_raw_tensors(family):
    layer = FusedMoE.from_safetensors(DATA / family, LAYER)
    assert layer.checkpoint_info["family"] == family
    x, logits = trace(family)
    got = layer.forward(x, logits)
    want = reference_output(family, x, logits)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_bf16_params(family):
    layer = FusedMoE.from_safetensors(DATA / family, LAYER, params_dtype=ml_dtypes.bfloat16)
    assert layer.w13_weight.dtype == ml_dtypes.bfloat16
    x, logits = trace(family, n=16)
    got = layer.forward(x.astype(ml_dtypes.bfloat16), logits)
    assert got.dtype == ml_dtypes.bfloat16
    assert rel_err(got, reference_output(family, x, logits)) <= 1e-2


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_router_logits(family):
    layer = FusedMoE.from_safetensors(DATA / family, LAYER)
    t = raw(family)
    p = f"model.layers.{LAYER}."
    w = t[p + ("block_sparse_moe.gate.weight" if family == "mixtral" else "mlp.router.weight")]
    x, _ = trace(family, n=8)
    want = x @ w.T + (t[p + "mlp.router.bias"] if family == "gpt_oss" else 0)
    got = router_logits(layer, x)
    assert got.shape == (8, w.shape[0]) and got.dtype == np.float32
    assert rel_err(got, want) <= 1e-6
    assert layer.router_weight.shape == w.shape
    assert (layer.router_bias is not None) == (family == "gpt_oss")


def test_from_safetensors_and_default_layer():
    assert default_checkpoint_path().is_dir()
    a = FusedMoE.from_safetensors(DATA / "deepseek_v3", None)
    assert a.checkpoint_info["layer_idx"] == 1            # layer 0 is dense
    b = FusedMoE.from_safetensors(DATA / "qwen3_moe")
    assert b.checkpoint_info["layer_idx"] == 0
    c = FusedMoE.from_safetensors(DATA / "qwen3_moe" / "model.safetensors", 1)   # a file
    assert c.checkpoint_info["config"] is not None                               # config beside
    assert c.num_experts == 16 and c.top_k == 4 and c.renormalize


def test_config_drives_routing():
    layer = FusedMoE.from_safetensors(DATA / "deepseek_v3", LAYER)
    assert layer.use_grouped_topk and layer.scoring_func == "sigmoid"
    assert (layer.num_expert_group, layer.topk_group) == (4, 2)
    assert layer.routed_scaling_factor == 2.5
    assert layer.e_score_correction_bias.shape == (16,)
    assert layer.n_shared_experts == 1 and layer.shared_w13.shape == (128, 96)
    gpt = FusedMoE.from_safetensors(DATA / "gpt_oss", LAYER)
    assert gpt.activation == "swigluoai" and gpt.has_bias


def test_overrides_win():
    layer = FusedMoE.from_safetensors(DATA / "qwen3_moe", LAYER, top_k=2, renormalize=False)
    assert layer.top_k == 2 and not layer.renormalize


def test_gpt_oss_keeps_gate_up_interleaved():
    layer = FusedMoE.from_safetensors(DATA / "gpt_oss", LAYER)
    gu = raw("gpt_oss")[f"model.layers.{LAYER}.mlp.experts.gate_up_proj"]   # [E, H, 2I]
    assert np.array_equal(layer.w13_weight, gu.transpose(0, 2, 1))


# ----------------------------------------------------------------------------- layouts

def test_sharded_index_loads_the_same(tmp_path):
    sharded = datagen.shard_checkpoint(DATA / "deepseek_v3", tmp_path / "sharded", 3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    one = FusedMoE.from_safetensors(DATA / "deepseek_v3", LAYER)
    for path in (sharded, sharded / "model.safetensors.index.json"):
        two = FusedMoE.from_safetensors(path, LAYER)
        for name, arr in one.named_parameters():
            assert np.array_equal(arr, getattr(two, name)), name
        assert np.array_equal(one.router_weight, two.router_weight)


def test_folder_of_shards_without_index(tmp_path):
    sharded = datagen.shard_checkpoint(DATA / "mixtral", tmp_path / "s", 2)
    (sharded / "model.safetensors.index.json").unlink()
    layer = FusedMoE.from_safetensors(sharded, LAYER)
    whole = FusedMoE.from_safetensors(DATA / "mixtral", LAYER)
    assert np.array_equal(layer.w2_weight, whole.w2_weight)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_tp2_shards_join_to_the_full_weights_and_outputs_sum(family):
    full = FusedMoE.from_safetensors(DATA / family, LAYER)
    ranks = [FusedMoE.from_safetensors(DATA / family, LAYER, tp_size=2, tp_rank=r)
             for r in range(2)]
    I_p = full.intermediate_size // 2  # noqa: E741
    if family == "gpt_oss":   # interleaved rows: each rank holds a contiguous run of pairs
        joined = np.concatenate([r.w13_weight for r in ranks], axis=1)
    else:                     # [gate; up] halves: rank r holds rows r of each half
        joined = np.concatenate([np.concatenate([r.w13_weight[:, :I_p] for r in ranks], 1),
                                 np.concatenate([r.w13_weight[:, I_p:] for r in ranks], 1)], 1)
    assert np.array_equal(joined, full.w13_weight)
    assert np.array_equal(np.concatenate([r.w2_weight for r in ranks], axis=2), full.w2_weight)
    x, logits = trace(family, n=16)
    total = sum(r.forward(x, logits).astype(np.float64) for r in ranks)
    assert rel_err(total, full.forward(x, logits)) <= 1e-5


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_ep2_each_rank_holds_exactly_its_experts(family, monkeypatch):
    full = FusedMoE.from_safetensors(DATA / family, LAYER)
    read = []
    orig = CheckpointFiles.read

    def spy(self, name, index=None):
        read.append((name, index))
        return orig(self, name, index)
    monkeypatch.setattr(CheckpointFiles, "read", spy)
    for rank in range(2):
        read.clear()
        layer = FusedMoE.from_safetensors(DATA / family, LAYER, ep_size=2, ep_rank=rank)
        mine = layer.local_to_global
        assert len(mine) == layer.local_num_experts == full.num_experts // 2
        assert np.array_equal(layer.w13_weight, full.w13_weight[mine])
        assert np.array_equal(layer.w2_weight, full.w2_weight[mine])
        # lazy: the other rank's experts are never read
        if family == "mixtral":
            experts = {int(n.split(".experts.")[1].split(".")[0]) for n, _ in read
                       if ".experts." in n}
        else:
            experts = {i for n, i in read if i is not None}
        assert experts == set(mine.tolist())


# ----------------------------------------------------------------------------- broken

def rewrite(tmp_path, family="qwen3_moe", edit=None, config_edit=None, config=True):
    """A copy of data/<family> with its tensors (and config) edited."""
    out = tmp_path / f"broken_{family}"
    out.mkdir()
    with safe_open(str(DATA / family / "model.safetensors"), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if edit:
        edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    if config:
        cfg = json.loads((DATA / family / "config.json").read_text())
        if config_edit:
            config_edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


Q = f"model.layers.{LAYER}.mlp.experts."


def _replaced(name, how):
    def edit(tensors):
        tensors[Q + name] = how(tensors[Q + name])
    return edit


def _extra_expert(tensors):
    for part in ("gate_proj", "up_proj", "down_proj"):
        tensors[f"{Q}16.{part}.weight"] = tensors[f"{Q}0.{part}.weight"].copy()


# name: (how the checkpoint is broken: rewrite's edit / config_edit, what the error says)
BROKEN = {
    "missing_tensor": (dict(edit=lambda t: t.pop(Q + "3.up_proj.weight")),
                       r"3\.up_proj\.weight.*no such tensor"),
    "wrong_shape": (dict(edit=_replaced("2.down_proj.weight", lambda w: w[:, :-1].copy())),
                    r"2\.down_proj\.weight.*expected shape \[64, 64\], found \[64, 63\]"),
    "wrong_dtype": (dict(edit=_replaced("5.gate_proj.weight", lambda w: w.astype(np.float16))),
                    r"5\.gate_proj\.weight.*expected dtype BF16, found F16"),
    "extra_expert": (dict(edit=_extra_expert), r"experts 0\.\.15.*found expert 16"),
    "config_expert_count_mismatch": (dict(config_edit=lambda c: c.update(num_experts=20)),
                                     r"gate\.weight.*num_experts=20"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_checkpoint_names_the_tensor(tmp_path, case):
    how, says = BROKEN[case]
    with pytest.raises(CheckpointError, match=says):
        FusedMoE.from_safetensors(rewrite(tmp_path, **how), LAYER)


def test_nan_weight_leaves_no_layer(tmp_path):
    def edit(t):
        w = t[Q + "7.down_proj.weight"].copy()
        w[3, 5] = np.nan
        t[Q + "7.down_proj.weight"] = w
    path = rewrite(tmp_path, edit=edit)
    layer = None
    with pytest.raises(CheckpointError, match=r"w2_weight.*local experts \[7\]"):
        layer = FusedMoE.from_safetensors(path, LAYER)
    assert layer is None


def test_unknown_family(tmp_path):
    out = tmp_path / "odd"
    out.mkdir()
    save_file({"model.layers.0.mlp.fc.weight": np.zeros((4, 4), np.float32)},
              str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="MoE layers found: none"):
        FusedMoE.from_safetensors(out, 0)
    save_file({"transformer.h.0.weight": np.zeros((4, 4), np.float32)},
              str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="at least one MoE layer"):
        FusedMoE.from_safetensors(out)


def test_layer_that_is_not_moe():
    with pytest.raises(CheckpointError, match=r"got 0; MoE layers found: \[1\]"):
        FusedMoE.from_safetensors(DATA / "deepseek_v3", 0)


def test_model_type_disagrees_with_names(tmp_path):
    path = rewrite(tmp_path, config_edit=lambda c: c.update(model_type="mixtral"))
    with pytest.raises(CheckpointError, match="model_type 'mixtral'"):
        FusedMoE.from_safetensors(path, LAYER)


def test_no_config_needs_top_k(tmp_path):
    path = rewrite(tmp_path, config=False)
    with pytest.raises(CheckpointError, match="top_k"):
        FusedMoE.from_safetensors(path, LAYER)
    layer = FusedMoE.from_safetensors(path, LAYER, top_k=4, renormalize=True)
    assert layer.num_experts == 16 and layer.intermediate_size == 64


def test_missing_path_and_missing_shard(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        FusedMoE.from_safetensors(tmp_path / "nowhere")
    sharded = datagen.shard_checkpoint(DATA / "mixtral", tmp_path / "s", 2)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard file"):
        FusedMoE.from_safetensors(sharded)


def test_gpt_oss_missing_bias(tmp_path):
    path = rewrite(tmp_path, "gpt_oss",
                   edit=lambda t: t.pop(f"model.layers.{LAYER}.mlp.experts.down_proj_bias"))
    with pytest.raises(CheckpointError, match="down_proj_bias.*no such tensor"):
        FusedMoE.from_safetensors(path, LAYER)


def test_copy_of_data_checkpoint_loads(tmp_path):
    shutil.copytree(DATA / "mixtral", tmp_path / "m")
    assert FusedMoE.from_safetensors(tmp_path / "m", LAYER).num_experts == 8
