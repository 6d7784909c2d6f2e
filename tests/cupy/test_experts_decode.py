"""The decode step's experts in one launch (cuda_kernels/cupy/experts_decode.py: rung 1
experts_decode.cu, rung 2 experts_decode_ring.cu).

    T tokens, E experts, K top-k, H hidden, I intermediate, P = T*K slots

On the CPU: which calls take the one-launch path, which rung, and the launch geometry; both
rungs' sources run on the CPU emulator against the reference and against each other. On the
GPU (`gpu`), each rung forced: its output against the float64 reference and against the five
stage kernels, for the gated activations, both half types, slots routed nowhere, and batches
of several tokens (some sharing an expert), with the output poisoned (NaN) before the launch;
the same bits on every call (rung 2's chunk counter is back at 0 after each), under a CUDA
graph, and from both rungs.
"""
from __future__ import annotations

import numpy as np
import pytest

import reference
from cuda_kernels.cupy import _arrays as A
from cuda_kernels.cupy import experts_decode as dec
from tests.oracles import BF16, rel_err
from tests.emulator import library_fixture, ptr
from tests.support import on_gpu

G = 132                                     # an H100's SMs: the geometry's block count


# ----------------------------------------------------------------------------- CPU
def _eligible(**over):
    args = dict(T=1, K=8, H=2048, I=768, dtype=BF16, activation="silu", mul_on_input=False,
                expert_map=False, aligned=True, G=G)
    args.update(over)
    return dec.eligible(**args)


def test_a_decode_batch_takes_the_one_launch_path():
    assert _eligible()
    assert _eligible(dtype=np.dtype(np.float16), activation="gelu_tanh")


@pytest.mark.parametrize("over", [
    dict(T=0), dict(T=dec.CONFIGS["decode"]["MAX_TOKENS"] + 1),
    dict(activation="swigluoai"), dict(mul_on_input=True), dict(expert_map=True),
    dict(aligned=False), dict(H=2044), dict(I=764), dict(dtype=np.dtype(np.float32)),
    dict(T=1, K=64, I=16384),               # c2 [64, 16384] bf16 is 2 MB: no room to stage it
])
def test_what_stays_on_the_staged_path(over):
    assert not _eligible(**over)


def test_phase2_keeps_its_loads_in_flight_per_lane(monkeypatch):
    # PHASE2_LOADS 4: Qwen3 (I = 768: 96 chunks, 3 steps a lane), DeepSeek-V3 (2048), Mixtral
    # (14336) one pair at a time; a tiny I (64: one step) four
    monkeypatch.setitem(dec.CONFIGS, "decode", {**dec.CONFIGS["decode"], "U2": 4,
                                                "PHASE2_LOADS": 4})
    assert [dec.pairs_for(i) for i in (768, 2048, 14336, 64)] == [1, 1, 1, 4]
    monkeypatch.setitem(dec.CONFIGS, "decode", {**dec.CONFIGS["decode"], "PHASE2_LOADS": 8})
    assert [dec.pairs_for(i) for i in (768, 2048, 64)] == [2, 2, 4]
    assert dec.shared_bytes(8, 2048, 768, G, 2) == 8 * 768 * 2 + 64 + 4 * 16 * 8


def test_the_ring_rung_takes_the_shapes_with_megabytes_a_block():
    # an H100's 132 SMs at T = 1: Mixtral-8x7B and DeepSeek-V3 route 705 MB (5.3 MB a block),
    # Qwen3-30B-A3B 75 MB (0.57 MB a block)
    for K, H, I, ring in ((2, 4096, 14336, True), (8, 7168, 2048, True), (8, 2048, 768, False)):
        assert dec.takes_ring(1, K, H, I, 2, G, sm90=True) is ring
        assert dec.takes_ring(1, K, H, I, 2, G, sm90=False) is False    # bulk copies: sm_90
    assert not dec.takes_ring(1, 2, 20480, 14336, 2, G, sm90=True)     # a w1 row over a stage
    assert dec.shared_bytes_ring(2, 4096, 14336, G, 2) == (
        4 * 32768 + 2 * 14336 * 2 + 16 + 4 * 32 * 2 + 4 * (4 * 4 + 32 + 16) + 15 + 8)
    # c2 [2, 14336] bf16 (57344 bytes, a multiple of 256), then 132 blocks' 4 descriptors
    assert dec.workspace_bytes("decode-ring", 2, 14336, G, 2) == 57344 + G * 4 * 32
    assert dec.workspace_bytes("decode", 2, 14336, G, 2) == 57344


# ----------------------------------------------------------------------------- CPU: the emulator
# Rung 2's source on the CPU emulator (tests/emulator: a std::thread per CUDA thread, every
# block at once as in a cooperative launch), with small stages so that the ring wraps many
# times: the producer's chunks, descriptors and end markers, the consumers' arrivals (every
# consumer thread's: one missing is a deadlock the emulator reports) and the grid barrier,
# against the reference. Not the GPU's memory ordering or timing: racecheck and the GPU tests
# judge those.
RING_ENTRY = r"""
#include <tuple>
extern "C" void ring(const void* x, const void* w1, const void* w2, const float* tw,
                     const int* ids, void* c2, void* out, unsigned* bar, unsigned* chunks, int T,
                     int K, int E, int H, int I, int act, int grid) {
    using S = SCALAR_T;
    auto args = std::make_tuple((const S*)x, (const S*)w1, (const S*)w2, tw, ids, (S*)c2,
                                (S*)out, bar, chunks, T, K, E, H, I);
    auto body = [&] {
        if (act == 0) std::apply(moe_decode_ring_kernel<0>, args);
        else if (act == 1) std::apply(moe_decode_ring_kernel<1>, args);
        else std::apply(moe_decode_ring_kernel<2>, args);
    };
    launch_cooperative(grid, 32 * (CONSUMER_WARPS + 1), 0, body);
}"""
RING_DEFINES = {**dec._defines_ring(BF16), "CONSUMER_WARPS": 2, "RING": 3, "STAGE_BYTES": 1024}

emulated_ring = library_fixture(dec.CU_RING, (RING_DEFINES, RING_ENTRY))


def _aligned_bytes(nbytes, fill):
    """nbytes of `fill`, 256-byte aligned (the scratch's descriptor slots take bulk copies)."""
    raw = np.full(nbytes + 256, fill, np.uint8)
    off = (-raw.ctypes.data) % 256
    return raw[off:off + nbytes]


@pytest.mark.parametrize("T,E,K,H,I,activation,G", [
    (1, 8, 2, 128, 64, "silu", 3),         # 4 rows of w1 a stage: 16 chunks a slot
    (2, 8, 4, 256, 96, "gelu", 4),         # a stage of 2 w1 rows, 5 of w2
    (3, 4, 2, 136, 40, "gelu_tanh", 5),    # rows not multiples of 64 bytes, slots sharing
    (2, 4, 2, 8, 16, "silu", 10),          # H < G: blocks with no rows of out
])
def test_emulated_ring_matches_reference(emulated_ring, rng, T, E, K, H, I,  # noqa: E741
                                         activation, G):
    x, w1, w2, tw, ids = _problem(rng, T, E, K, H, I)
    slots = T * K
    c2_bytes = -(-slots * I * 2 // 256) * 256
    scratch = _aligned_bytes(c2_bytes + G * RING_DEFINES["RING"] * dec.DESC_BYTES, 0xFF)
    out = np.full((T, H), np.nan, BF16)
    bar, chunks = np.zeros(1, np.uint32), np.zeros(1, np.uint32)
    ref = reference.fused_experts(x.astype(np.float64), w1.astype(np.float64),
                                  w2.astype(np.float64), tw, ids, activation=activation)
    first = None
    for _ in range(2):                     # the counter and the barrier word come back to 0
        out[...] = np.nan
        emulated_ring.ring(*(ptr(a) for a in (x, w1, w2, tw, ids, scratch, out, bar, chunks)),
                           T, K, E, H, I, dec.ACTS[activation], G)
        assert chunks[0] == 0 and bar[0] & 0x7FFFFFFF == 0
        got = out.astype(np.float64)
        assert not np.isnan(got).any()
        assert rel_err(got, ref) <= 1e-2
        if first is not None:
            np.testing.assert_array_equal(out.view(np.uint16), first.view(np.uint16))
        first = out.copy()


# Rung 1's source on the emulator too (two warps a block, two loads a lane in flight), for
# each PAIRS instantiation, slots routed nowhere included: against the reference, and bit for
# bit against rung 2 on the same inputs (one order of sums: decode_dot.cuh).
RUNG1_ENTRY = r"""
extern "C" void rung1(const void* x, const void* w1, const void* w2, const float* tw,
                      const int* ids, void* c2, void* out, unsigned* bar, int T, int K, int E,
                      int H, int I, int act, int pairs, int grid) {
    using S = SCALAR_T;
    using Kernel = void (*)(const S*, const S*, const S*, const float*, const int*, S*, S*,
                            unsigned*, unsigned*, int, int, int, int, int);
    const Kernel kernels[3][3] = {
        {moe_decode_kernel<0, 1>, moe_decode_kernel<0, 2>, moe_decode_kernel<0, 4>},
        {moe_decode_kernel<1, 1>, moe_decode_kernel<1, 2>, moe_decode_kernel<1, 4>},
        {moe_decode_kernel<2, 1>, moe_decode_kernel<2, 2>, moe_decode_kernel<2, 4>}};
    const Kernel kernel = kernels[act][pairs == 1 ? 0 : pairs == 2 ? 1 : 2];
    launch_cooperative(grid, DEC_THREADS, 0, [&] {
        kernel((const S*)x, (const S*)w1, (const S*)w2, tw, ids, (S*)c2, (S*)out, bar, nullptr,
               T, K, E, H, I);
    });
}"""
RUNG1_DEFINES = {**dec._defines(BF16), "DEC_THREADS": 64, "U1": 2, "U2": 2, "PREFETCH": 0}

emulated_rung1 = library_fixture(dec.CU, (RUNG1_DEFINES, RUNG1_ENTRY))


def _emulated_ring_out(lib, x, w1, w2, tw, ids, activation, G):
    T, K = ids.shape
    E, H, I = w2.shape  # noqa: E741
    c2_bytes = -(-T * K * I * 2 // 256) * 256
    scratch = _aligned_bytes(c2_bytes + G * RING_DEFINES["RING"] * dec.DESC_BYTES, 0xFF)
    out = np.full((T, H), np.nan, BF16)
    bar, chunks = np.zeros(1, np.uint32), np.zeros(1, np.uint32)
    lib.ring(*(ptr(a) for a in (x, w1, w2, tw, ids, scratch, out, bar, chunks)), T, K, E, H, I,
             dec.ACTS[activation], G)
    return out


@pytest.mark.parametrize("T,E,K,H,I,activation,G,pairs,dead", [
    (1, 8, 2, 128, 64, "silu", 3, 1, False),
    (2, 8, 4, 256, 96, "gelu", 4, 2, True),      # slots routed nowhere (-1 and E + 5)
    (3, 4, 2, 136, 40, "gelu_tanh", 5, 4, False),
    (2, 4, 2, 8, 16, "silu", 10, 2, True),       # H < G: blocks with no rows of out
])
def test_emulated_rung1_matches_reference_and_rung2(emulated_rung1, emulated_ring, rng, T, E,
                                                    K, H, I, activation, G, pairs,  # noqa: E741
                                                    dead):
    x, w1, w2, tw, ids = _problem(rng, T, E, K, H, I)
    if dead:
        ids[0, 1] = -1
        ids[-1, 0] = E + 5
    scratch = _aligned_bytes(T * K * I * 2, 0xFF)
    out = np.full((T, H), np.nan, BF16)
    bar = np.zeros(1, np.uint32)
    emulated_rung1.rung1(*(ptr(a) for a in (x, w1, w2, tw, ids, scratch, out, bar)), T, K, E,
                         H, I, dec.ACTS[activation], pairs, G)
    assert bar[0] & 0x7FFFFFFF == 0
    got = out.astype(np.float64)
    assert not np.isnan(got).any()
    if dead:
        assert (got[0] != 0).any()                 # the token's live slots still count
    ref = reference.fused_experts(x.astype(np.float64), w1.astype(np.float64),
                                  w2.astype(np.float64), tw, np.where(ids >= E, -1, ids),
                                  activation=activation)
    assert rel_err(got, ref) <= 1e-2
    ring = _emulated_ring_out(emulated_ring, x, w1, w2, tw, ids, activation, G)
    np.testing.assert_array_equal(out.view(np.uint16), ring.view(np.uint16))


# ----------------------------------------------------------------------------- GPU
@pytest.fixture(params=["decode", "decode-ring"])
def rung(request, monkeypatch):
    """Each decode rung in turn, whatever the shape would take (plans made afresh)."""
    from cuda_kernels.cupy import _compile, experts

    if request.param == "decode-ring" and not _compile.is_sm90():
        pytest.skip("rung 2 needs an sm_90 card (bulk copies)")
    monkeypatch.setattr(experts, "_PLANS", {})
    monkeypatch.setitem(dec.CONFIGS, "ring", {
        **dec.CONFIGS["ring"], "MIN_BLOCK_BYTES": 0 if request.param == "decode-ring" else 1 << 60})
    return request.param


def _problem(rng, T, E, K, H, I, dtype=BF16, shared=False):  # noqa: E741
    x = rng.standard_normal((T, H)).astype(np.float32)
    w1 = (rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(np.float32)
    w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    if shared:                               # every token's first choice: expert 0
        logits[:, 0] += 100.0
    tw, ids, _ = reference.fused_topk(x, logits, K, True)
    return (x.astype(dtype), w1.astype(dtype), w2.astype(dtype), tw.astype(np.float32),
            ids.astype(np.int32))


@pytest.fixture
def max_tokens(monkeypatch):
    """Sets the decode path's MAX_TOKENS for one test (plans made afresh)."""
    from cuda_kernels.cupy import experts

    monkeypatch.setattr(experts, "_PLANS", {})

    def set_to(n):
        monkeypatch.setitem(dec.CONFIGS, "decode", {**dec.CONFIGS["decode"], "MAX_TOKENS": n})
    return set_to


def _stages(x, w1, w2, tw, ids, activation):
    from cuda_kernels import cupy as ck

    T, K = ids.shape
    s, e, n = ck.moe_align_block_size(ids, 16, w1.shape[0])
    c1 = ck.grouped_gemm(x, w1, s, e, n, K, 16, tw, False)
    c3 = ck.grouped_gemm(ck.apply_activation(c1, activation, True), w2, s, e, n, 1, 16, tw,
                         True)
    return ck.moe_sum(c3.reshape(T, K, -1), ids)


@on_gpu("cupy")
@pytest.mark.usefixtures("cupy_poison")
@pytest.mark.parametrize("T,E,K,H,I,activation,dtype,shared", [
    (1, 8, 2, 256, 512, "silu", BF16, False),
    (1, 16, 8, 512, 96, "gelu", BF16, False),          # Qwen3-like: short rows, P = 8
    (1, 4, 4, 1024, 1024, "gelu_tanh", BF16, False),
    (1, 8, 2, 264, 200, "silu", np.dtype(np.float16), False),   # H, I not multiples of 64
    (3, 8, 2, 256, 128, "silu", BF16, True),           # three tokens, all on expert 0
    (4, 32, 8, 128, 64, "silu", BF16, False),          # H < the grid: blocks with no rows
])
def test_decode_matches_reference_and_stages(T, E, K, H, I, activation, dtype,  # noqa: E741
                                             shared, rng, max_tokens, rung):
    from cuda_kernels.cupy.experts import fused_experts, plan_for

    max_tokens(4)
    host = _problem(rng, T, E, K, H, I, dtype, shared)
    x, w1, w2, tw, ids = (A.to_device(a) for a in host)
    got = A.to_host(fused_experts(x, w1, w2, tw, ids, activation))
    plan = plan_for(T, H, E, 2 * I, I, K, dtype, activation, device=x.device.id)
    assert plan.versions == (rung,)
    g = got.astype(np.float64)
    assert not np.isnan(g).any()
    ref = reference.fused_experts(*(a.astype(np.float64) for a in host[:3]), host[3], host[4],
                                  activation=activation)
    assert rel_err(g, ref) <= 1e-2
    stages = A.to_host(_stages(x, w1, w2, tw, ids, activation)).astype(np.float64)
    assert rel_err(g, stages) <= 1e-2
    again = A.to_host(fused_experts(x, w1, w2, tw, ids, activation))
    np.testing.assert_array_equal(again.view(np.uint16), got.view(np.uint16))


@on_gpu("cupy")
@pytest.mark.usefixtures("cupy_poison")
def test_decode_slots_routed_nowhere(rng, max_tokens, rung):
    """-1 and out-of-range ids add nothing; a token with no live slot is 0, not NaN (its
    rows of the reused scratch hold the last call's values, which must not leak in)."""
    from cuda_kernels.cupy.experts import fused_experts

    max_tokens(4)
    T, E, K, H, I = 3, 8, 4, 256, 128  # noqa: E741
    host = list(_problem(rng, T, E, K, H, I))
    x, w1, w2, tw, ids = (A.to_device(a) for a in host)
    fused_experts(x, w1, w2, tw, ids)                   # fills the cached scratch
    bad = host[4].copy()
    bad[1] = -1
    bad[0, 2] = E + 5
    got = A.to_host(fused_experts(x, w1, w2, tw, A.to_device(bad))).astype(np.float64)
    assert (got[1] == 0).all()
    ref = reference.fused_experts(*(a.astype(np.float64) for a in host[:3]), host[3],
                                  np.where(bad >= E, -1, bad))
    assert rel_err(got, ref) <= 1e-2


@on_gpu("cupy")
def test_decode_replays_under_a_torch_graph(rng, rung):
    torch = pytest.importorskip("torch")
    from cuda_kernels.cupy.experts import fused_experts, plan_for

    T, E, K, H, I = 1, 16, 4, 512, 256  # noqa: E741
    host = _problem(rng, T, E, K, H, I)
    tx = [torch.from_numpy(a.view(np.int16) if a.dtype == BF16 else a).cuda() for a in host]
    tx[0], tx[1], tx[2] = (t.view(torch.bfloat16) for t in tx[:3])
    assert plan_for(T, H, E, 2 * I, I, K, BF16, device=0).versions == (rung,)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_experts(*tx)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fused_experts(*tx)
    fresh = _problem(np.random.default_rng(7), T, E, K, H, I)
    tx[0].copy_(torch.from_numpy(fresh[0].view(np.int16)).cuda().view(torch.bfloat16))
    tx[3].copy_(torch.from_numpy(fresh[3]).cuda())
    tx[4].copy_(torch.from_numpy(fresh[4]).cuda())
    for _ in range(3):                              # the barrier word is ready again each time
        g.replay()
    eager = fused_experts(*tx)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
    ref = reference.fused_experts(*(a.astype(np.float64) for a in (fresh[0], host[1], host[2])),
                                  fresh[3], fresh[4])
    assert rel_err(out.float().cpu().numpy().astype(np.float64), ref) <= 1e-2


@on_gpu("cupy")
@pytest.mark.usefixtures("cupy_poison")
def test_both_rungs_give_the_same_bits(rng, monkeypatch):
    """The rungs sum each dot product in the same order (lanes' 16-byte chunks, then a warp's
    butterfly) and round where the stages do: one output, bit for bit."""
    from cuda_kernels.cupy import _compile, experts

    if not _compile.is_sm90():
        pytest.skip("rung 2 needs an sm_90 card (bulk copies)")
    T, E, K, H, I = 1, 16, 8, 1024, 768  # noqa: E741
    x, w1, w2, tw, ids = (A.to_device(a) for a in _problem(rng, T, E, K, H, I))
    outs = {}
    for name, least in (("decode", 1 << 60), ("decode-ring", 0)):
        monkeypatch.setattr(experts, "_PLANS", {})
        monkeypatch.setitem(dec.CONFIGS, "ring", {**dec.CONFIGS["ring"], "MIN_BLOCK_BYTES": least})
        outs[name] = A.to_host(experts.fused_experts(x, w1, w2, tw, ids))
        assert experts.plan_of(x, w1, w2, tw, ids).versions == (name,)
    np.testing.assert_array_equal(outs["decode"].view(np.uint16),
                                  outs["decode-ring"].view(np.uint16))
