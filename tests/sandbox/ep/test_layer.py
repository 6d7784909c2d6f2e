"""The expert-parallel layer against the single-device layer, on the CPU communicator.

Every scheme (all-gather / all-to-all-v) x placement (linear / round_robin) x EPLB setting
(off, redundant replicas, rebalanced from a skewed recorded load) at world sizes 2 and 4,
plus bf16 / fp16, biases, grouped routing, the weight-loader path and top-1 routing on the
input; world size 8 runs the fp32 matrix. One launched group per world size runs all its
cases (spawning costs about a second per process); each test then checks one case on
every rank. Token counts per rank are uneven and some ranks get none.
"""
import numpy as np
import pytest

from sandbox.ep import launch
from sandbox.ep.checks import parity_cases, run_parity

WORLD_SIZES = {2: False, 4: False, 8: True}   # world size -> quick case list only
_RESULTS = {}


def _results(world_size):
    if world_size not in _RESULTS:
        cases = parity_cases(world_size, quick=WORLD_SIZES[world_size])
        per_rank = launch(run_parity, world_size, args=(cases,), timeout=60)
        _RESULTS[world_size] = {c["name"]: [r[i] for r in per_rank] for i, c in
                                enumerate(cases)}
    return _RESULTS[world_size]


PARAMS = [pytest.param(w, c["name"], id=f"W{w}-{c['name']}")
          for w, quick in WORLD_SIZES.items() for c in parity_cases(w, quick=quick)]


@pytest.mark.parametrize("world_size,case", PARAMS)
def test_ep_matches_single_device(world_size, case):
    ranks = _results(world_size)[case]
    assert sum(r["tokens"] for r in ranks) > 0
    for info in ranks:
        err = info["error"]
        assert not np.isnan(err), f"rank {info['rank']}: NaN in the EP output"
        assert err <= info["tolerance"], f"rank {info['rank']}: rel. error {err:.3g}"
        if "error_after_rebalance" in info:
            err2 = info["error_after_rebalance"]
            assert not np.isnan(err2) and err2 <= info["tolerance"], \
                f"rank {info['rank']}: rel. error {err2:.3g} after EPLB moved the experts"
        if "same_local_experts_as_expert_map" in info:
            assert info["same_local_experts_as_expert_map"], \
                f"rank {info['rank']}: local experts differ from determine_expert_map's"


@pytest.mark.parametrize("world_size", sorted(WORLD_SIZES))
def test_eplb_rebalance_moved_experts_and_counted_every_slot(world_size):
    results = _results(world_size)
    rebalanced = [ranks for ranks in results.values() if "moved" in ranks[0]]
    assert rebalanced
    for ranks in rebalanced:
        # the recorded load, summed over ranks, is every routed slot of the first forward
        name = next(n for n, v in results.items() if v is ranks)
        case = next(c for c in parity_cases(world_size, quick=WORLD_SIZES[world_size])
                    if c["name"] == name)
        assert ranks[0]["load_total"] == case["tokens"] * case["config"]["top_k"]
        # every rank computed the same placement from the same all-reduced load
        assert len({(r["moved"], r["max_gpu_load_after"]) for r in ranks}) == 1
    assert any(ranks[0]["moved"] for ranks in rebalanced)


def test_single_rank_layer_in_process_equals_reference():
    """World size 1 needs no processes: the EP layer is then the plain layer."""
    from sandbox.ep.comm_cpu import CpuCommunicator
    from sandbox.ep.layer import EPConfig, EPMoE
    from sandbox.layer import FusedMoE

    comm = CpuCommunicator(0, 1, store=None)
    ref = FusedMoE.random(3, num_experts=6, top_k=2, hidden_size=16, intermediate_size=8)
    x, logits = ref.random_inputs(9, seed=4)
    for scheme in ("allgather", "alltoall"):
        layer = EPMoE(comm, EPConfig(num_experts=6, top_k=2, hidden_size=16,
                                     intermediate_size=8, dtype="float32", scheme=scheme,
                                     num_redundant_experts=2))
        layer.load_from(ref)
        out = layer.forward(x, logits)
        want = ref.forward(x, logits)
        assert np.linalg.norm(out - want) <= 1e-6 * np.linalg.norm(want)
        assert layer.forward(x[:0], logits[:0]).shape == (0, 16)


def test_unloaded_experts_are_refused():
    from sandbox.ep.comm_cpu import CpuCommunicator
    from sandbox.ep.layer import EPConfig, EPMoE

    comm = CpuCommunicator(0, 1, store=None)
    layer = EPMoE(comm, EPConfig(num_experts=4, top_k=1, hidden_size=8, intermediate_size=8,
                                 dtype="float32"))
    x = np.ones((2, 8), dtype=np.float32)
    with pytest.raises(RuntimeError, match="never loaded"):
        layer.forward(x, np.zeros((2, 4), dtype=np.float32))


@pytest.mark.parametrize("kwargs,match", [
    (dict(scheme="ring"), "scheme: expected one of"),
    (dict(placement="random"), "placement: expected one of"),
    (dict(dtype="int8"), "dtype: expected one of"),
    (dict(top_k=9), "top_k: expected at most num_experts=8"),
    (dict(top_k=2, apply_router_weight_on_input=True), "needs top_k == 1"),
    (dict(hidden_size=0), "hidden_size: expected a positive int"),
])
def test_bad_config_raises(kwargs, match):
    from sandbox.ep.layer import EPConfig

    base = dict(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8)
    with pytest.raises((ValueError, TypeError), match=match):
        EPConfig(**{**base, **kwargs})


@pytest.mark.slow
def test_cli_eplb_and_check(capsys):
    from sandbox.ep import cli_main

    assert cli_main(["eplb", "--experts", "8", "--gpus", "2", "--redundant", "2"]) == 0
    out = capsys.readouterr().out
    assert "GPU 1: experts" in out and "max GPU load, EPLB" in out
    assert cli_main(["eplb", "--experts", "8", "--gpus", "3", "--redundant", "0"]) == 2
    assert "num_physical: expected a multiple of num_gpus=3" in capsys.readouterr().err
    assert cli_main(["check", "--cpu", "2", "--quick"]) == 0
    assert "all checks passed" in capsys.readouterr().out


def test_weight_loader_full_tensor_and_per_expert_agree_with_replicas():
    """A logical expert's tensor lands in every local replica, whether it comes alone or
    inside a full [E, ...] tensor."""
    from sandbox.ep.comm_cpu import CpuCommunicator
    from sandbox.ep.layer import EPConfig, EPMoE

    comm = CpuCommunicator(0, 1, store=None)
    cfg = EPConfig(num_experts=4, top_k=2, hidden_size=6, intermediate_size=5,
                   dtype="float32", num_redundant_experts=3)
    rng = np.random.default_rng(0)
    w1, w3 = rng.standard_normal((2, 4, 5, 6)).astype(np.float32)
    w2 = rng.standard_normal((4, 6, 5)).astype(np.float32)
    full = EPMoE(comm, cfg)
    full.weight_loader(full.w13_weight, w1, "experts.w1.weight", "w1", 0)
    full.weight_loader(full.w13_weight, w3, "experts.w3.weight", "w3", 0)
    full.weight_loader(full.w2_weight, w2, "experts.w2.weight", "w2", 0)
    each = EPMoE(comm, cfg)
    for e in range(4):
        assert each.weight_loader("w13_weight", w1[e], f"experts.{e}.w1.weight", "w1", e)
        each.weight_loader("w13_weight", w3[e], f"experts.{e}.w3.weight", "w3", e)
        each.weight_loader("w2_weight", w2[e], f"experts.{e}.w2.weight", "w2", e)
    assert np.array_equal(full.w13_weight, each.w13_weight)
    local = each.local_logical_experts()            # [0, 1, 2, 3, 0, 1, 2]: replicas
    assert local.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert np.array_equal(each.w13_weight[4], np.concatenate([w1[0], w3[0]]))
    assert np.array_equal(each.w2_weight[6], w2[2])
    with pytest.raises(ValueError, match=r"expert_id: expected a logical expert id in \[0, 4\)"):
        each.weight_loader("w2_weight", w2[0], "experts.9.w2.weight", "w2", 9)


def test_device_parameters_without_host_weights():
    from sandbox.ep.comm_cpu import CpuCommunicator
    from sandbox.ep.layer import EPConfig, EPMoE
    from sandbox.layer import FusedMoE

    comm = CpuCommunicator(0, 1, store=None)
    ref = FusedMoE.random(2, num_experts=4, top_k=2, hidden_size=8, intermediate_size=8)
    layer = EPMoE(comm, EPConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                                 dtype="float32"), host_weights=False)
    with pytest.raises(ValueError, match=r"w2_weight: expected shape \(4, 8, 8\)"):
        layer.set_device_parameters(w2_weight=ref.w2_weight[:2])
    layer.set_device_parameters(w13_weight=ref.w13_weight, w2_weight=ref.w2_weight)
    x, logits = ref.random_inputs(5, seed=1)
    out = layer.forward(x, logits)
    want = ref.forward(x, logits)
    assert np.linalg.norm(out - want) <= 1e-6 * np.linalg.norm(want)
    with pytest.raises(RuntimeError, match="host_weights=False"):
        layer.load_from(ref)


def test_backend_assignment_goes_through_the_constructor_checks():
    """`layer.backend = name` re-runs the constructor's checks and drops the cached copies
    made from the host weights; arrays handed over by set_device_parameters stay."""
    from sandbox.ep.comm_cpu import CpuCommunicator
    from sandbox.ep.layer import EPConfig, EPMoE
    from sandbox.layer import FusedMoE

    comm = CpuCommunicator(0, 1, store=None)
    ref = FusedMoE.random(2, num_experts=4, top_k=2, hidden_size=8, intermediate_size=8)
    layer = EPMoE(comm, EPConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
                                 dtype="float32"))
    layer.load_from(ref)
    x, logits = ref.random_inputs(5, seed=1)
    want = layer.forward(x, logits)
    with pytest.raises(ValueError, match=r"backend: expected one of \['reference'.*got 'tpu'"):
        layer.backend = "tpu"
    with pytest.raises((RuntimeError, ValueError), match="backend: "):
        layer.backend = "cupy"           # no GPU here, or not a host backend for the CPU comm
    assert layer.backend == "reference" and np.array_equal(layer.forward(x, logits), want)
    assert "w13_weight" in layer._dev
    given = ref.w2_weight.copy()
    layer.set_device_parameters(w2_weight=given)
    layer.backend = "reference"
    assert "w13_weight" not in layer._dev and layer._dev["w2_weight"] is given
    assert np.array_equal(layer.forward(x, logits), want)
