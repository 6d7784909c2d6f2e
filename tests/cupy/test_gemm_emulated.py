"""The grouped GEMM ladder's kernels (cuda_kernels/cupy/gemm_v*.cu) on the CPU emulator of
tests/emulator, and the launcher (gemm.grouped_gemm) driving them.

    T tokens, E experts (E_local on this rank), K top-k, N output width, Kdim reduction width,
    B block size, P = T*K slots

The .cu text (exactly what NVRTC compiles) is built by g++ with the emulator and
tests/emulator/grouped_gemm_main.cpp, and run in a process of its own (a broken rule or a
deadlock ends it with "EMULATOR: ..."). The emulator runs one OS thread per CUDA thread and
does the PTX of v4-v6 in software: cp.async landing as late as the hardware may, ldmatrix and
mma.sync from all 32 lanes' fragments, wgmma deferred to the wait that completes it, v6's
mbarrier ring and tensor copies with its protocol checked as it runs (a missing wait on either
barrier fails, whatever the timing). This checks the index math, the pipelines' slot rotation
and wait counts, the fragment layouts and the epilogue on a CPU: against the reference fed
float64 inputs (fp32 <= 1e-5, fp16 / bf16 <= 1e-2), outputs poisoned with NaN, canaries
around c. Timing, real memory ordering and races need the GPU (compute-sanitizer runs there).
"""
from __future__ import annotations

import functools
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from cuda_kernels.cupy import _compile as C
from cuda_kernels.cupy import gemm as gg
from cuda_kernels.cupy import gemm_configs as gcfg
from cuda_kernels.cupy import gemm_tensor_map as gtmap
from tests.cupy.fake_cupy import FakeArray, launcher_cupy
from tests.emulator import build_program, needs_gxx
from tests.oracles import BF16, TOL, gemm_case, ids_with_runs, rel_err
from tests.support import DTYPES


EMU_FLAGS: list = []     # more g++ flags (-DEMU_WAIT_S=10: a shorter deadlock timeout)

# the arguments a kernel takes after GG_KERNEL_ARGS, as the emulator's main passes them
EMU_EXTRA_ARGS = {"gemm_v6_tma_ws.cu": ", emu_tmap()"}


@functools.lru_cache(maxsize=None)
def _emu_binary(cu, kernel_name, define_items):
    """g++ build of one kernel instantiation under the emulator (cached per process)."""
    extra = EMU_EXTRA_ARGS.get(cu)
    main = (f"#define GG_KERNEL_NAME {kernel_name}\n"
            + (f"#define GG_EMU_EXTRA_ARGS {extra}\n" if extra else "")
            + '#include "grouped_gemm_main.cpp"')
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="gg_emu_"))
    return build_program(tmp, cu, dict(define_items), main, "k", EMU_FLAGS)


def _emu_launch(exe, grid, block, smem, args, order_seed=0):
    """Run the emulated kernel with the launcher's exact argument tuple; c (args[2]) and the
    extra arrays after the common 16 arguments (v6's tensor map) are updated in place, as a
    GPU launch leaves them (rows the kernel does not write keep their bytes). Arrays are NumPy
    (or NumPy-backed) arrays, sizes are NumPy ints. order_seed != 0 runs the CTAs in a
    shuffled order (x fastest, then y, then z otherwise)."""
    arrays = [np.ascontiguousarray(args[i]) for i in (0, 1, 3, 4, 5, 6, 7)]
    c = args[2]
    extra = list(args[16:])
    x_arrays = [x for x in extra if isinstance(x, np.ndarray) and x.ndim > 0]
    x_ints = [int(x) for x in extra if not (isinstance(x, np.ndarray) and x.ndim > 0)]
    assert len(x_arrays) <= 2 and len(x_ints) <= 2, "the emulator passes 2 arrays, 2 ints"
    gx, gy, gz = (tuple(grid) + (1, 1))[:3]
    bx, by = (tuple(block) + (1,))[:2]
    xa = x_arrays + [None] * (2 - len(x_arrays))
    head = np.array([int(args[i]) for i in range(8, 16)] + [gx, gy, bx, by, smem]
                    + [x.nbytes for x in arrays] + [c.nbytes, gz, order_seed, len(x_arrays)]
                    + [0 if x is None else x.nbytes for x in xa]
                    + (x_ints + [0, 0])[:2] + [0, 0, 0, 0], dtype=np.int64)
    assert head.size == 32
    with tempfile.TemporaryDirectory() as d:
        inp, outp = pathlib.Path(d) / "in.bin", pathlib.Path(d) / "out.bin"
        with open(inp, "wb") as f:
            f.write(head.tobytes())
            for x in arrays:
                f.write(x.tobytes())
            f.write(np.ascontiguousarray(c).tobytes())
            for x in x_arrays:
                f.write(np.ascontiguousarray(x).tobytes())
        res = subprocess.run([str(exe), str(inp), str(outp)], capture_output=True, text=True,
                             timeout=900)
        assert res.returncode == 0, f"emulator exit {res.returncode}: {res.stderr[-2000:]}"
        out = np.fromfile(outp, dtype=np.uint8)
    np.asarray(c).reshape(-1).view(np.uint8)[...] = out[:c.nbytes]
    at = c.nbytes
    for x in x_arrays:
        np.asarray(x).reshape(-1).view(np.uint8)[...] = out[at:at + x.nbytes]
        at += x.nbytes


def _emu_tensor_map(fields):
    """v6's tensor map as the emulator takes it (tests/emulator/ptx.h's tensor copy): the words of
    gemm_tensor_map.v6_tensor_map_fields, which the launcher hands to cuTensorMapEncodeTiled."""
    assert fields["rank"] == 3 and fields["element_strides"] == (1, 1, 1)
    return np.array([*fields["dims"], *fields["strides"], *fields["box"], fields["elem_bytes"],
                     fields["swizzle_bytes"]], dtype=np.int64)


EMU_SMS = 3     # v6's persistent grid in the emulator: few CTAs, each walking many tiles


def _emulate(prob, version, cfg, num_sms=EMU_SMS):
    """Run one instantiation on the CPU on `prob` (as built by _problem); return c [P, N]."""
    dkey = gcfg.dtype_key(prob["dtype"])
    fitted = gcfg.fit_config(version, dkey, cfg, prob["B"])
    defines = gcfg.kernel_defines(version, dkey, fitted)
    exe = _emu_binary(gg.CU_FILES[version], gg.KERNEL_NAMES[version],
                      tuple(sorted(defines.items())))
    P, N, K = prob["P"], prob["N"], prob["a"].shape[1]
    grid, block, smem = gcfg.launch_geometry(version, fitted, prob["st"].size, N, num_sms)
    extra = ()
    if version == "v6":
        extra = (_emu_tensor_map(gtmap.v6_tensor_map_fields(prob["w"].shape, dkey, fitted)),)
    bias = prob["bias"]
    bias_kind = 0 if bias is None else (1 if bias.dtype == prob["dtype"] else 2)
    bias_arr = np.zeros(1, np.float32) if bias is None else \
        (bias if bias_kind == 1 else bias.astype(np.float32))
    c = np.full((P, N), np.nan, dtype=prob["dtype"])
    args = (prob["a"], prob["w"], c, prob["st"].astype(np.int32), prob["ex"].astype(np.int32),
            np.asarray(prob["nt"], np.int32).ravel()[:1], prob["tw"].astype(np.float32), bias_arr,
            np.int32(N), np.int32(K), np.int32(P), np.int32(prob["top_k"]), np.int32(prob["B"]),
            np.int32(prob["st"].size), np.int32(prob["mul"]), np.int32(bias_kind)) + extra
    _emu_launch(exe, grid, block, smem, args)
    return c


def _host_problem(T, E, top_k, N, K, dtype, B, **kw):
    """The problem as host arrays (the emulator reads them)."""
    return gemm_case(T, E, top_k, N, K, B, dtype, **kw)


EMU_CASES = {
    # name: (version, dtype, config, problem args, problem kwargs)
    "v4_decode_tile_bf16": ("v4", "bf16", dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, warps=4,
                                               stages=4),
                            (7, 4, 2, 72, 136, 16), dict(mul=True, bias="same")),
    "v4_2x2_warps_fp16": ("v4", "fp16", dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, warps=4, stages=3),
                          (45, 4, 2, 136, 200, 64), dict(mul=True, bias=np.float32)),
    "v4_tiles_per_block_ep": ("v4", "bf16", dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, warps=2,
                                                 stages=2),
                              (21, 8, 2, 40, 72, 32), dict(expert_map=True, mul=True)),
    "v4_gemm2_N_ragged": ("v4", "bf16", dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, warps=4, stages=5),
                          (19, 4, 2, 100, 64, 32), dict(gemm2=True, mul=True)),
    "v5_one_warpgroup_bf16": ("v5", "bf16", dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, warps=4,
                                                 stages=3),
                              (21, 4, 2, 72, 136, 64), dict(mul=True, bias="same")),
    "v5_two_warpgroups_fp16_ep": ("v5", "fp16", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                                                     warps=8, stages=4),
                                  (45, 8, 2, 136, 200, 128), dict(expert_map=True, mul=True,
                                                                  bias=np.float32)),
    # more m-tiles than GROUP_M (8): the grouped launch order wraps into a second group
    "v4_grouped_order": ("v4", "fp16", dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, warps=2, stages=2),
                         (100, 2, 2, 72, 64, 16), dict(mul=True)),
    "v5_grouped_order": ("v5", "bf16", dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, warps=4,
                                            stages=3),
                         (300, 2, 2, 72, 32, 64), {}),
    # the three swizzle widths (BLOCK_K 16/32/64 -> 32/64/128-byte rows) at the heuristic's
    # deep rings: more k tiles than stages, a Kdim tail, ragged N
    "v5_swizzle32_bk16": ("v5", "bf16", dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=16, warps=4,
                                             stages=5),
                          (23, 4, 2, 72, 136, 64), dict(mul=True)),
    "v5_swizzle64_n256_8_stages": ("v5", "bf16", dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=32,
                                                      warps=8, stages=8),
                                   (70, 2, 2, 264, 328, 128), dict(mul=True, bias="same")),
    "v5_swizzle64_n128_8_stages_gemm2": ("v5", "fp16", dict(BLOCK_M=64, BLOCK_N=128,
                                                            BLOCK_K=32, warps=4, stages=8),
                                         (31, 4, 2, 200, 296, 64), dict(gemm2=True, mul=True)),
    "v5_swizzle128_6_stages": ("v5", "bf16", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                                                  warps=8, stages=6),
                               (60, 2, 2, 136, 456, 128), dict(bias=np.float32)),
    # about 60 rows an expert in 128-row tiles: the second warpgroup's 64 rows all padding in
    # some tiles and not in others (the GPU twin: test_gemm.py's half_padded_tiles)
    "v5_half_padded_tiles": ("v5", "bf16", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, warps=8,
                                                stages=4),
                             (120, 4, 2, 264, 328, 128), dict(mul=True, bias=np.float32)),
    # v6 (TMA + cp.async, mbarrier ring, warp-specialized, persistent over EMU_SMS = 3 CTAs),
    # its ring protocol checked as it runs (tests/emulator/ptx.h): one consumer (BLOCK_M 64), two
    # consumers over 128 rows, two splitting 256 columns of 64 rows; the nasty shapes
    "v6_one_token": ("v6", "bf16", dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, warps=8, stages=3,
                                        GROUP_M=8, PRODUCER_REGS=56),
                     (1, 4, 2, 72, 136, 64), dict(mul=True, bias="same")),
    "v6_ragged_expert_map_fp16": ("v6", "fp16", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                                                     warps=12, stages=3, GROUP_M=8,
                                                     PRODUCER_REGS=56),
                                  (45, 8, 2, 200, 200, 128),
                                  dict(expert_map=True, mul=True, bias=np.float32)),
    "v6_experts_without_tokens_split_n": ("v6", "bf16", dict(BLOCK_M=64, BLOCK_N=128,
                                                             BLOCK_K=64, warps=12, stages=2,
                                                             GROUP_M=4, PRODUCER_REGS=56),
                                          (3, 16, 2, 136, 72, 64), dict(mul=True)),
    # 4 live m tiles x 3 n tiles over 3 CTAs, 6 k tiles a tile: the walk and the ring wrap
    "v6_persistent_wrap": ("v6", "bf16", dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, warps=8,
                                              stages=3, GROUP_M=2, PRODUCER_REGS=56),
                           (100, 2, 2, 264, 328, 64), dict(mul=True)),
    "v6_n256_two_consumers": ("v6", "bf16", dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
                                                 warps=12, stages=2, GROUP_M=8,
                                                 PRODUCER_REGS=56),
                              (70, 2, 2, 264, 136, 128), dict(bias="same")),
    # N = 300: not a multiple of 8 (the element-wise stores), two consumers splitting 256
    "v6_split_n_gemm2_n300": ("v6", "fp16", dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, warps=12,
                                                 stages=3, GROUP_M=8, PRODUCER_REGS=56),
                              (31, 4, 2, 300, 200, 64), dict(gemm2=True, mul=True)),
    # the shipped prefill tile (the heuristic from m = 512): 128 x 256, 4 stages, 6 k tiles
    "v6_shipped_128x256": ("v6", "bf16", gcfg.heuristic_config("v6", "bf16", 4096),
                           (70, 2, 2, 264, 328, 128), dict(mul=True, bias=np.float32)),
    # about 60 rows an expert in 128-row tiles: the second consumer's 64 rows all padding in
    # some tiles and not in others, over a 2-deep ring
    "v6_half_padded_tiles": ("v6", "bf16", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                                                warps=12, stages=2, GROUP_M=2,
                                                PRODUCER_REGS=56),
                             (120, 4, 2, 264, 328, 128), dict(mul=True, bias=np.float32)),
    # block_size 128 with 64-row tiles: two tiles of one alignment block
    "v6_block128_tile64": ("v6", "bf16", dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, warps=8,
                                              stages=4, GROUP_M=8, PRODUCER_REGS=56),
                           (90, 4, 2, 136, 72, 128), dict(mul=True)),
    # BLOCK_M 256 (two 64-row pieces a consumer against one w tile): runs of 30, 100, 150,
    # 0, 256 and 300 slots put every count of live pieces (0, 1, 2) on each consumer, a run
    # of exactly one tile and one of two tiles whose second is mostly padding
    "v6_256_rows_live_pieces": ("v6", "bf16", dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64,
                                                   warps=12, stages=2, GROUP_M=2,
                                                   PRODUCER_REGS=80),
                                (418, 6, 2, 136, 200, 256),
                                dict(ids=ids_with_runs((30, 100, 150, 0, 256, 300)), mul=True,
                                     bias=np.float32)),
    "v6_256_rows_expert_map_fp16": ("v6", "fp16", dict(BLOCK_M=256, BLOCK_N=64, BLOCK_K=64,
                                                       warps=12, stages=3, GROUP_M=8,
                                                       PRODUCER_REGS=80),
                                    (418, 6, 2, 72, 136, 256),
                                    dict(ids=ids_with_runs((30, 100, 150, 0, 256, 300)),
                                         expert_map=True, gemm2=True)),
    # block_size 256 with 128-row tiles: a run's second tile all padding (multiplied, never stored)
    "v6_block256_tile128": ("v6", "bf16", dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, warps=12,
                                               stages=2, GROUP_M=4, PRODUCER_REGS=56),
                            (418, 6, 2, 136, 72, 256),
                            dict(ids=ids_with_runs((30, 100, 150, 0, 256, 300)), mul=True)),
    "v3_fp32": ("v3", "fp32", dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=16, warps=2, stages=1, TM=4,
                                   TN=4),
                (9, 4, 2, 72, 52, 16), dict(mul=True, bias="same")),
    "v3_bf16_ep": ("v3", "bf16", dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, warps=4, stages=1, TM=4,
                                      TN=4),
                   (17, 8, 2, 72, 136, 32), dict(expert_map=True, bias=np.float32)),
    "v2_fp16": ("v2", "fp16", dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, warps=16, stages=1),
                (9, 4, 2, 40, 50, 16), dict(mul=True, bias="same")),
    "v1_bf16_ep": ("v1", "bf16", dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=1, warps=8, stages=1),
                   (9, 8, 2, 70, 30, 16), dict(expert_map=True, mul=True)),
}


@pytest.mark.slow
@needs_gxx
@pytest.mark.parametrize("case", tuple(EMU_CASES))
def test_kernel_on_cpu_emulator(case):
    version, dkey, cfg, args, kw = EMU_CASES[case]
    T, E, top_k, N, K, B = args
    dt = DTYPES[dkey]
    prob = _host_problem(T, E, top_k, N, K, dt, B, **kw)
    got = _emulate(prob, version, cfg)
    err = rel_err(got, prob["want"])
    assert err <= TOL[dt], f"{case}: relative error {err:.3e} (NaN rows: " \
                           f"{int(np.isnan(got.astype(np.float64)).any(1).sum())})"


# The ring checks are no formality: v6 with a wait or its fence taken out must fail them
# (each case: the line removed from the source, what the emulator then reports).
BROKEN_V6 = {
    # the producer runs ahead over slots the consumers may still read: caught at its copy, at
    # a consumer's next wgmma (a piece in flight, or landed in a phase it has not waited for),
    # or as the deadlock of a consumer waiting on a phase that has passed twice: which one
    # depends on the threads' timing, so any of the emulator's reports will do
    "no_wait_on_empty": ("gg_mbar_wait(empty_bar + 8 * slot, phase ^ 1);", ""),
    "no_wait_on_full": ("gg_mbar_wait(full_bar + 8 * slot, phase);         // a and w of "
                        "this stage landed", "wgmma reads"),
    "no_fence": ("wg_fence_proxy_async();", "no fence.proxy.async"),
}


@pytest.mark.slow
@needs_gxx
@pytest.mark.parametrize("broken", tuple(BROKEN_V6))
def test_emulator_catches_a_broken_v6_ring(broken, monkeypatch, request):
    line, message = BROKEN_V6[broken]
    source_text = C.source_text

    def without_the_line(cu, defines=None):
        text = source_text(cu, defines)
        assert line in text, f"{line!r} is no longer in {cu}: update BROKEN_V6"
        return text.replace(line, ";", 1)

    monkeypatch.setattr(C, "source_text", without_the_line)
    monkeypatch.setattr(sys.modules[__name__], "EMU_FLAGS", ["-DEMU_WAIT_S=10"])
    _emu_binary.cache_clear()                     # build the broken source, and forget it after
    request.addfinalizer(_emu_binary.cache_clear)
    version, dkey, cfg, (T, E, top_k, N, K, B), kw = EMU_CASES["v6_persistent_wrap"]
    prob = _host_problem(T, E, top_k, N, K, DTYPES[dkey], B, **kw)
    with pytest.raises(AssertionError, match=f"EMULATOR: .*({message})"):
        _emulate(prob, version, cfg)


# ---------------------------------------------------------------------------- the launcher too


class _EmuKernel:
    def __init__(self, cu, name, defines, order_seed=0):
        self.exe = _emu_binary(cu, name, tuple(sorted(defines.items())))
        self.launches = []
        self.order_seed = order_seed

    def __call__(self, grid, block, args, shared_mem=0):
        _emu_launch(self.exe, grid, block, shared_mem, args, self.order_seed)
        self.launches.append((grid, block, shared_mem))


@pytest.mark.slow
@needs_gxx
@pytest.mark.parametrize("case", ("v4_bf16_bias_weights_out", "default_fp16_k100", "v3_fp32_gemm2",
                                  "v6_bf16_bias_weights_out", "v6_fp16_gemm2_block128"))
def test_launcher_on_cpu_emulator(case, monkeypatch):
    """grouped_gemm() itself (checks, config, geometry, the argument tuple) with CuPy replaced
    by NumPy-backed arrays and the kernel by its emulated build (v6: extra_args' tensor map
    from the fields the launcher would encode, the SM count of the fake device)."""
    monkeypatch.setitem(sys.modules, "cupy", launcher_cupy(EMU_SMS))
    monkeypatch.setattr(gg, "_READY", {})
    monkeypatch.setattr(gg, "_DUMMIES", {})
    monkeypatch.setattr(gg, "_DEVICE_SMS", {})
    monkeypatch.setattr(gtmap, "_TENSOR_MAPS", {})
    encoded = []

    def fake_encode(fields, ptr):
        encoded.append((fields, ptr))
        return _emu_tensor_map(fields)

    monkeypatch.setattr(gtmap, "_encode_tensor_map", fake_encode)
    monkeypatch.setattr(gg, "_sm90_of", lambda dev: True)
    made = []

    def fake_get_kernel(cu, name, defines=None, name_expressions=None, options=()):
        made.append(_EmuKernel(cu, name, defines))
        return made[-1]

    monkeypatch.setattr(gg, "get_kernel", fake_get_kernel)
    if case == "v4_bf16_bias_weights_out":
        version, prob = "v4", _host_problem(11, 4, 2, 80, 136, BF16, 16, mul=True, bias=BF16)
    elif case == "default_fp16_k100":
        version, prob = None, _host_problem(6, 4, 2, 48, 100, np.dtype(np.float16), 16, mul=True)
    elif case == "v6_bf16_bias_weights_out":
        version, prob = "v6", _host_problem(37, 4, 2, 200, 136, BF16, 64, mul=True, bias=BF16)
    elif case == "v6_fp16_gemm2_block128":
        version, prob = "v6", _host_problem(50, 4, 2, 136, 200, np.dtype(np.float16), 128,
                                            gemm2=True, mul=True, bias=np.float32)
    else:
        version, prob = "v3", _host_problem(7, 4, 3, 64, 40, np.dtype(np.float32), 16,
                                            gemm2=True, mul=True, bias=np.float32)
    dev = {k: None if v is None else np.ascontiguousarray(v).view(FakeArray)
           for k, v in prob.items() if k in ("a", "w", "st", "ex", "nt", "tw", "bias")}
    out = None
    if version in ("v4", "v6"):
        out = np.full((prob["P"], prob["N"]), np.nan, prob["dtype"]).view(FakeArray)
    got = gg.grouped_gemm(dev["a"], dev["w"], dev["st"].astype(np.int32),
                          dev["ex"].astype(np.int32), dev["nt"].astype(np.int32), prob["top_k"],
                          prob["B"], dev["tw"], prob["mul"], dev["bias"], version=version, out=out)
    assert out is None or got is out
    assert len(made) == 1 and len(made[0].launches) == 1
    if version == "v6":
        (grid, block, _), = made[0].launches
        assert grid == (EMU_SMS,) and block[0] in (256, 384)
        (fields, ptr), = encoded
        assert ptr == dev["w"].ctypes.data and fields["dims"] == tuple(reversed(dev["w"].shape))
    err = rel_err(np.asarray(got), prob["want"])
    assert err <= TOL[prob["dtype"]], f"{case}: relative error {err:.3e}"
