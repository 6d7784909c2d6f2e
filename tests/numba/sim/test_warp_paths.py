"""The kernels' GPU-only warp paths, run in the simulator through emulated warp intrinsics.

    routing "warp" flavour     one warp per token row, reductions by shfl_xor_sync
    alignment "warp" ranks     ranks within a round by match_any_sync + per-warp counts
    alignment "grid"           align.py's one-launch kernel (the GPU default), one block

warp_emulation.py gives the simulator's fake `cuda` module shfl_xor_sync, match_any_sync,
lanemask_lt and syncwarp (the lanes of a warp meet at a barrier). The results must equal
the reference exactly, as the shared-memory paths' do; the GPU tests run the same paths
compiled (tests/numba/test_routing.py, test_align.py).
"""
import importlib

import numpy as np
import pytest
from tests.oracles import BF16, distinct_topk_ids, rel_err, rng_for, uniform
from tests.numba.sim.warp_emulation import emulated_warps

import reference
from cuda_kernels import numba as nb

R = importlib.import_module("cuda_kernels.numba.routing")
Rk = importlib.import_module("cuda_kernels.numba.routing_kernels")
Al = importlib.import_module("cuda_kernels.numba.align")
Ag = importlib.import_module("cuda_kernels.numba.align_grid")
Pm = importlib.import_module("cuda_kernels.numba.permute")
A = importlib.import_module("cuda_kernels.numba._arrays")

pytestmark = pytest.mark.simulator


@pytest.fixture
def warps(monkeypatch):
    # the factories refuse warp paths in the simulator; here the intrinsics exist
    for module in (R, Rk, Al, Pm):
        monkeypatch.setattr(module, "SIMULATOR", False)
    monkeypatch.setitem(R.CONFIGS, "warp", {"WARPS_PER_BLOCK": 2})
    with nb.poisoned_outputs(), emulated_warps():
        yield


def test_routing_warp_flavour(warps):
    x = uniform(rng_for("warp-route"), (3, 40), 2.0)
    x[2, 7] = np.nan
    got = R._launch(A.Call("gating_output", x), x, None, 3, 1, 1, "softmax", True, 1.0, True,
                    np.dtype(np.int32), flavor="warp")
    want = reference.fused_topk(None, x, 3, True)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_array_equal(got[0][2], 0)           # the NaN row: weights 0
    assert rel_err(got[0], want[0]) <= 1e-5
    bias = uniform(rng_for("warp-bias"), (40,), 0.3)
    got = R._launch(A.Call("gating_output", x), x, bias, 4, 4, 2, "sigmoid", True, 2.5, False,
                    np.dtype(np.int32), flavor="warp", mode=R.MODE_GROUPED)
    want = reference.grouped_topk(None, x, 4, True, 4, 2, "sigmoid", 2.5, bias)
    np.testing.assert_array_equal(got[1], want[1])
    assert rel_err(got[0], want[0]) <= 1e-5
    xb = x.astype(np.float32).astype(BF16)
    xb[1] = np.nan                                        # no valid expert: 1/K
    got = R._launch(A.Call("gating_output", xb), xb, None, 5, 8, 3, "softmax", True, 1.5, False,
                    np.dtype(np.int32), flavor="warp", mode=R.MODE_GROUPED)
    want = reference.grouped_topk(None, xb, 5, True, 8, 3, "softmax", 1.5)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0][1], np.float32(1 / 5))
    assert rel_err(got[0], want[0]) <= 1e-5


@pytest.mark.parametrize("path", ["single", "multi"])
def test_align_warp_ranks(warps, monkeypatch, path):
    monkeypatch.setitem(Al.SIM_CONFIGS, "align", {"THREADS": 64, "SLOTS_PER_BLOCK": 64,
                                                  "SINGLE_BLOCK_MAX_SLOTS": 64,
                                                  "RANK": "warp"})
    E, B = 6, 4
    ids = distinct_topk_ids(rng_for("warp-align", path), 45, E, 2)   # P = 90: two blocks
    _, emap = reference.determine_expert_map(2, 1, E)
    variants = ((None, False), (emap, False)) if path == "single" else ((emap, True),)
    for expert_map, ignore in variants:
        call = A.Call("topk_ids", ids)
        cap = Al.max_num_tokens_padded(ids.size, B, E)
        out = Al._sort_slots(call, ids, E, B, expert_map, ignore, cap, True, False, path=path,
                             rank="warp")
        got = tuple(call.result(v) for v in out[:3])
        want = reference.moe_align_block_size(ids, B, E, expert_map, False, ignore)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    if path == "multi":
        x = uniform(rng_for("warp-perm"), (45, 3), 1.0)
        got = Pm.moe_permute(x, ids, E)   # the config's RANK ("warp"), the multi-block path
        for g, w in zip(got, reference.moe_permute(x, ids, E)):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("case", ["softmax", "sigmoid_bias", "grouped_bias",
                                  "grouped_softmax_nan", "grouped_bf16_none_valid"])
def test_routing_keys_flavour(warps, monkeypatch, case):
    """routing.cu's 64-bit-key selection ("keys", the GPU default) in emulated warps."""
    monkeypatch.setitem(R.CONFIGS, "keys", {"WARPS_PER_BLOCK": 2})
    x = uniform(rng_for("keys-route", case), (3, 40), 2.0)
    x[2, 7] = np.nan
    bias = uniform(rng_for("keys-bias"), (40,), 0.3)
    call = A.Call("gating_output", x)
    if case == "softmax":
        got = R._launch(call, x, None, 3, 1, 1, "softmax", True, 1.0, True,
                        np.dtype(np.int32), flavor="keys")
        want = reference.fused_topk(None, x, 3, True)
        np.testing.assert_array_equal(got[2], want[2])
    elif case == "sigmoid_bias":
        got = R._launch(call, x, bias, 3, 1, 1, "sigmoid", True, 2.5, False,
                        np.dtype(np.int32), flavor="keys")
        want = reference.fused_topk_bias(None, x, "sigmoid", bias, 3, True,
                                         routed_scaling_factor=2.5)
    elif case == "grouped_bias":
        x[1, :10] = -np.inf
        got = R._launch(call, x, bias, 4, 4, 2, "sigmoid", True, 2.5, False,
                        np.dtype(np.int32), flavor="keys", mode=R.MODE_GROUPED)
        want = reference.grouped_topk(None, x, 4, True, 4, 2, "sigmoid", 2.5, bias)
    elif case == "grouped_softmax_nan":
        got = R._launch(call, x, None, 5, 8, 3, "softmax", False, 1.5, False,
                        np.dtype(np.int32), flavor="keys", mode=R.MODE_GROUPED)
        want = reference.grouped_topk(None, x, 5, False, 8, 3, "softmax", 1.5)
    else:
        x = x.astype(BF16)
        x[0] = np.nan
        call = A.Call("gating_output", x)
        got = R._launch(call, x, None, 5, 8, 3, "softmax", True, 1.5, False,
                        np.dtype(np.int32), flavor="keys", mode=R.MODE_GROUPED)
        want = reference.grouped_topk(None, x, 5, True, 8, 3, "softmax", 1.5)
        np.testing.assert_array_equal(got[0][0], np.float32(1 / 5))
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(np.isnan(got[0]), np.isnan(want[0]))
    ok = ~np.isnan(want[0]).any(axis=1)
    assert rel_err(got[0][ok], want[0][ok]) <= 1e-5


def test_align_grid(warps, monkeypatch):
    """align_grid.py's one-launch alignment ("grid": align.cu's moe_align_kernel) in emulated
    warps, one block of two warps (the simulator runs blocks one after another, so the grid
    barrier of G > 1 cannot run here: tests/numba/test_align.py covers it)."""
    monkeypatch.setitem(Ag.CONFIGS, "grid", dict(Ag.CONFIGS["grid"], MAX_WARPS=2, MIN_WARPS=1))
    monkeypatch.setitem(Al.SIM_CONFIGS, "align", dict(Al.SIM_CONFIGS["align"], RANK="grid"))
    E, B = 6, 4
    ids = distinct_topk_ids(rng_for("grid-align"), 45, E, 2)   # P = 90: warps of 64 and 26
    ids[3] = [5, 4]
    _, emap = reference.determine_expert_map(2, 1, E)
    for expert_map, ignore, pad in ((None, False, False), (emap, True, True)):
        call = A.Call("topk_ids", ids)
        cap = Al.max_num_tokens_padded(ids.size, B, E, pad)
        out = Al._sort_slots(call, ids, E, B, expert_map, ignore, cap, True, False)
        got = tuple(call.result(v) for v in out[:3])
        want = reference.moe_align_block_size(ids, B, E, expert_map, pad, ignore)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    x = uniform(rng_for("grid-perm"), (45, 3), 1.0)
    got = Pm.moe_permute(x, ids, E)
    for g, w in zip(got, reference.moe_permute(x, ids, E)):
        np.testing.assert_array_equal(g, w)
