"""vLLM's modular kernel interface (sandbox/modular/): every compatible (prepare/finalize,
experts) pair against the reference, as vLLM's test_modular_kernel_combinations does.

CPU: prepare/finalize in {one device (NoDPEP), naive DP/EP all-gather, all-to-all token
rows (both on a one-rank CPU communicator here, on two launched ranks below)} x experts in
{reference, torch (CPU), numba (CUDA simulator)} x reduce in the experts (NoOP) or in
finalize (Delegate -> Contiguous). GPU (`gpu`): the CuPy experts (its fused_experts and its
stages), torch on CUDA, numba on the GPU.

    T tokens, E experts, K top-k, H hidden, I intermediate, N = w1 rows (2I gated)
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import reference
from sandbox import modular as mk
from sandbox import quant as sq
from sandbox.ep.checks import MODULAR_CASES, run_modular_parity
from sandbox.ep.comm_cpu import CpuCommunicator

BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = {np.dtype(np.float32): 1e-5, BF16: 1e-2, np.dtype(np.float16): 1e-2}


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.isfinite(got).all(), "NaN/inf never passes"
    den = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / (den if den else 1.0))


def problem(rng, T=9, E=4, K=2, H=16, I=8, dtype=np.float32, activation="silu",
            masked=False, bias=False):
    """Inputs, weights and a routing; `masked` routes rows 3 and every fifth slot nowhere."""
    N = I if activation.endswith("_no_mul") else 2 * I
    x = rng.standard_normal((T, H)).astype(dtype)
    w1 = (rng.standard_normal((E, N, H)) / np.sqrt(H)).astype(dtype)
    w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(dtype)
    tw, ids, _ = reference.fused_topk(x, rng.standard_normal((T, E)).astype(np.float32), K,
                                      True)
    if masked:
        ids = ids.copy()
        ids.reshape(-1)[::5] = -1
        ids[min(3, T - 1)] = -1
    b1 = (0.1 * rng.standard_normal((E, N))).astype(dtype) if bias else None
    b2 = (0.1 * rng.standard_normal((E, H))).astype(dtype) if bias else None
    return x, w1, w2, tw, ids, b1, b2


def oracle(x, w1, w2, tw, ids, activation, on_input=False, b1=None, b2=None,
           expert_map=None, global_num_experts=-1):
    name, mul = mk.split_activation(activation)
    return reference.fused_experts(x, w1, w2, tw, ids, name, on_input,
                                   global_num_experts=global_num_experts,
                                   expert_map=expert_map, w1_bias=b1, w2_bias=b2,
                                   is_act_and_mul=mul, precision="exact")


@pytest.fixture(scope="module")
def comm1():
    comm = CpuCommunicator(0, 1, store=None, timeout=10)
    yield comm
    comm.destroy()


PREPARE_FINALIZE = ("no_dp_ep", "naive_dp_ep", "all_to_all")


def make_pf(name, comm):
    return {"no_dp_ep": lambda: mk.MoEPrepareAndFinalizeNoDPEPModular(),
            "naive_dp_ep": lambda: mk.MoEPrepareAndFinalizeNaiveDPEPModular(comm),
            "all_to_all": lambda: mk.AllToAllPrepareAndFinalize(comm)}[name]()


# (dtype, activation, K, masked, on_input, bias): the semantics each pair must carry
CONFIGS = {
    "bf16-silu-masked": (BF16, "silu", 2, True, False, False),
    "fp32-swigluoai-bias": (np.dtype(np.float32), "swigluoai", 3, False, False, True),
    "bf16-gelu": (BF16, "gelu", 2, False, False, False),
    "fp32-relu2-no-mul-masked": (np.dtype(np.float32), "relu2_no_mul", 2, True, False, False),
    "bf16-top1-on-input": (BF16, "silu", 1, True, True, False),
}
# the simulator runs a GEMM thread per Python call: numba gets the first two configs only
EXPERTS_CPU = {"reference": list(CONFIGS), "torch": list(CONFIGS),
               "numba": ["bf16-silu-masked", "fp32-relu2-no-mul-masked"]}
PAIRS = [(pf, ex, reduce, cfg) for pf in PREPARE_FINALIZE for ex, cfgs in EXPERTS_CPU.items()
         for reduce in (True, False) for cfg in cfgs]


@pytest.mark.parametrize("pf,experts,reduce,config", [
    pytest.param(*p, id=f"{p[0]}-{p[1]}-{'reduce' if p[2] else 'delegate'}-{p[3]}")
    for p in PAIRS])
def test_pair_matches_reference(pf, experts, reduce, config, comm1, rng):
    if experts == "numba":
        # numba's mode is fixed at its first import: where another test has imported
        # numba.cuda without the simulator, these pairs run in tests/numba/test_simulator.py's process
        from sandbox import registry

        be = registry.get_backend("numba")
        if not be.ok:
            pytest.skip(f"numba is not usable in this process ({be.reason[:80]}...); "
                        f"tests/numba/test_simulator.py runs these pairs in the simulator")
    dtype, activation, K, masked, on_input, bias = CONFIGS[config]
    x, w1, w2, tw, ids, b1, b2 = problem(rng, K=K, dtype=dtype, activation=activation,
                                         masked=masked, bias=bias)
    qc = mk.FusedMoEQuantConfig.make(w1_bias=b1, w2_bias=b2)
    kernel = mk.FusedMoEKernel(make_pf(pf, comm1),
                               mk.EXPERTS[experts](qc, block_size=4, reduce=reduce))
    got = kernel.apply(x, w1, w2, tw, ids, activation, apply_router_weight_on_input=on_input)
    assert got.dtype == x.dtype and got.shape == x.shape
    want = oracle(x, w1, w2, tw, ids, activation, on_input, b1, b2)
    assert rel(got, want) <= TOL[np.dtype(dtype)]
    if masked:   # a token routed nowhere: exactly 0, whatever the unwritten rows held
        dead = (ids < 0).all(axis=1)
        assert dead.any() and not np.asarray(got, np.float64)[dead].any()


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "swigluoai", "gelu_no_mul"])
def test_reference_experts_reduced_are_fused_experts_bit_for_bit(dtype, activation, rng):
    """NoDPEP + ReferenceExperts(reduce=True) is reference.fused_experts: the same stages,
    the same rounding points, so the modular wrapper adds no arithmetic of its own."""
    x, w1, w2, tw, ids, _, _ = problem(rng, dtype=dtype, activation=activation, masked=True)
    kernel = mk.FusedMoEKernel(mk.MoEPrepareAndFinalizeNoDPEPModular(),
                               mk.ReferenceExperts(block_size=4))
    got = kernel.apply(x, w1, w2, tw, ids, activation)
    name, mul = mk.split_activation(activation)
    want = reference.fused_experts(x, w1, w2, tw, ids, name, is_act_and_mul=mul, block_size=4)
    assert np.array_equal(got, want)


def test_expert_map_on_one_device(rng):
    """An expert map on the one-device prepare/finalize: global ids, the local half of the
    experts, the other half adding nothing (vLLM's EP rank without a dispatch)."""
    x, w1, w2, tw, ids, _, _ = problem(rng, E=4, K=2, masked=True)
    _, emap = reference.determine_expert_map(2, 1, 4)          # rank 1 of 2: experts 2, 3
    local = np.flatnonzero(emap >= 0)
    for experts in ("reference", "torch"):
        for reduce in (True, False):
            kernel = mk.FusedMoEKernel(mk.MoEPrepareAndFinalizeNoDPEPModular(),
                                       mk.EXPERTS[experts](block_size=4, reduce=reduce))
            got = kernel.apply(x, w1[local], w2[local], tw, ids, "silu", 4, emap)
            want = oracle(x, w1[local], w2[local], tw, ids, "silu", expert_map=emap,
                          global_num_experts=4)
            assert rel(got, want) <= 1e-5, (experts, reduce)


def test_torch_arrays_in_and_out(rng):
    """torch in, torch out: the kernel allocates with hidden_states' library and the
    experts write the output in place whatever their backend."""
    import torch

    from sandbox.arrays import numpy_to_torch

    x, w1, w2, tw, ids, _, _ = problem(rng, dtype=BF16, masked=True)
    tx, tw1, tw2, ttw, tids = (numpy_to_torch(np.ascontiguousarray(a))
                               for a in (x, w1, w2, tw, ids))
    want = oracle(x, w1, w2, tw, ids, "silu")
    for experts in ("reference", "torch"):
        for pf in (mk.MoEPrepareAndFinalizeNoDPEPModular(),
                   mk.MoEPrepareAndFinalizeNaiveDPEPModular(
                       CpuCommunicator(0, 1, store=None, timeout=5))):
            got = mk.FusedMoEKernel(pf, mk.EXPERTS[experts](block_size=4)).apply(
                tx, tw1, tw2, ttw, tids)
            assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
            assert rel(got.float().numpy(), want) <= 1e-2


# ----------------------------------------------------------------------------- the pieces
def test_workspace_shapes_are_triton_experts():
    ex = mk.ReferenceExperts()
    #                    M, N, K hidden, topk, E global, E local, meta, activation
    assert ex.workspace_shapes(5, 32, 24, 2, 8, 8, None, "silu") == \
        ((5, 2, 24), (5, 2, 32), (5, 24))
    assert ex.workspace_shapes(5, 32, 8, 2, 8, 8, None, "silu") == \
        ((5, 2, 16), (5, 2, 32), (5, 8))
    assert ex.workspace_shapes(5, 32, 8, 2, 8, 8, None, "relu2_no_mul")[0] == (5, 2, 32)
    assert mk.ReferenceExperts(reduce=False).workspace_shapes(
        5, 32, 24, 2, 8, 8, None, "silu")[2] == (5, 2, 24)
    assert mk.FusedMoEExpertsModular.adjust_N_for_activation(32, "swigluoai") == 16
    assert mk.FusedMoEExpertsModular.adjust_N_for_activation(32, "gelu_no_mul") == 32
    assert ex.finalize_weight_and_reduce_impl() == mk.TopKWeightAndReduceNoOP()
    assert mk.ReferenceExperts(reduce=False).finalize_weight_and_reduce_impl() == \
        mk.TopKWeightAndReduceDelegate()
    assert ex.supports_expert_map() and not ex.is_monolithic()
    assert ex.activation_format() == mk.FusedMoEActivationFormat.Standard


def test_apply_checks_output_and_workspaces(rng):
    x, w1, w2, tw, ids, _, _ = problem(rng)
    ex = mk.ReferenceExperts(block_size=4)
    E, M, N, H, K = ex.moe_problem_size(x, w1, w2, ids)
    ws13, ws2, out = ex.workspace_shapes(M, N, H, K, E, E, None, "silu")
    args = (x, w1, w2, tw, ids, "silu", E, None, None, None)
    with pytest.raises(ValueError, match="output: expected shape"):
        ex.apply(np.empty((M, H + 1), x.dtype), *args, np.empty(ws13), np.empty(ws2), None,
                 False)
    with pytest.raises(ValueError, match="workspace2: expected room"):
        ex.apply(np.empty(out, x.dtype), *args, np.empty(ws13), np.empty((1,)), None, False)
    with pytest.raises(NotImplementedError, match="quantized"):
        ex.apply(np.empty(out, x.dtype), x, w1, w2, tw, ids, "silu", E, None,
                 np.ones(1, np.float32), None, np.empty(ws13), np.empty(ws2), None, False)


def test_kernel_refuses_incompatible_pairs():
    class NoMapExperts(mk.ReferenceExperts):
        def supports_expert_map(self):
            return False

    class Batched(mk.MoEPrepareAndFinalizeNoDPEPModular):
        @property
        def activation_format(self):
            return mk.FusedMoEActivationFormat.BatchedExperts

    class TwoRanks:
        world_size, rank, xp = 2, 0, np

    with pytest.raises(ValueError, match="activation formats differ"):
        mk.FusedMoEKernel(Batched(), mk.ReferenceExperts())
    with pytest.raises(ValueError, match="does not support an expert map"):
        mk.FusedMoEKernel(mk.MoEPrepareAndFinalizeNaiveDPEPModular(TwoRanks()), NoMapExperts())
    with pytest.raises(ValueError, match="expected a FusedMoEPrepareAndFinalizeModular"):
        mk.FusedMoEKernel(object(), mk.ReferenceExperts())
    kernel = mk.FusedMoEKernel(mk.MoEPrepareAndFinalizeNoDPEPModular(), NoMapExperts())
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="expert_map"):
        kernel.apply(x, np.zeros((2, 8, 4), np.float32), np.zeros((2, 4, 4), np.float32),
                     np.ones((2, 1), np.float32), np.zeros((2, 1), np.int32), "silu", 4,
                     np.array([0, 1, -1, -1], np.int32))
    with pytest.raises(NotImplementedError, match="unquantized"):
        mk.ReferenceExperts(sq.fp8_w8a8_moe_quant_config(block_shape=(128, 128)))
    with pytest.raises(ValueError, match="weight_dtype: expected one of"):
        mk.FusedMoEQuantConfig(quant_dtype="fp8")


def test_weight_and_reduce_impls(rng):
    T, K, H = 6, 3, 5
    y = rng.standard_normal((T, K, H)).astype(BF16)
    w = rng.random((T, K)).astype(np.float32)
    ids = rng.integers(0, 4, (T, K)).astype(np.int32)
    ids[1, 2] = ids[4] = -1
    y[1, 2] = y[4] = np.nan                                  # rows align never wrote
    with pytest.raises(RuntimeError, match="expected to choose"):
        mk.TopKWeightAndReduceDelegate().apply(None, y, w, ids, False)
    # Contiguous: the weight product rounded to bf16 (vLLM's mul_), then the pad-aware sum
    weighted = (y.astype(np.float32) * w[:, :, None]).astype(BF16)
    want = reference.moe_sum(weighted, ids)
    out = np.empty((T, H), BF16)
    assert mk.TopKWeightAndReduceContiguous().apply(out, y, w, ids, False) is out
    assert np.array_equal(out, want) and np.isfinite(out.astype(np.float32)).all()
    assert np.array_equal(mk.TopKWeightAndReduceContiguous().apply(
        None, y.reshape(T * K, H), w, ids, True), reference.moe_sum(y, ids))
    # NoOP: the experts reduced already
    r = rng.standard_normal((T, H)).astype(np.float32)
    assert mk.TopKWeightAndReduceNoOP().apply(None, r, w, ids, False) is r
    o = np.zeros_like(r)
    mk.TopKWeightAndReduceNoOP().apply(o, r, w, ids, False)
    assert np.array_equal(o, r)


def test_no_dp_ep_weights_the_input_for_top1(rng):
    pf = mk.MoEPrepareAndFinalizeNoDPEPModular()
    x = rng.standard_normal((4, 8)).astype(BF16)
    w = rng.random((4, 1)).astype(np.float32)
    ids = np.zeros((4, 1), np.int32)
    a1q, scale, meta, got_ids, got_w = pf.prepare(x, w, ids, 2, None, True)
    # vLLM: a1 * topk_weights.to(a1.dtype): the weight rounded to bf16, then the product
    want = (x.astype(np.float32) * w.astype(BF16).astype(np.float32)).astype(BF16)
    assert np.array_equal(a1q, want) and scale is meta is got_ids is got_w is None
    assert pf.prepare(x, w, ids, 2, None, False)[0] is x
    with pytest.raises(ValueError, match="top_k == 1"):
        pf.prepare(x, np.ones((4, 2), np.float32), np.zeros((4, 2), np.int32), 2, None, True)


def test_all_to_all_counts_rows_per_local_expert_and_wants_a_linear_map(comm1, rng):
    x, _, _, tw, ids, _, _ = problem(rng, E=4, K=2, masked=True)
    pf = mk.AllToAllPrepareAndFinalize(comm1)
    a1q, _, meta, ids_recv, _ = pf.prepare(x, tw, ids, 4, None, False)
    routed = (ids >= 0).any(axis=1)    # one rank: each token once, unless routed nowhere
    assert not routed.all() and a1q.shape == (routed.sum(), x.shape[1])
    want = np.bincount(ids[ids >= 0], minlength=4)
    assert np.array_equal(meta.expert_num_tokens_cpu, want)
    assert np.array_equal(np.sort(ids_recv, axis=0), np.sort(ids[routed], axis=0))
    with pytest.raises(ValueError, match="linearly"):
        pf.prepare(x, tw, ids, 4, np.array([1, 0, 3, 2], np.int32), False)


def test_empty_batch(comm1):
    x = np.zeros((0, 8), np.float32)
    kernel = mk.FusedMoEKernel(mk.MoEPrepareAndFinalizeNaiveDPEPModular(comm1),
                               mk.ReferenceExperts(block_size=4, reduce=False))
    out = kernel.apply(x, np.zeros((2, 8, 8), np.float32), np.zeros((2, 8, 4), np.float32),
                       np.zeros((0, 2), np.float32), np.zeros((0, 2), np.int32))
    assert out.shape == (0, 8)


# ----------------------------------------------------------------------------- two ranks
@pytest.fixture(scope="module")
def two_rank_results():
    from sandbox.ep import launch

    per_rank = launch(run_modular_parity, 2, timeout=90)
    return [row for rank in per_rank for row in rank]


@pytest.mark.parametrize("case", [c["name"] for c in MODULAR_CASES])
def test_dispatching_pairs_on_two_ranks(two_rank_results, case):
    rows = [r for r in two_rank_results if r["case"] == case]
    # 2 prepare/finalize x 2 experts x 2 reduce modes, on each of the 2 ranks
    assert len(rows) == 16 and sum(r["tokens"] for r in rows) > 0
    for r in rows:
        assert r["error"] <= r["tolerance"], r


# ----------------------------------------------------------------------------- GPU
GPU_CONFIGS = {
    "bf16-silu-masked-fused": (BF16, "silu", 2, True, False, False),      # CuPy fused_experts
    "fp16-gelu-top1-on-input": (np.dtype(np.float16), "gelu", 1, True, True, False),
    "bf16-swigluoai-bias": (BF16, "swigluoai", 3, False, False, True),    # the stages
    "fp32-relu2-no-mul": (np.dtype(np.float32), "relu2_no_mul", 2, True, False, False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["cupy", "torch", "numba"])
@pytest.mark.parametrize("reduce", [True, False])
@pytest.mark.parametrize("config", list(GPU_CONFIGS))
def test_gpu_experts_match_reference(experts, reduce, config, rng):
    from sandbox.registry import get_backend

    b = get_backend(experts)
    if not b.ok or b.is_host:
        pytest.skip(f"{experts}: no GPU backend here ({b.reason})")
    dtype, activation, K, masked, on_input, bias = GPU_CONFIGS[config]
    x, w1, w2, tw, ids, b1, b2 = problem(rng, T=67, E=8, K=K, H=128, I=64, dtype=dtype,
                                         activation=activation, masked=masked, bias=bias)
    qc = mk.FusedMoEQuantConfig.make(w1_bias=b1, w2_bias=b2)
    want = oracle(x, w1, w2, tw, ids, activation, on_input, b1, b2)
    for pf in ("no_dp_ep", "naive_dp_ep", "all_to_all"):
        kernel = mk.FusedMoEKernel(make_pf(pf, CpuCommunicator(0, 1, store=None, timeout=10)),
                                   mk.EXPERTS[experts](qc, reduce=reduce))
        got = kernel.apply(x, w1, w2, tw, ids, activation,
                           apply_router_weight_on_input=on_input)
        assert rel(got, want) <= TOL[np.dtype(dtype)], pf
        if masked:
            dead = (ids < 0).all(axis=1)
            assert not np.asarray(got, np.float64)[dead].any(), pf


@pytest.mark.gpu
def test_gpu_cupy_experts_take_fused_experts_on_device_arrays(monkeypatch, rng):
    """CupyExperts with a gated silu in bf16, no biases, reduce=True: one call of
    cuda_kernels.cupy.fused_experts, on torch CUDA tensors in and out."""
    import torch

    from sandbox.registry import get_backend

    b = get_backend("cupy")
    if not b.ok:
        pytest.skip(b.reason)
    real = b.module.fused_experts
    calls = []

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    counting.activations = real.activations
    monkeypatch.setattr(b.module, "fused_experts", counting)
    x, w1, w2, tw, ids, _, _ = problem(rng, T=33, E=8, K=2, H=128, I=64, dtype=BF16,
                                       masked=True)
    from sandbox.arrays import numpy_to_torch

    dev = [numpy_to_torch(np.ascontiguousarray(a), "cuda") for a in (x, w1, w2, tw, ids)]
    got = mk.FusedMoEKernel(mk.MoEPrepareAndFinalizeNoDPEPModular(),
                            mk.CupyExperts()).apply(*dev, "silu")
    assert calls == [1]
    assert isinstance(got, torch.Tensor) and got.is_cuda and got.dtype == torch.bfloat16
    assert rel(got.float().cpu().numpy(), oracle(x, w1, w2, tw, ids, "silu")) <= 1e-2
    assert math.isfinite(float(got.float().abs().sum()))
