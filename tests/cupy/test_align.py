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
from tests.oracles import assert_same_blocks, distinct_topk_ids, rng_for
from tests.support import gpu_marks

pytestmark = [*gpu_marks("cupy"), pytest.mark.usefixtures("cupy_poison")]


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


def test_align_empty_batch(align_path):
    got = check_align(np.zeros((0, 4), np.int32), 16, 8)
    assert got[0].size == 0 and int(got[2][0]) == 0


@pytest.mark.parametrize("ignore_invalid", [False, True])
@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("ep_rank", [0, 3])
def test_align_expert_map(ep_rank, placement, ignore_invalid, align_path):
    T, E, K, B = 300, 64, 6, 16
    rng = rng_for("align_map", ep_rank, placement, ignore_invalid)
    _, emap = reference.determine_expert_map(4, ep_rank, E, placement)
    check_align(distinct_topk_ids(rng, T, E, K), B, E, emap.astype(np.int32), False,
                ignore_invalid)


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
