"""The CuPy fused_experts plan, torch streams and CUDA graphs, on the GPU.

    T tokens, E experts, K top-k, H hidden, I intermediate, P = T*K slots

`cuda_kernels.cupy.fused_experts` launches the stages' own kernels from a plan cached per
shape: its output must be the stage-by-stage output bit for bit (same kernels, same configs),
for CuPy arrays and for torch tensors, with outputs poisoned (NaN) before every launch. The
layer and the plan run on torch's current stream when torch calls them, so a torch.cuda.graph
capture records real work: the tests capture, replay on fresh inputs written into the captured
buffers, and compare with an eager run on those inputs. Every test is `gpu`.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import reference
from cuda_kernels.cupy import _arrays as A
from tests.oracles import BF16, rel_err
from tests.support import gpu_marks

pytestmark = [*gpu_marks("cupy"), pytest.mark.usefixtures("cupy_poison")]


def _problem(rng, T, E, K, H, I, dtype=BF16):  # noqa: E741
    x = rng.standard_normal((T, H)).astype(np.float32)
    w1 = (rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(np.float32)
    w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    tw, ids, _ = reference.fused_topk(x, logits, K, True)
    return (x.astype(dtype), w1.astype(dtype), w2.astype(dtype), tw.astype(np.float32),
            ids.astype(np.int32))


def _stages(x, w1, w2, tw, ids, block):
    """The five CuPy stage functions, one after the other (the contract's path)."""
    from cuda_kernels import cupy as ck

    T, K = ids.shape
    E = w1.shape[0]
    s, e, n = ck.moe_align_block_size(ids, block, E)
    c1 = ck.grouped_gemm(x, w1, s, e, n, K, block, tw, False)
    c2 = ck.apply_activation(c1, "silu", True)
    c3 = ck.grouped_gemm(c2, w2, s, e, n, 1, block, tw, True)
    return ck.moe_sum(c3.reshape(T, K, -1))


SHAPES = [(1, 8, 2, 256, 512), (7, 16, 4, 128, 192), (64, 32, 8, 256, 128),
          (300, 8, 2, 512, 256), (5000, 4, 1, 64, 64)]


@pytest.fixture
def staged(monkeypatch):
    """The plan's five stage kernels at every T (no one-launch decode path,
    tests/cupy/test_experts_decode.py): what the bit-for-bit comparisons are about."""
    from cuda_kernels.cupy import experts, experts_decode

    monkeypatch.setitem(experts_decode.CONFIGS, "decode",
                        {**experts_decode.CONFIGS["decode"], "MAX_TOKENS": 0})
    monkeypatch.setattr(experts, "_PLANS", {})


@pytest.mark.parametrize("T,E,K,H,I", SHAPES)
def test_fused_experts_is_the_stages_bit_for_bit(T, E, K, H, I, rng, staged):  # noqa: E741
    from cuda_kernels.cupy.experts import fused_experts, plan_for

    host = _problem(rng, T, E, K, H, I)
    x, w1, w2, tw, ids = (A.to_device(a) for a in host)
    got = fused_experts(x, w1, w2, tw, ids)
    plan = plan_for(T, H, E, 2 * I, I, K, BF16, device=x.device.id)
    want = _stages(x, w1, w2, tw, ids, plan.B)
    g, w = A.to_host(got), A.to_host(want)
    assert not np.isnan(g.astype(np.float32)).any()
    np.testing.assert_array_equal(g.view(np.uint16), w.view(np.uint16))
    ref = reference.fused_experts(*(a.astype(np.float64) for a in host[:3]), host[3], host[4])
    assert rel_err(g.astype(np.float64), ref) <= 1e-2
    # a second call reuses the plan (and, for small shapes, its intermediates)
    again = A.to_host(fused_experts(x, w1, w2, tw, ids))
    np.testing.assert_array_equal(again.view(np.uint16), g.view(np.uint16))


@pytest.mark.parametrize("ep", [False, True])
def test_fused_experts_slots_routed_nowhere(ep, rng):
    """topk_ids with -1 (vLLM's marker for masked / padded tokens): alignment skips those
    slots, so the GEMMs never write their rows of the (reused) workspace; the plan's combine
    is pad-aware and never reads them. A first call with every slot valid leaves real values
    in the cached workspace, which the second call must not add in."""
    from cuda_kernels import cupy as ck
    from cuda_kernels.cupy.experts import fused_experts, plan_for

    T, E, K, H, I = 24, 8, 2, 128, 64  # noqa: E741
    host = list(_problem(rng, T, E, K, H, I))
    kwargs, ref_kwargs = {}, {}
    if ep:   # rank 1 of 2 holds experts 4..7 (local ids 0..3)
        _, emap = reference.determine_expert_map(2, 1, E)
        host[1], host[2] = host[1][4:].copy(), host[2][4:].copy()
        kwargs = {"expert_map": A.to_device(emap.astype(np.int32))}
        ref_kwargs = {"expert_map": emap, "global_num_experts": E}
    x, w1, w2, tw, ids = (A.to_device(a) for a in host)
    fused_experts(x, w1, w2, tw, ids, **kwargs)          # fills the cached workspace
    bad = host[4].copy()
    bad[3] = -1                                         # a padded token
    bad[5, 1] = -1
    got = A.to_host(fused_experts(x, w1, w2, tw, A.to_device(bad), **kwargs))
    assert (got[3].astype(np.float32) == 0).all()
    ref = reference.fused_experts(*(a.astype(np.float64) for a in host[:3]), host[3], bad,
                                  **ref_kwargs)
    assert rel_err(got.astype(np.float64), ref) <= 1e-2
    if not ep:   # the stages with the pad-aware moe_sum: the same bits
        plan = plan_for(T, H, E, 2 * I, I, K, BF16, device=x.device.id)
        d_bad = A.to_device(bad)
        s, e, n = ck.moe_align_block_size(d_bad, plan.B, E)
        c1 = ck.grouped_gemm(x, w1, s, e, n, K, plan.B, tw, False)
        c3 = ck.grouped_gemm(ck.apply_activation(c1, "silu", True), w2, s, e, n, 1, plan.B, tw,
                             True)
        want = A.to_host(ck.moe_sum(c3.reshape(T, K, -1), d_bad))
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_fused_experts_torch_tensors_and_errors(rng):
    torch = pytest.importorskip("torch")
    from cuda_kernels.cupy.experts import fused_experts

    host = _problem(rng, 33, 8, 2, 128, 256)
    tx = [torch.from_numpy(a.view(np.int16) if a.dtype == BF16 else a).cuda() for a in host]
    tx[0], tx[1], tx[2] = (t.view(torch.bfloat16) for t in tx[:3])
    out = fused_experts(*tx)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    want = A.to_host(fused_experts(*(A.to_device(a) for a in host)))
    np.testing.assert_array_equal(out.view(torch.int16).cpu().numpy().view(np.uint16),
                                  want.view(np.uint16))
    with pytest.raises(ValueError, match="w2"):
        fused_experts(tx[0], tx[1], tx[2][:, :, :-8].contiguous(), tx[3], tx[4])
    with pytest.raises(TypeError, match="topk_ids"):
        fused_experts(tx[0], tx[1], tx[2], tx[3], tx[4].long())
    with pytest.raises(ValueError, match="contiguous"):
        fused_experts(tx[0].t().contiguous().t(), tx[1], tx[2], tx[3], tx[4])


def _capture(torch, fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.cuda.graph(g):
            out = fn()
    assert not [w for w in caught if "empty" in str(w.message).lower()], \
        "the capture recorded no work"
    return g, out


@pytest.mark.parametrize("T", [1, 64, 700])
def test_fused_experts_captures_under_torch_graph(T, rng):
    torch = pytest.importorskip("torch")
    from cuda_kernels.cupy.experts import fused_experts

    host = _problem(rng, T, 16, 4, 256, 128)
    tx = [torch.from_numpy(a.view(np.int16) if a.dtype == BF16 else a).cuda() for a in host]
    tx[0], tx[1], tx[2] = (t.view(torch.bfloat16) for t in tx[:3])
    g, out = _capture(torch, lambda: fused_experts(*tx))
    fresh = _problem(np.random.default_rng(99 + T), T, 16, 4, 256, 128)
    tx[0].copy_(torch.from_numpy(fresh[0].view(np.int16)).cuda().view(torch.bfloat16))
    tx[3].copy_(torch.from_numpy(fresh[3]).cuda())
    tx[4].copy_(torch.from_numpy(fresh[4]).cuda())
    g.replay()
    eager = fused_experts(*tx)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))


def test_layer_captures_under_torch_graph_and_replays_fresh_inputs(rng):
    torch = pytest.importorskip("torch")
    from sandbox import FusedMoE

    layer = FusedMoE.random(num_experts=8, top_k=2, hidden_size=256, intermediate_size=512,
                            params_dtype="bfloat16", seed=3).with_backend("cupy")

    def inputs(seed):
        x, lg = layer.random_inputs(48, seed=seed)
        return (torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16),
                torch.from_numpy(lg).cuda())

    x, lg = inputs(1)
    g, out = _capture(torch, lambda: layer.forward(x, lg, return_device=True))
    x2, lg2 = inputs(2)
    x.copy_(x2)
    lg.copy_(lg2)
    g.replay()
    eager = layer.forward(x, lg, return_device=True)
    torch.cuda.synchronize()
    as_t = (lambda a: a if isinstance(a, torch.Tensor) else torch.from_dlpack(a))
    assert torch.equal(as_t(out).view(torch.int16), as_t(eager).view(torch.int16))
    want = layer.with_backend("reference").forward(x2.float().cpu().numpy(),
                                                   lg2.cpu().numpy())
    got = as_t(eager).float().cpu().numpy()
    assert rel_err(got.astype(np.float64), want.astype(np.float64)) <= 2e-2


def test_cupy_stream_capture_of_the_plan(rng):
    import cupy

    from cuda_kernels.cupy.experts import fused_experts

    host = _problem(rng, 20, 8, 2, 128, 128)
    x, w1, w2, tw, ids = (A.to_device(a) for a in host)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fused_experts(x, w1, w2, tw, ids)            # plan, kernels and workspace made here
        stream.begin_capture()
        out = fused_experts(x, w1, w2, tw, ids)
        graph = stream.end_capture()
        x[...] = A.to_device(_problem(np.random.default_rng(5), 20, 8, 2, 128, 128)[0])
        graph.launch(stream)
        eager = fused_experts(x, w1, w2, tw, ids)
    stream.synchronize()
    np.testing.assert_array_equal(A.to_host(out).view(np.uint16),
                                  A.to_host(eager).view(np.uint16))


@pytest.mark.parametrize("rung", ["v5", "v6"])
def test_fused_experts_runs_the_rung_the_card_table_names(rung, rng, monkeypatch):
    """Where the card's section names a rung for the bucket (v5 with block sizes of 64, v6
    with its tensor maps of w1 and w2 and a grid of the SMs), the plan launches it and still
    equals the stage path."""
    from cuda_kernels.cupy import experts
    from cuda_kernels.cupy import gemm as gg
    from cuda_kernels.cupy import gemm_configs as gcfg
    from cuda_kernels.cupy import tune

    card = gcfg.current_device_name()
    if rung in ("v5", "v6") and not gg._compile.is_sm90(0):
        pytest.skip(f"{rung} runs on sm_90 only")
    by_m = {dk: {str(b): rung for b in gcfg.M_BUCKETS} for dk in ("bf16", "fp16")}
    table = tune.merge_device_section({k: v for k, v in gcfg.load_table().items()
                                       if k != "devices"}, card, [], by_m, {})
    monkeypatch.setattr(gcfg, "load_table", lambda *a: table)
    monkeypatch.setattr(experts, "_PLANS", {})
    gg._plan.cache_clear()
    try:
        T, E, K, H, I = 3, 8, 2, 256, 384  # noqa: E741
        host = _problem(rng, T, E, K, H, I)
        x, w1, w2, tw, ids = (A.to_device(a) for a in host)
        got = experts.fused_experts(x, w1, w2, tw, ids)
        plan = experts.plan_for(T, H, E, 2 * I, I, K, BF16, device=x.device.id)
        assert plan.versions == (rung, rung)
        want = _stages(x, w1, w2, tw, ids, plan.B)
        np.testing.assert_array_equal(A.to_host(got).view(np.uint16),
                                      A.to_host(want).view(np.uint16))
        again = experts.fused_experts(x, w1, w2, tw, ids)       # the workspace reused
        np.testing.assert_array_equal(A.to_host(again).view(np.uint16),
                                      A.to_host(got).view(np.uint16))
    finally:
        gg._plan.cache_clear()
