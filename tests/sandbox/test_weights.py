"""The weights alone (sandbox/weights.py): a checkpoint loads into a MoEWeights with no
pipeline to run it, holding what the FusedMoE of the same checkpoint holds; random weights
match FusedMoE.random's; device copies are made once per load and dropped when stale."""
from __future__ import annotations

import numpy as np
import pytest

from sandbox import FusedMoE, MoEWeights, datagen
from sandbox.checkpoint import CheckpointError, data_dir, router_logits

DATA = data_dir()
LAYER = datagen.MOE_LAYER


def assert_same_weights(a, b):
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert p.dtype == q.dtype and np.array_equal(p, q, equal_nan=True), name


@pytest.mark.parametrize("family", list(datagen.FAMILIES))
def test_a_checkpoint_loads_into_the_weights_alone(family):
    weights = MoEWeights.from_safetensors(DATA / family, LAYER)
    assert type(weights) is MoEWeights and not weights.unloaded()
    assert not hasattr(weights, "forward") and not hasattr(weights, "top_k")
    layer = FusedMoE.from_safetensors(DATA / family, LAYER)
    assert_same_weights(weights, layer)
    assert weights.activation == layer.activation and weights.has_bias == layer.has_bias
    assert weights.checkpoint_info["family"] == family
    assert np.array_equal(weights.router_weight, layer.router_weight)
    x = np.random.default_rng(0).standard_normal((3, weights.hidden_size), np.float32)
    assert np.array_equal(router_logits(weights, x), router_logits(layer, x))


def test_the_weights_shard_as_the_layer_does():
    for shard in ({"tp_size": 2, "tp_rank": 1}, {"ep_size": 2, "ep_rank": 1},
                  {"ep_size": 4, "ep_rank": 2, "expert_placement": "round_robin"}):
        weights = MoEWeights.from_safetensors(DATA / "deepseek_v3", LAYER, **shard)
        layer = FusedMoE.from_safetensors(DATA / "deepseek_v3", LAYER, **shard)
        assert_same_weights(weights, layer)
        assert np.array_equal(weights.local_to_global, layer.local_to_global)


def test_the_weights_refuse_arguments_they_do_not_take():
    with pytest.raises(TypeError, match=r"got \['top_k'\]"):
        MoEWeights.from_safetensors(DATA / "qwen3_moe", LAYER, top_k=2)
    with pytest.raises(TypeError, match="tp_sise"):
        MoEWeights.from_safetensors(DATA / "qwen3_moe", LAYER, tp_sise=2)
    with pytest.raises(CheckpointError, match="refused.*intermediate_size"):
        MoEWeights.from_safetensors(DATA / "qwen3_moe", LAYER, tp_size=3)


def test_random_weights_are_the_layers():
    kwargs = dict(num_experts=6, hidden_size=16, intermediate_size=24, has_bias=True,
                  n_shared_experts=1, ep_size=2, ep_rank=1)
    weights = MoEWeights(**kwargs).load_random(seed=3)
    assert not weights.unloaded()
    assert_same_weights(weights, FusedMoE.random(seed=3, top_k=2, **kwargs))


class _FakeGpu:
    """A GPU backend as the weights see one: a name, not host, and a counted copy."""

    name, is_host = "fake", False

    def __init__(self):
        self.copies = 0

    def put(self, a):
        self.copies += 1
        return ("on the fake GPU", a.copy())

    take = put


def test_device_copies_once_per_load():
    weights = MoEWeights(4, 8, 8, ep_size=2, ep_rank=0).load_random(seed=1)
    gpu = _FakeGpu()
    first = weights.param_for("w13_weight", gpu)
    assert weights.param_for("w13_weight", gpu) is first and gpu.copies == 1
    emap = weights.constant_for("expert_map", weights.expert_map, gpu)
    assert weights.constant_for("expert_map", weights.expert_map, gpu) is emap
    assert gpu.copies == 2
    weights.weight_loader("w2_weight", np.zeros((8, 8), np.float32), "experts.0.w2.weight",
                          "w2", 0)                       # a load: every copy is stale
    again = weights.param_for("w13_weight", gpu)
    assert again is not first and gpu.copies == 3
    assert np.array_equal(weights.param_for("w13_weight", gpu, exact=True),
                          weights.w13_weight.astype(np.float64))
    weights.keep_device_copies({"fake"})
    assert weights._device_params
    weights.keep_device_copies(set())
    assert not weights._device_params
