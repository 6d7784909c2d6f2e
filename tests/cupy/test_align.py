"""CuPy alignment (cuda_kernels/cupy/align.py, align.cu) against the NumPy reference, on the GPU.

    T tokens, E experts, K top-k, B block size, P = T*K slots

Every test here is `gpu` and skips cleanly without a usable device (availability() says
why). Outputs are poisoned before every launch (the `cupy_poison` fixture: NaN for floats,
-123456789 for ints), so an element a kernel forgets to write fails the comparison.

Integer outputs exact, on both of the kernel's paths (one block up to SMALL_P slots, a
cooperative grid above; the vLLM grid crosses the threshold, the nasty cases force each, the
grid one with tiny blocks so that even small cases span many blocks). The contract only fixes
the *set* of slots per block (assert_same_blocks); this kernel is stable (increasing s inside
an expert, like the reference), so the order is checked exactly too, in a separate assertion.
"""
from __future__ import annotations

import numpy as np
import pytest

import reference
from cuda_kernels.cupy import align as ck_align
from cuda_kernels.cupy import to_device as dev
from cuda_kernels.cupy import to_host as host
from tests.emulator import library_fixture, ptr
from tests.oracles import assert_same_blocks, distinct_topk_ids, rng_for
from tests.support import on_gpu

pytestmark = pytest.mark.usefixtures("cupy_poison")


def check_align(topk_ids, B, E, expert_map=None, pad=False, ignore_invalid=False):
    got = ck_align.moe_align_block_size(dev(topk_ids), B, E,
                                       None if expert_map is None else dev(expert_map),
                                       pad, ignore_invalid)
    want = reference.moe_align_block_size(topk_ids, B, E, expert_map, pad, ignore_invalid)
    got = tuple(host(x) for x in got)
    for g, w, name in zip(got, want, ("sorted_token_ids", "expert_ids", "num_tokens_post_padded")):
        assert g.dtype == np.int32, f"{name}: dtype {g.dtype}"
        assert g.shape == w.shape, f"{name}: shape {g.shape} != reference {w.shape}"
    assert_same_blocks(got, want, B, topk_ids.size)                     # the contract
    np.testing.assert_array_equal(got[0], want[0],                      # this kernel: stable
                                  err_msg="sorted_token_ids order (the kernel is stable)")
    return got


@on_gpu("cupy")
@pytest.mark.parametrize("B", [32, 128])
@pytest.mark.parametrize("K", [1, 2, 16, 32])
@pytest.mark.parametrize("E", [32, 160, 256, 257])
@pytest.mark.parametrize("T", [1, 3, 256, 2256, 4096])
def test_align_vllm_grid(T, E, K, B):
    rng = rng_for("align", T, E, K, B)
    check_align(distinct_topk_ids(rng, T, E, K), B, E)


@pytest.fixture(params=["one_block", "grid"])
def align_path(request, monkeypatch):
    """Both alignment paths: one block (P <= SMALL_P) and the cooperative grid (forced, with
    blocks of 2 warps of 32 slots: a 1000-slot case spans 16 blocks, E1024 hits the SM cap)."""
    if request.param == "grid":
        monkeypatch.setitem(ck_align.CONFIGS["align"], "SMALL_P", 0)
        monkeypatch.setitem(ck_align.CONFIGS["align"], "WARP_SLOTS", 32)
        monkeypatch.setitem(ck_align.CONFIGS["align"], "TABLE_LOADS", 1 << 20)  # no table cap
        monkeypatch.setitem(ck_align.CONFIGS["group"], "MAX_WARPS", 2)
    return request.param


@on_gpu("cupy")
@pytest.mark.parametrize("case", ["one_token", "all_on_one_expert", "empty_experts",
                                  "one_expert_per_block", "E1024", "not_pow2", "B1", "pad"])
def test_align_nasty(case, align_path):
    rng = rng_for("align_nasty", case)
    B, pad = 16, False
    if case == "one_token":
        E, ids = 8, np.array([[5, 2]], np.int32)
    elif case == "all_on_one_expert":
        E, ids = 64, np.full((1000, 1), 37, np.int32)
    elif case == "empty_experts":  # only 3 of 257 experts used, T not a multiple of B
        E, ids = 257, rng.choice(np.array([0, 100, 256], np.int32), size=(333, 2))
    elif case == "one_expert_per_block":
        E, ids, B = 128, distinct_topk_ids(rng, 7, 128, 4), 1
    elif case == "E1024":
        E, ids, B = 1024, distinct_topk_ids(rng, 1500, 1024, 8), 64
    elif case == "not_pow2":
        E, ids, B = 100, distinct_topk_ids(rng, 777, 100, 6), 24
    elif case == "B1":
        E, ids, B = 16, distinct_topk_ids(rng, 99, 16, 3), 1
    else:
        E, ids, pad = 40, distinct_topk_ids(rng, 50, 40, 3), True
    check_align(ids, B, E, pad=pad)


@on_gpu("cupy")
def test_align_empty_batch(align_path):
    got = check_align(np.zeros((0, 4), np.int32), 16, 8)
    assert got[0].size == 0 and int(got[2][0]) == 0


@on_gpu("cupy")
@pytest.mark.parametrize("ignore_invalid", [False, True])
@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("ep_rank", [0, 3])
def test_align_expert_map(ep_rank, placement, ignore_invalid, align_path):
    T, E, K, B = 300, 64, 6, 16
    rng = rng_for("align_map", ep_rank, placement, ignore_invalid)
    _, emap = reference.determine_expert_map(4, ep_rank, E, placement)
    check_align(distinct_topk_ids(rng, T, E, K), B, E, emap.astype(np.int32), False,
                ignore_invalid)


@on_gpu("cupy")
@pytest.mark.parametrize("ignore_invalid", [False, True])
def test_align_skips_ids_outside_the_experts(ignore_invalid, align_path):
    """vLLM's -1 (a masked or padded token, another rank's expert) and ids past E: placed
    nowhere, counted nowhere."""
    T, E, K, B = 300, 64, 6, 16
    ids = distinct_topk_ids(rng_for("align_skip"), T, E, K)
    ids[::7] = -1
    ids[3, 2] = E + 5
    check_align(ids, B, E)
    _, emap = reference.determine_expert_map(4, 1, E)
    check_align(ids, B, E, emap.astype(np.int32), False, ignore_invalid)


@on_gpu("cupy")
def test_align_int64_ids_and_bad_inputs():
    ids = distinct_topk_ids(rng_for("i64"), 30, 16, 2)
    got = ck_align.moe_align_block_size(dev(ids.astype(np.int64)), 8, 16)
    want = reference.moe_align_block_size(ids, 8, 16)
    np.testing.assert_array_equal(host(got[0]), want[0])
    with pytest.raises(TypeError, match="topk_ids"):
        ck_align.moe_align_block_size(dev(np.ones((3, 2), np.float32)), 8, 16)
    with pytest.raises(TypeError, match="topk_ids"):
        ck_align.moe_align_block_size(ids, 8, 16)
    with pytest.raises(ValueError, match="block_size"):
        ck_align.moe_align_block_size(dev(ids), 0, 16)
    with pytest.raises(ValueError, match="expert_map"):
        ck_align.moe_align_block_size(dev(ids), 8, 16, dev(np.zeros(15, np.int32)))
    with pytest.raises(ValueError, match="topk_ids"):
        ck_align.moe_align_block_size(dev(np.ones((4, 8), np.int32))[:, ::2], 8, 16)


# ============================================================================ CPU: the emulator
# The kernel source on the CPU emulator of tests/emulator (g++, a std::thread per CUDA thread,
# tiny tunables), against the reference: the kernel's logic without a GPU (not the GPU's
# expf / erff ulps, timing or memory ordering: the GPU tests above stay the judge).
ENTRY = r"""
extern "C" void align(const int* ids, const int* emap, int* sorted, int* eids, int* npost, int* hist,
                      unsigned* bar, int P, int E, int B, int n, int nb, int ign, int grid,
                      int threads, int smem) {
    auto body = [&] { moe_align_kernel(ids, emap, sorted, eids, npost, hist, bar, P, E, B, n, nb,
                                       ign); };
    if (grid == 1) launch(1, threads, smem, body);
    else launch_cooperative(grid, threads, smem, body);
}"""
DEFINES = {"PREFETCH": 2}


emulated = library_fixture("align.cu", (DEFINES, ENTRY))


@pytest.mark.simulator
def test_emulated_align(emulated):
    lib_align = emulated
    rng = np.random.default_rng(7)

    bar = np.zeros(1, np.uint32)  # the grid barrier's word, kept across launches as on the GPU

    def align(ids, B, E, emap=None, pad=False, ign=False, large=False):
        P = ids.size
        n = reference.max_num_tokens_padded(P, B, E, pad)
        out = (np.full(n, -7, np.int32), np.full(-(-n // B), -7, np.int32), np.full(1, -7, np.int32))
        G, W, smem = ck_align._align_geometry(P, E, 1)  # one block
        if large:  # a cooperative grid of small blocks: 5 blocks of 2 warps (one round of
            # 32-slot steps per warp), or 3 blocks of 1 warp (several rounds per warp)
            G, W = (5, 2) if large == 1 else (3, 1)
            smem = (W * E + 2 * E + 33) * 4
        hist = np.full(G * E, -7, np.int32)
        lib_align.align(ptr(ids), ptr(emap), *map(ptr, out), ptr(hist), ptr(bar), P, E, B, n,
                        out[1].size, int(ign), G, W * 32, smem)
        assert bar[0] & 0x7FFFFFFF == 0, "the barrier word's low bits come back to 0"
        return out

    cases = [(1, 8, 2, 4, None, False, False), (3, 32, 2, 32, None, False, False),
             (33, 16, 3, 8, None, True, False), (100, 257, 6, 16, None, False, False),
             (0, 8, 2, 4, None, False, False), (50, 5, 1, 1, None, False, False),
             (40, 1024, 8, 16, None, False, False)]
    for placement in ("linear", "round_robin"):
        emap = reference.determine_expert_map(4, 1, 32, placement)[1].astype(np.int32)
        cases += [(60, 32, 4, 8, emap, False, ign) for ign in (False, True)]
    for T, E, K, B, emap, pad, ign in cases:
        ids = distinct_topk_ids(rng, T, E, K)
        want = reference.moe_align_block_size(ids, B, E, emap, pad, ign)
        for large in (0, 1, 2):
            got = align(ids, B, E, emap, pad, ign, large)
            for g, w, name in zip(got, want, ("sorted_token_ids", "expert_ids", "num_post")):
                np.testing.assert_array_equal(
                    g, w, err_msg=f"{name} T={T} E={E} K={K} B={B} grid variant {large}")
    # slots routed nowhere (vLLM's -1) and ids past E: skipped, with and without a map
    ids = distinct_topk_ids(rng, 40, 16, 3)
    ids[3], ids[7, 1], ids[9, 0] = -1, -1, 19
    emap = reference.determine_expert_map(2, 1, 16)[1].astype(np.int32)
    for m, ign in ((None, False), (emap, False), (emap, True)):
        want = reference.moe_align_block_size(ids, 4, 16, m, False, ign)
        for large in (0, 1, 2):
            for g, w in zip(align(ids, 4, 16, m, False, ign, large), want):
                np.testing.assert_array_equal(g, w, err_msg=f"-1 ids, map {m is not None}")
    one = np.full((70, 1), 3, np.int32)  # every slot on one expert
    for large in (0, 1, 2):
        for g, w in zip(align(one, 16, 8, large=large), reference.moe_align_block_size(one, 16, 8)):
            np.testing.assert_array_equal(g, w)
