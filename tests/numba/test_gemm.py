"""The Numba grouped GEMM ladder (cuda_kernels/numba/gemm.py: v1 naive, v2 shared-memory tiles,
v3 register blocking, v3v = v3 with 16-byte loads in CuPy v3's layout, the default) against
the reference: PTX on the CPU, the reference on a real GPU, compute-sanitizer on request.

    T tokens, E experts (E_local on this rank), K top-k, N output width, Kd inner size,
    B block size, I intermediate, H hidden

CPU (no GPU needed, not in the simulator; slow): the bf16 v3v kernels of every tile height
compile with their launch bounds, stay in registers (ptxas: no stack, no spills, where ptxas
is installed) and really use 16-byte loads (ld.global.nc.v4 for a and w, ld.shared.v4 for the
tiles).
GPU (`gpu` marker; outputs poisoned, the `numba_poison` fixture): every version against the
reference fed float64 inputs (fp32 within 1e-5, fp16 / bf16 within 1e-2) on vLLM's grid and
the nasty cases (one token, T not a multiple of the block, experts without tokens, N not a
multiple of the tile, Kd not a multiple of the 16-byte chunk: v3v falls back to v3, B = 8:
falls back to v2, expert_ids == -1 blocks, rows no block names, misaligned views, rows past
the grid bound). MOE_SANDBOX_SANITIZE=1 adds a memcheck / racecheck run of v3v.

    python -m pytest tests/numba/test_gemm.py -q              (GPU tests marked gpu)
"""
import functools
import importlib
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import reference
from cuda_kernels import numba as nb
from tests.oracles import BF16, check_gemm, gemm_problem, rel_err, rng_for, uniform
from tests.support import DTYPES, FULL_GRID, full_grid, on_gpu, runs_kernels

A = importlib.import_module("cuda_kernels.numba._arrays")
pytestmark = pytest.mark.usefixtures("numba_poison")
if runs_kernels("numba"):   # imports numba on its CUDA target: only where it runs
    G = importlib.import_module("cuda_kernels.numba.gemm")


# ============================================================================ PTX, on the CPU
def _ptx_cases():
    if A.is_simulator():
        return []
    G = importlib.import_module("cuda_kernels.numba.gemm")
    return [(label, d, sig) for label, d, sig in G.compile_cases()
            if " v3v " in label and "uint16" in label]


@pytest.mark.slow
@pytest.mark.skipif(A.is_simulator(), reason="PTX needs numba's CUDA target, not the simulator")
def test_v3v_ptx_uses_16_byte_loads_and_registers_only():
    pytest.importorskip("numba_cuda")
    _ptx = importlib.import_module("cuda_kernels.numba._ptx")
    cu = A.cuda()
    ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    cases = _ptx_cases()
    assert len(cases) == 4, [c[0] for c in cases]   # tile heights 16 (dense, sparse), 32, 64
    for label, disp, sig in cases:
        bounds = disp.targetoptions.get("launch_bounds")
        with _ptx.assume_device((9, 0)):
            ptx, _ = cu.compile_ptx(disp.py_func, tuple(sig), cc=(9, 0), launch_bounds=bounds)
        assert re.search(r"ld\.global\.nc\.v4\.u32", ptx), f"{label}: no 16-byte global loads"
        assert re.search(r"ld\.shared\.v4\.f32", ptx), f"{label}: no 16-byte shared loads"
        if os.path.exists(ptxas):
            res = _ptx.ptxas_resources(ptx, ptxas)
            assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in res, \
                f"{label}: {res}"


@functools.lru_cache(maxsize=2)
def cached_problem(*args, **kw):
    """gemm_problem, reused by the versions that run back to back on one problem."""
    return gemm_problem(*args, **kw)


def gemm_check(args, want, version):
    return check_gemm(G.grouped_gemm, args, want, version)


VERSIONS = ("v1", "v2", "v3", None)
VLLM_TIH = ((1, 128, 128), (1, 2048, 128), (33, 2048, 128), (222, 1024, 1024))


@on_gpu("numba")
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("which", ["gemm1", "gemm2"])
@pytest.mark.parametrize("dkey", full_grid(("bf16",), tuple(DTYPES)))
@pytest.mark.parametrize("top_k", [2, 6])
@pytest.mark.parametrize("E", [8, 64])
@pytest.mark.parametrize("T,I,H", VLLM_TIH)
def test_gemm_vllm_grid(T, I, H, E, top_k, dkey, which, version):  # noqa: E741
    dt = DTYPES[dkey]
    B = G.get_config(T, 2 * I, H, E, top_k, dt)["BLOCK_M"]
    if which == "gemm1":
        args, want = cached_problem(T, E, top_k, 2 * I, H, B, dt, seed=1)
    else:
        args, want = cached_problem(T, E, top_k, H, I, B, dt, seed=2, gemm2=True, mul=True)
    gemm_check(args, want, version)


GEMM_NASTY = {
    "one_token": (1, 8, 2, 256, 128, 16, {}),
    "T_not_multiple_of_block": (37, 8, 2, 192, 256, 64, {}),
    "experts_without_tokens": (3, 64, 2, 128, 128, 16, {}),
    "N200_K136": (19, 8, 3, 200, 136, 16, {}),
    "block_128": (300, 4, 2, 256, 512, 128, {}),
    "block_8_falls_back_to_v2": (30, 4, 2, 96, 72, 8, {}),
    "block_48": (50, 4, 2, 96, 72, 48, {}),
    "bias_fp32_and_weights": (25, 8, 2, 136, 264, 16, {"bias": np.float32, "mul": True}),
    "gemm2_weights": (41, 16, 4, 120, 96, 32, {"gemm2": True, "mul": True}),
    "Kd_70_element_loads": (21, 8, 2, 96, 70, 16, {"mul": True}),
}
# fp32 / fp16 run these by default (bf16 runs every case): each version, each tile height
OTHER_DTYPE_CASES = ("one_token", "T_not_multiple_of_block", "block_48", "gemm2_weights",
                     "Kd_70_element_loads")
NASTY_PARAMS = [(c, d) for c in GEMM_NASTY for d in DTYPES
                if FULL_GRID or d == "bf16" or c in OTHER_DTYPE_CASES]


@on_gpu("numba")
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case,dkey", NASTY_PARAMS)
def test_gemm_nasty(case, dkey, version):
    T, E, K, N, Kd, B, extra = GEMM_NASTY[case]
    gemm_check(*cached_problem(T, E, K, N, Kd, B, DTYPES[dkey], **extra), version)


@on_gpu("numba")
@pytest.mark.parametrize("version", VERSIONS)
def test_gemm_all_tokens_on_one_expert_and_expert_map(version):
    ids = np.full((77, 1), 5, np.int32)
    gemm_check(*gemm_problem(77, 8, 1, 192, 256, 16, np.float16, ids=ids, mul=True), version)
    _, emap = reference.determine_expert_map(2, 1, 8)
    args, want = gemm_problem(29, 8, 2, 160, 128, 16, BF16, expert_map=emap, E_local=4,
                              bias=np.float32, mul=True)
    got = gemm_check(args, want, version).astype(np.float64)
    assert (got[np.all(want == 0, axis=1)] == 0).all()
    _, emap = reference.determine_expert_map(2, 0, 8)
    args, want = gemm_problem(21, 8, 2, 128, 128, 16, np.float16, expert_map=emap, E_local=4,
                              ignore=True)
    got = G.grouped_gemm(*args, version=version).astype(np.float64)
    live = np.isfinite(want).all(axis=1)
    assert (~live).any() and np.isnan(got[~live]).all()
    assert rel_err(got[live], want[live]) <= 1e-2


@on_gpu("numba")
def test_gemm_empty_batch_and_deterministic():
    args, _ = gemm_problem(0, 8, 2, 64, 64, 16, np.float32)
    assert G.grouped_gemm(*args).shape == (0, 64)
    args, _ = gemm_problem(64, 8, 2, 256, 512, 16, BF16, mul=True)
    one, two = G.grouped_gemm(*args), G.grouped_gemm(*args)
    np.testing.assert_array_equal(one.view(np.uint16), two.view(np.uint16))


    return gemm_check, gemm_problem


# (T, E, K, N, Kd, B, extra)
V3V_SHAPES = {
    "decode_qwen3_like": (1, 128, 8, 1536, 2048, 16, {}),
    "decode_gemm2_weights": (3, 64, 8, 2048, 768, 16, {"gemm2": True, "mul": True}),
    "prefill_block_32": (200, 16, 4, 512, 1024, 32, {}),
    "prefill_block_64": (300, 8, 2, 640, 512, 64, {"bias": np.float32, "mul": True}),
    "one_token": (1, 8, 2, 256, 128, 16, {}),
    "T_not_multiple_of_block": (37, 8, 2, 192, 256, 64, {}),
    "experts_without_tokens": (3, 64, 2, 128, 128, 16, {}),
    "N200_K136": (19, 8, 3, 200, 136, 16, {}),
    "block_48": (50, 4, 2, 96, 72, 48, {}),
    "block_128": (300, 4, 2, 256, 512, 128, {}),
    "Kd_70_falls_back_to_v3": (21, 8, 2, 96, 70, 16, {"mul": True}),
    "block_8_falls_back_to_v2": (30, 4, 2, 96, 72, 8, {}),
}
V3V_PARAMS = [(c, d) for c in V3V_SHAPES for d in DTYPES
              if d == "bf16" or c in ("decode_gemm2_weights", "prefill_block_64", "N200_K136",
                                      "Kd_70_falls_back_to_v3")]


@pytest.mark.parametrize("case,dkey", V3V_PARAMS)
@on_gpu("numba")
def test_v3v_matches_reference(case, dkey):
    T, E, K, N, Kd, B, extra = V3V_SHAPES[case]
    gemm_check(*gemm_problem(T, E, K, N, Kd, B, DTYPES[dkey], seed=5, **extra), "v3v")


@on_gpu("numba")
def test_v3v_expert_map_and_rows_no_block_names():
    _, emap = reference.determine_expert_map(2, 1, 8)
    args, want = gemm_problem(29, 8, 2, 160, 128, 16, BF16, expert_map=emap, E_local=4,
                              bias=np.float32, mul=True)
    got = gemm_check(args, want, "v3v").astype(np.float64)
    assert (got[np.all(want == 0, axis=1)] == 0).all()
    _, emap = reference.determine_expert_map(2, 0, 8)
    args, want = gemm_problem(21, 8, 2, 128, 128, 16, np.float16, expert_map=emap, E_local=4,
                              ignore=True)
    got = G.grouped_gemm(*args, version="v3v").astype(np.float64)
    live = np.isfinite(want).all(axis=1)
    assert (~live).any() and np.isnan(got[~live]).all()
    assert rel_err(got[live], want[live]) <= 1e-2


@on_gpu("numba")
def test_v3v_misaligned_views_fall_back():
    """A view starting 2 bytes into a row is not 16-byte aligned: v3v must not read it in
    chunks (the call runs v3's element loads instead) and still match."""
    args, want = gemm_problem(9, 8, 2, 64, 128, 16, np.float16, seed=3)
    a, w = args[0], args[1]
    wd = nb.to_device(w)
    assert G._vec_kind(nb.to_device(a), wd, 128) == "f16"
    big = nb.to_device(np.concatenate([np.zeros(1, a.dtype), a.ravel()]))
    shifted = big[1:1 + a.size].reshape(a.shape)              # 2 bytes past an aligned base
    assert G._vec_kind(shifted, wd, 128) == ""
    got = G.grouped_gemm(shifted, *args[1:], version="v3v")
    assert rel_err(nb.to_host(got), want) <= 1e-2


@on_gpu("numba")
def test_v3v_rows_past_the_grid_bound():
    """The grid covers min(capacity, P * B) rows; an alignment made for more slots than a's
    rows * top_k puts live rows past that (the row-tile loop must reach them)."""
    rng = rng_for("gemm-v3v-bound-gpu")
    ids = np.array([[3, 2], [0, 1], [0, 1]], np.int32)     # slots 0, 1 last in the order
    align = reference.moe_align_block_size(ids, 16, 4)
    assert int(align[2][0]) > 2 * 16
    a = uniform(rng, (1, 64), 1.0, BF16)
    w = uniform(rng, (4, 96, 64), 0.2, BF16)
    want = reference.grouped_gemm(a.astype(np.float64), w.astype(np.float64), *align, 2, 16)
    got = G.grouped_gemm(a, w, *align, 2, 16, version="v3v")
    assert rel_err(got, want) <= 1e-2


SANITIZE = """
import importlib
import numpy as np
from tests.oracles import BF16, check_gemm, gemm_problem
G = importlib.import_module("cuda_kernels.numba.gemm")
for T, E, K, N, Kd, B, dt, extra in [(5, 8, 2, 72, 48, 16, BF16, {}),
                                     (40, 4, 2, 64, 64, 32, np.float32, {"mul": True}),
                                     (70, 4, 2, 136, 40, 64, np.float16, {"bias": np.float32})]:
    check_gemm(G.grouped_gemm, *gemm_problem(T, E, K, N, Kd, B, dt, **extra), "v3v")
print("v3v sanitize cases match")
"""


@on_gpu("numba")
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MOE_SANDBOX_SANITIZE") != "1",
                    reason="compute-sanitizer runs take a while: set MOE_SANDBOX_SANITIZE=1")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_v3v_compute_sanitizer_clean(tool):
    path = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(path):
        pytest.skip("compute-sanitizer not found")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [path, "--tool", tool, "--error-exitcode", "9", sys.executable, "-c", SANITIZE]
    r = subprocess.run(cmd, check=False, cwd=root, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == 0, (r.stdout[-4000:] + r.stderr[-4000:])
    assert "v3v sanitize cases match" in r.stdout
