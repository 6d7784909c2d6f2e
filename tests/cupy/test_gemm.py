"""The CuPy grouped GEMM ladder (cuda_kernels/cupy/gemm.py) against the reference.

    T tokens, E experts (E_local on this rank), K top-k, H hidden, I intermediate,
    B block size, N output width, Kdim reduction width, P = T*K slots

CPU (no marker): the config table is well formed, every bucket has a config for every
version and dtype, configs fit every usual block_size, every table config is registered
for the NVRTC compile test.

GPU (`gpu` marker, skipped without a device): every version x dtype against
reference.grouped_gemm fed float64 inputs (relative Frobenius error: fp32 <= 1e-5 for the
sqrt(Kdim) growth of fp32 sums; fp16/bf16 <= 1e-2 for one output rounding), on vLLM's
fused_moe test grid and on the nasty cases; outputs poisoned with NaN (all bytes 0xFF, a
NaN in fp32, fp16 and bf16) before every launch, so a row the kernel forgets stays NaN and
fails; the end-to-end layer with these GEMMs against reference.fused_experts; bad inputs
raise before any launch.
"""
from __future__ import annotations

import functools
import math
import pathlib
import shutil
import subprocess
import sys
import tempfile
import types

import numpy as np
import pytest
from tests.oracles import BF16, TOL, distinct_topk_ids, random_weights, rel_err, rng_for, uniform

import reference
from cuda_kernels.cupy import _compile as C
from cuda_kernels.cupy import gemm as gg
from cuda_kernels.cupy import gemm_configs as gcfg
from cuda_kernels.cupy import gemm_tensor_map as gtmap
from cuda_kernels.cupy import tune

DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": BF16}


# ============================================================================ CPU: configs
def test_table_rows_are_well_formed():
    table = gcfg.load_table()
    assert table["configs"], "gemm_configs.json holds no rows"
    for row in table["configs"]:
        assert row["version"] in gcfg.VERSIONS, row
        assert row["dtype"] in gcfg.DTYPE_KEYS, row
        assert row["m"] in gcfg.M_BUCKETS, row
        assert not (row["version"] in gcfg.TENSOR_CORE_VERSIONS and row["dtype"] == "fp32"), row
        assert ("N" in row) == ("K" in row), f"a shape row needs both N and K: {row}"
        gcfg.check_config(row["version"], row["dtype"], gcfg._row_config(row))


def test_generic_rows_are_the_heuristic():
    """The untimed rows are exactly what tune.py --heuristic writes (regenerate after edits)."""
    generic = [r for r in gcfg.load_table()["configs"] if "N" not in r]
    assert generic == tune.heuristic_table()["configs"]


@pytest.mark.parametrize("version", gcfg.VERSIONS + (None,))
@pytest.mark.parametrize("dkey", gcfg.DTYPE_KEYS)
def test_get_config_covers_every_bucket(version, dkey):
    for m in gcfg.M_BUCKETS:
        for (N, K) in ((256, 128), (28672, 4096), (2048, 768), (7168, 2048), (200, 136)):
            E, top_k = 64, 4
            M = max(1, m * E // top_k)                  # tokens giving m tokens per expert
            cfg = gcfg.get_config(M, N, K, E, top_k, DTYPES[dkey], version)
            v = cfg["version"]
            assert v in gcfg.VERSIONS and (version in (None, v) or
                                           (version in gcfg.TENSOR_CORE_VERSIONS and v == "v3"))
            gcfg.check_config(v, dkey, {k: x for k, x in cfg.items() if k != "version"})
            assert cfg["BLOCK_M"] >= 1
            # the caller aligns with BLOCK_M: the config fits its own block size
            gcfg.fit_config(v, dkey, cfg, cfg["BLOCK_M"])


@pytest.mark.parametrize("version", gcfg.VERSIONS)
@pytest.mark.parametrize("dkey", gcfg.DTYPE_KEYS)
def test_fit_config_divides_block_size(version, dkey):
    if version in gcfg.TENSOR_CORE_VERSIONS and dkey == "fp32":
        pytest.skip("fp32 runs v3")
    sizes = {"v4": (16, 32, 48, 64, 128, 256), "v5": (64, 128, 192, 256),
             "v6": (64, 128, 192, 256)}.get(
        version, (1, 3, 8, 16, 24, 64, 128))
    for m in gcfg.M_BUCKETS:
        cfg = gcfg.heuristic_config(version, dkey, m)
        for B in sizes:
            fitted = gcfg.fit_config(version, dkey, cfg, B)
            if version != "v1":
                assert B % fitted["BLOCK_M"] == 0, (cfg, B, fitted)
            grid, block, smem = gcfg.launch_geometry(version, fitted, 1000, 300)
            assert math.prod(block) <= 1024 and smem <= gcfg.V4_SMEM_LIMIT


def test_tensor_core_rungs_reject_short_blocks():
    with pytest.raises(ValueError, match="block_size: v4 needs a multiple of 16"):
        gcfg.fit_config("v4", "bf16", gcfg.heuristic_config("v4", "bf16", 1), 8)
    with pytest.raises(ValueError, match="block_size: v5 needs a multiple of 64"):
        gcfg.fit_config("v5", "bf16", gcfg.heuristic_config("v5", "bf16", 1), 32)
    assert "block_size" in gg.usable("v5", "bf16", 128, 16, True)
    with pytest.raises(ValueError, match="block_size: v6 needs a multiple of 64"):
        gcfg.fit_config("v6", "bf16", gcfg.heuristic_config("v6", "bf16", 4096), 32)
    assert "block_size" in gg.usable("v6", "bf16", 128, 16, True)
    assert "compute capability 9.0" in gg.usable("v6", "bf16", 128, 64, True, sm90=False)
    assert "Kdim" in gg.usable("v6", "bf16", 0, 64, True)


def test_m_bucket_and_lookup():
    assert [gcfg.m_bucket(x) for x in (0.1, 1, 1.5, 16, 17, 1e9)] == [1, 1, 2, 16, 32, 4096]
    table = {"configs": [
        {"version": "v4", "dtype": "bf16", "m": 16, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64,
         "warps": 4, "stages": 4},
        {"version": "v4", "dtype": "bf16", "m": 16, "N": 4096, "K": 7168, "BLOCK_M": 16,
         "BLOCK_N": 128, "BLOCK_K": 128, "warps": 4, "stages": 3}]}
    assert gcfg.lookup("v4", "bf16", 10, 4096, 7168, table)["BLOCK_N"] == 128   # the shape row
    assert gcfg.lookup("v4", "bf16", 10, 4000, 7000, table)["BLOCK_N"] == 128   # near it
    assert gcfg.lookup("v4", "bf16", 10, 512, 512, table)["BLOCK_N"] == 64      # far: generic
    assert gcfg.lookup("v4", "fp16", 10, 512, 512, table) == gcfg.heuristic_config("v4", "fp16", 16)


def test_default_version_and_fallbacks(monkeypatch):
    """None picks the table's default_version and steps down to what the problem allows."""
    plan = gg._plan.__wrapped__             # the uncached function: the table is swapped below
    assert plan(None, "bf16", 1, 128, 128, 16, True, True, None)[0] == "v4"
    assert plan(None, "fp32", 1, 128, 128, 16, True, True, None)[0] == "v3"
    assert plan(None, "fp16", 1, 128, 100, 16, True, True, None)[0] == "v2"    # Kdim % 8
    assert plan(None, "bf16", 1, 128, 128, 8, True, True, None)[0] == "v3"     # B % 16
    assert plan(None, "bf16", 1, 128, 128, 16, False, True, None)[0] == "v2"   # unaligned
    promoted = dict(gcfg.load_table(), default_version={"bf16": "v5", "fp32": "v5"})
    monkeypatch.setattr(gcfg, "load_table", lambda *a: promoted)
    assert gcfg.default_version(BF16) == "v5" and gcfg.default_version(np.float32) == "v3"
    assert plan(None, "bf16", 64, 256, 256, 64, True, True, None)[0] == "v5"
    assert plan(None, "bf16", 64, 256, 256, 16, True, True, None)[0] == "v4"   # B % 64
    assert plan(None, "bf16", 64, 256, 256, 64, True, False, None)[0] == "v4"  # not sm_90
    with pytest.raises(ValueError, match="a: v5 .* compute capability 9.0"):
        plan("v5", "bf16", 64, 256, 256, 64, True, False, None)


def test_version_by_m_picks_v5_per_bucket(monkeypatch):
    """version_by_m (written by tune.py from timing) overrides default_version per m bucket;
    a bucket it does not name keeps the default; the block size follows the chosen rung."""
    times = {("deepseek", 128, "v4"): 2.0, ("deepseek", 128, "v5"): 1.0,
             ("mixtral", 128, "v4"): 3.0, ("mixtral", 128, "v5"): 2.5,
             ("deepseek", 256, "v4"): 1.0, ("deepseek", 256, "v5"): 2.0,
             ("mixtral", 512, "v4"): 1.0}                       # v5 not timed: no promotion
    by_m = tune.version_by_m(times)
    # m=128: v5 faster on both models; m=256: v4; m=512: one rung timed, nothing to choose
    assert by_m == {"bf16": {"128": "v5", "256": "v4"}, "fp16": {"128": "v5", "256": "v4"}}
    # the sum over the models decides: 1.5 for v5 against 2.0 for v4
    assert tune.version_by_m({("deepseek", 64, "v4"): 1.0, ("deepseek", 64, "v5"): 0.5,
                              ("mixtral", 64, "v4"): 1.0, ("mixtral", 64, "v5"): 1.0}) == \
        {"bf16": {"64": "v5"}, "fp16": {"64": "v5"}}
    card = "Card X"
    table = tune.merge_device_section({"configs": gcfg.load_table()["configs"]}, card, [],
                                      by_m, {"date": "today"})
    monkeypatch.setattr(gcfg, "load_table", lambda *a: table)
    gg._plan.cache_clear()
    try:
        assert gcfg.default_version(BF16, device=card) == "v4"
        assert gcfg.default_version(BF16, 100, card) == "v5"
        assert gcfg.default_version(BF16, 300, card) == "v4"
        assert gcfg.default_version(BF16, 100, "Another card") == "v4"    # not its section
        E, top_k = 256, 8
        cfg = gcfg.get_config(128 * E // top_k, 4096, 7168, E, top_k, BF16, device=card)
        assert cfg["version"] == "v5" and cfg["BLOCK_M"] % 64 == 0
        assert gcfg.get_config(64 * E // top_k, 4096, 7168, E, top_k, BF16,
                               device=card)["version"] == "v4"
        plan = gg._plan.__wrapped__
        assert plan(None, "bf16", 128, 4096, 7168, 64, True, True, None, card)[0] == "v5"
        assert plan(None, "bf16", 128, 4096, 7168, 16, True, True, None, card)[0] == "v4"
        assert plan(None, "bf16", 128, 4096, 7168, 64, True, False, None, card)[0] == "v4"
        assert plan(None, "fp32", 128, 4096, 7168, 64, True, True, None, card)[0] == "v3"
        assert plan(None, "bf16", 128, 4096, 7168, 64, True, True, None, None)[0] == "v4"
    finally:
        gg._plan.cache_clear()


def test_card_sections_are_read_on_their_card_only():
    """A row tuned on one card applies on that card; another card gets the generic rows."""
    generic = {"version": "v4", "dtype": "bf16", "m": 16, "BLOCK_M": 16, "BLOCK_N": 64,
               "BLOCK_K": 64, "warps": 4, "stages": 4}
    tuned = dict(generic, N=4096, K=7168, BLOCK_N=128, BLOCK_K=128, stages=3)
    table = tune.merge_device_section({"configs": [generic]}, "Card A", [tuned], {}, {})
    assert gcfg.lookup("v4", "bf16", 10, 4096, 7168, table, device="Card A")["BLOCK_N"] == 128
    assert gcfg.lookup("v4", "bf16", 10, 4096, 7168, table, device="Card B")["BLOCK_N"] == 64
    assert gcfg.lookup("v4", "bf16", 10, 4096, 7168, table)["BLOCK_N"] == 64
    # a re-tune replaces the row of the same key and keeps the others
    again = tune.merge_device_section(table, "Card A", [dict(tuned, stages=5)], {}, {})
    rows = again["devices"]["Card A"]["configs"]
    assert len(rows) == 1 and rows[0]["stages"] == 5


def test_card_sections_keep_every_run():
    """A run that re-tunes a few buckets appends its provenance; the earlier runs stay (a
    section written with one top-level run moves that run into the list first)."""
    old = {"devices": {"Card A": {"configs": [], "date": "d0", "source": "s0", "command": "c0"}}}
    table = tune.merge_device_section(old, "Card A", [], {}, {"date": "d1", "source": "s1",
                                                              "command": "c1"})
    sec = table["devices"]["Card A"]
    assert [r["command"] for r in sec["runs"]] == ["c0", "c1"]
    assert "command" not in sec and "date" not in sec


def test_shipped_table_has_the_cards_sections():
    table = gcfg.load_table()
    assert not any("N" in r for r in table["configs"]), "shape rows belong to a card's section"
    for name, sec in table.get("devices", {}).items():
        assert name.startswith("NVIDIA"), name
        for row in sec.get("configs", []):
            gcfg.check_config(row["version"], row["dtype"], gcfg._row_config(row))
        for dk, by_m in sec.get("version_by_m", {}).items():
            assert all(v in gcfg.VERSIONS and int(m) in gcfg.M_BUCKETS for m, v in by_m.items())


def test_shape_rows_apply_at_their_own_bucket_only():
    table = {"configs": [
        {"version": "v4", "dtype": "bf16", "m": 16, "N": 4096, "K": 7168, "BLOCK_M": 16,
         "BLOCK_N": 128, "BLOCK_K": 128, "warps": 4, "stages": 3}]}
    assert gcfg.lookup("v4", "bf16", 16, 4096, 7168, table)["BLOCK_N"] == 128
    assert gcfg.lookup("v4", "bf16", 4096, 4096, 7168, table) == \
        gcfg.heuristic_config("v4", "bf16", 4096)                 # a far bucket: not the m=16 tile


def test_every_table_config_is_registered_for_nvrtc():
    registered = {(c.cu_name, tuple(sorted((c.defines or {}).items())))
                  for c in C.COMPILE_CASES}
    for cu, defines, options in gg.compile_cases():
        assert (cu, tuple(sorted(defines.items()))) in registered
        assert options == gg.KERNEL_OPTIONS.get(
            next(v for v, f in gg.CU_FILES.items() if f == cu), ())
    assert {case[0] for case in gg.compile_cases()} == set(gg.CU_FILES.values())


def test_v6_configs_and_register_split():
    """v6's heuristic and tuning candidates are launchable at both block sizes, and the
    setmaxnreg split never asks for more registers than the CTA entered with."""
    cands = [dict(zip(tune.CANDIDATE_KEYS["v6"], c)) for c in tune.V6_CANDIDATES]
    for cfg in [gcfg.heuristic_config("v6", "bf16", m) for m in gcfg.M_BUCKETS] + cands:
        for B in (64, 128, 256):
            f = gcfg.fit_config("v6", "bf16", cfg, B)
            d = gcfg.kernel_defines("v6", "bf16", f)
            threads = f["warps"] * 32
            assert d["CONSUMERS"] == f["warps"] // 4 - 1 and B % f["BLOCK_M"] == 0
            if d["CONSUMERS"] == 2:
                entry = 65536 // threads // 8 * 8
                assert 128 * d["PRODUCER_REGS"] + 256 * d["CONSUMER_REGS"] <= entry * threads
            grid, block, smem = gcfg.launch_geometry("v6", f, 5000, 4096, num_sms=132)
            assert grid == (132,) and block == (threads,) and smem <= gcfg.V4_SMEM_LIMIT
    assert gcfg.launch_geometry("v6", gcfg.fit_config("v6", "bf16", cands[0], 128), 100, 100,
                                num_sms=132)[0] == (1,)           # never more CTAs than tiles
    with pytest.raises(ValueError, match="warps"):
        gcfg.check_config("v6", "bf16", dict(cands[0], warps=8))  # 128 rows need two consumers
    with pytest.raises(ValueError, match="BLOCK_K 64"):
        gcfg.check_config("v6", "bf16", dict(cands[0], BLOCK_K=32))
    assert gg.extra_args("v5", {}, dev=0) == ()


def test_v6_tensor_map_encoding(monkeypatch):
    """extra_args' CUtensorMap: w [E, N, Kdim] viewed 3-D (Kdim, N, E innermost first), strides
    in bytes, a box of 64 x BLOCK_N x 1, 128-byte swizzle, zero fill; encoded once per (w, shape,
    tile) by the driver's cuTensorMapEncodeTiled (through ctypes), passed as a one-element array
    of its 128 bytes (by value)."""
    import ctypes

    from cuda_kernels.cupy import _launch

    calls = []

    def fake_encode(tmap, dtype, rank, ptr, dims, strides, box, estrides, interleave, swizzle,
                    l2, oob):
        r = rank.value
        calls.append((dtype.value, r, ptr.value, list(dims), list(strides), list(box),
                      list(estrides), interleave.value, swizzle.value, oob.value))
        ctypes.cast(tmap, ctypes.POINTER(ctypes.c_uint64))[0] = 0xABC   # the driver writes it
        return 0

    monkeypatch.setattr(_launch, "_driver",
                        lambda: types.SimpleNamespace(cuTensorMapEncodeTiled=fake_encode))
    monkeypatch.setattr(gtmap, "_TENSOR_MAPS", {})
    w = np.zeros((8, 300, 200), BF16).view(_FakeArray)          # [E, N, Kdim]
    cfg = gcfg.fit_config("v6", "bf16", gcfg.heuristic_config("v6", "bf16", 4096), 128)
    (tmap,) = gg.extra_args("v6", cfg, dev=0, w=w)
    assert gtmap.v6_tensor_map(w.ctypes.data, w.shape, "bf16", cfg, 0) is tmap   # cached
    assert len(calls) == 1
    assert isinstance(tmap, np.ndarray) and tmap.size == 1 and tmap.nbytes == 128
    assert tmap.view(np.uint64)[0] == 0xABC                     # the driver's bytes, passed on
    dtype, rank, ptr, dims, strides, box, estrides, interleave, swizzle, oob = calls[0]
    assert dtype == 9 and rank == 3                             # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    assert ptr == w.ctypes.data and dims == [200, 300, 8] and strides == [400, 400 * 300]
    assert box == [64, cfg["BLOCK_N"], 1] and estrides == [1, 1, 1]
    assert (interleave, swizzle, oob) == (0, 3, 0)              # none, 128-byte swizzle, zeros
    gg.extra_args("v6", dict(cfg, BLOCK_N=128), dev=0, w=w)
    assert len(calls) == 2                                      # another tile: another map


def test_fast_launch_sets_fixed_arguments_once(monkeypatch):
    """FastLaunch: the fixed arguments' slots are written at construction, a call writes the
    others in order and the stream into the launch configuration, and the driver's
    cuLaunchKernelEx gets every slot of the parameter block; a fixed index
    outside the signature is refused by name before the driver is touched."""
    import ctypes

    from cuda_kernels.cupy import _launch

    seen = []

    def fake_launch(config, fn, params, extra):
        cfg = config.contents
        assert (cfg.gridDimX, cfg.blockDimX, cfg.numAttrs) == (2, 32, 0)
        slots = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        p = [slots[i] for i in range(4)]
        seen.append((cfg.hStream, ctypes.c_void_p.from_address(p[0]).value,
                     ctypes.c_int32.from_address(p[1]).value,
                     ctypes.c_int32.from_address(p[2]).value,
                     ctypes.c_float.from_address(p[3]).value))
        return 0

    monkeypatch.setattr(_launch, "_driver",
                        lambda: types.SimpleNamespace(cuLaunchKernelEx=fake_launch))
    kernel = types.SimpleNamespace(ptr=1234)
    launch = _launch.FastLaunch(kernel, (2,), (32,), 0, "piif", fixed={1: 7, 2: -3})
    launch(99, 0xBEEF, 0.5)
    launch(98, 0xCAFE, 1.5)
    assert seen == [(99, 0xBEEF, 7, -3, 0.5), (98, 0xCAFE, 7, -3, 1.5)]
    with pytest.raises(ValueError, match="fixed: expected argument indices in \\[0, 4\\)"):
        _launch.FastLaunch(kernel, (2,), (32,), 0, "piif", fixed={4: 1})


def test_kernel_sources_open_with_a_header():
    for cu in gg.CU_FILES.values():
        text = (C.KERNEL_DIR / cu).read_text()
        head = text[:text.index("#include")]
        for word in ("Math", "Launch geometry", "v1", "v4", "v5", "Run:"):
            assert word in head, f"{cu}: header lacks {word!r}"


# ============================================================================ GPU helpers
def _cp():
    import cupy

    return cupy


def _poisoned(shape, dtype):
    """A device array whose every byte is 0xFF: NaN in fp32, fp16 and bf16."""
    out = C.empty(shape, dtype)
    C.raw(out).view(_cp().uint8).fill(255)
    return out


def _host(x, dtype):
    h = x.get()
    return h.view(BF16) if np.dtype(dtype) == BF16 and h.dtype == np.uint16 else h


def _dev(a):
    return None if a is None else C.to_device(a)


def _problem(T, E, top_k, N, K, dtype, B, *, seed=0, ids=None, expert_map=None,
             ignore_invalid=False, E_local=None, bias=None, mul=False, gemm2=False):
    """Host inputs, the reference output (float64 inputs), and device copies.

    gemm2=True: a is [P, K] (one row per slot), top_k = 1 in the call; else a is [T, K].
    """
    rng = rng_for("gemm", T, E, top_k, N, K, str(dtype), B, seed)
    E_local = E if E_local is None else E_local
    ids = distinct_topk_ids(rng, T, E, top_k) if ids is None else ids
    P = T * top_k
    rows = P if gemm2 else T
    a = uniform(rng, (rows, K), 1.0, dtype)
    w = uniform(rng, (E_local, N, K), 1.7 / math.sqrt(max(K, 1)), dtype)
    b = None
    if bias is not None:
        b = uniform(rng, (E_local, N), 0.5, np.float32).astype(bias)
    tw = random_weights(rng, T, top_k)            # passed always, read only when mul
    st, ex, nt = reference.moe_align_block_size(ids, B, E, expert_map=expert_map,
                                                ignore_invalid_experts=ignore_invalid)
    call_top_k = 1 if gemm2 else top_k
    want = reference.grouped_gemm(a.astype(np.float64), w.astype(np.float64), st, ex, nt,
                                  call_top_k, B, tw.astype(np.float64), mul,
                                  None if b is None else b.astype(np.float64))
    dev = dict(a=_dev(a), w=_dev(w), st=_dev(st), ex=_dev(ex), nt=_dev(nt), tw=_dev(tw),
               bias=_dev(b))
    return dict(a=a, w=w, bias=b, tw=tw, st=st, ex=ex, nt=nt, want=want, top_k=call_top_k,
                B=B, P=P, N=N, dev=dev, mul=mul, dtype=np.dtype(dtype))


def _run(prob, version, **kw):
    d = prob["dev"]
    out = _poisoned((prob["P"], prob["N"]), prob["dtype"])
    got = gg.grouped_gemm(d["a"], d["w"], d["st"], d["ex"], d["nt"], prob["top_k"], prob["B"],
                          d["tw"], prob["mul"], d["bias"], version=version, out=out, **kw)
    assert got is out
    return _host(got, prob["dtype"])


def _check(prob, version, tol=None, **kw):
    got = _run(prob, version, **kw)
    want = prob["want"]
    tol = TOL[prob["dtype"]] if tol is None else tol
    err = rel_err(got, want)   # inf when a poisoned (NaN) row was left unwritten
    assert err <= tol, (f"{version} {prob['dtype']}: relative error {err:.3e} > {tol:.0e}; "
                        f"NaN rows: {int(np.isnan(got.astype(np.float64)).any(1).sum())}")
    return got


VERSIONS_ALL = ("v1", "v2", "v3", "v4")


@pytest.fixture(scope="module")
def prebuilt():
    """Compile the table's kernels once, in parallel threads (NVRTC runs outside the GIL):
    the GPU tests then find them built instead of compiling ~50 kernels one by one."""
    ok, _ = C.availability()
    if ok:
        gg.prebuild()


def gpu(test):
    """The `gpu` marker plus the prebuilt kernels."""
    return pytest.mark.gpu(pytest.mark.usefixtures("prebuilt")(test))


# ============================================================================ GPU: the grid
# vLLM's tests/kernels/moe/test_moe.py grid: (T, I, H) x E x top_k
VLLM_TIH = ((1, 128, 128), (1, 2048, 128), (33, 2048, 128), (222, 1024, 1024))


@functools.lru_cache(maxsize=2)
def _grid_problem(T, I, H, E, top_k, dkey, which):  # noqa: E741
    dt = DTYPES[dkey]
    B = gcfg.get_config(T, 2 * I, H, E, top_k, dt)["BLOCK_M"]   # the layer's choice
    if which == "gemm1":
        return _problem(T, E, top_k, 2 * I, H, dt, B, seed=1)
    return _problem(T, E, top_k, H, I, dt, B, seed=2, gemm2=True, mul=True)


# the first parametrize varies fastest: the versions run back to back on one cached problem
@gpu
@pytest.mark.parametrize("version", VERSIONS_ALL)
@pytest.mark.parametrize("which", ("gemm1", "gemm2"))
@pytest.mark.parametrize("dkey", tuple(DTYPES))
@pytest.mark.parametrize("top_k", (2, 6))
@pytest.mark.parametrize("E", (8, 64))
@pytest.mark.parametrize("T,I,H", VLLM_TIH)
def test_vllm_grid(version, T, I, H, E, top_k, dkey, which):  # noqa: E741
    _check(_grid_problem(T, I, H, E, top_k, dkey, which), version)


# ============================================================================ GPU: nasty cases
NASTY = {
    # name: (T, E, top_k, N, K, B, extra)
    "one_token": (1, 8, 2, 256, 128, 16, {}),
    "T_not_multiple_of_block": (37, 8, 2, 192, 256, 64, {}),
    "experts_without_tokens": (3, 64, 2, 128, 128, 16, {}),
    "N200_K136": (19, 8, 3, 200, 136, 16, {}),
    "block_128": (300, 4, 2, 256, 512, 128, {}),
    "block_32_bias_same_dtype": (25, 8, 2, 136, 264, 32, {"bias": "same"}),
    "bias_fp32_and_weights": (25, 8, 2, 136, 264, 16, {"bias": np.float32, "mul": True}),
    "gemm2_weights": (41, 16, 4, 120, 96, 32, {"gemm2": True, "mul": True}),
}


@functools.lru_cache(maxsize=1)
def _nasty_problem(case, dkey):
    T, E, top_k, N, K, B, extra = NASTY[case]
    extra = dict(extra)
    if extra.get("bias") == "same":
        extra["bias"] = DTYPES[dkey]
    return _problem(T, E, top_k, N, K, DTYPES[dkey], B, **extra)


@gpu
@pytest.mark.parametrize("version", VERSIONS_ALL)
@pytest.mark.parametrize("dkey", tuple(DTYPES))
@pytest.mark.parametrize("case", tuple(NASTY))
def test_nasty(version, case, dkey):
    _check(_nasty_problem(case, dkey), version)


@gpu
@pytest.mark.parametrize("dkey", tuple(DTYPES))
@pytest.mark.parametrize("version", VERSIONS_ALL)
def test_all_tokens_on_one_expert(version, dkey):
    T, E = 77, 8
    ids = np.full((T, 1), 5, dtype=np.int32)
    _check(_problem(T, E, 1, 192, 256, DTYPES[dkey], 16, ids=ids, mul=True), version)


@gpu
@pytest.mark.parametrize("dkey", tuple(DTYPES))
@pytest.mark.parametrize("version", VERSIONS_ALL)
def test_expert_map_minus_one_blocks_are_zero(version, dkey):
    """Blocks of experts on other ranks (expert_ids == -1) write zeros, bias or not."""
    T, E, top_k = 29, 8, 2
    _, emap = reference.determine_expert_map(2, 1, E)            # rank 1 of 2: experts 4..7
    prob = _problem(T, E, top_k, 160, 128, DTYPES[dkey], 16, expert_map=emap, E_local=4,
                    bias=np.float32, mul=True)
    assert (prob["ex"] == -1).any()
    got = _check(prob, version)
    zero_rows = np.isin(np.arange(prob["P"]), [
        s for b, e in enumerate(prob["ex"][: int(prob["nt"][0]) // 16]) if e == -1
        for s in prob["st"][b * 16:(b + 1) * 16] if s < prob["P"]])
    assert zero_rows.any() and (got[zero_rows].astype(np.float64) == 0).all()


@gpu
@pytest.mark.parametrize("version", VERSIONS_ALL)
def test_rows_named_by_no_block_are_left_alone(version):
    """ignore_invalid_experts drops non-local slots from the alignment: their rows are not
    written (the poison stays), all others are."""
    T, E, top_k = 21, 8, 2
    _, emap = reference.determine_expert_map(2, 0, E)
    prob = _problem(T, E, top_k, 128, 128, np.dtype(np.float16), 16, expert_map=emap,
                    E_local=4, ignore_invalid=True)
    got = _run(prob, version).astype(np.float64)
    live = np.isfinite(prob["want"]).all(axis=1)
    assert (~live).any() and live.any()
    assert np.isnan(got[~live]).all()
    assert rel_err(got[live], prob["want"][live]) <= TOL[np.dtype(np.float16)]


@gpu
@pytest.mark.parametrize("dkey", tuple(DTYPES))
def test_kdim_not_multiple_of_16_bytes(dkey):
    """Kdim = 100 (fp16/bf16: not a multiple of 8; fp32: 100 % 4 == 0): the default steps down
    to a rung that can (v2 or v3), explicit v3/v4 raise naming the requirement."""
    dt = DTYPES[dkey]
    prob = _problem(13, 8, 2, 96, 100, dt, 16, mul=True)
    _check(prob, None)
    if dkey != "fp32":
        for v in ("v3", "v4"):
            with pytest.raises(ValueError, match=r"a: v\d loads 16-byte chunks.*multiple of 8"):
                _run(prob, v)


@gpu
@pytest.mark.parametrize("version", VERSIONS_ALL)
def test_block_size_larger_than_the_tile(version):
    """B = 128 with a config whose BLOCK_M is 16: several CTA tiles per alignment block."""
    prob = _problem(90, 4, 2, 128, 128, np.dtype(np.float16), 128)
    cfg = gcfg.heuristic_config(version, "fp16", 1)
    _check(prob, version, config=cfg)


@gpu
def test_empty_batch():
    for dt in DTYPES.values():
        prob = _problem(0, 8, 2, 64, 64, dt, 16)
        got = gg.grouped_gemm(prob["dev"]["a"], prob["dev"]["w"], prob["dev"]["st"],
                              prob["dev"]["ex"], prob["dev"]["nt"], 2, 16)
        assert got.shape == (0, 64)


@gpu
def test_deterministic():
    """No atomics: two calls give the same bits."""
    prob = _problem(64, 8, 2, 256, 512, BF16, 16, mul=True)
    assert (_run(prob, "v4").view(np.uint16) == _run(prob, "v4").view(np.uint16)).all()


@gpu
def test_default_version_and_fp32_v4():
    prob = _problem(5, 8, 2, 64, 64, np.dtype(np.float32), 16)
    _check(prob, "v4")      # fp32 with v4 runs v3
    _check(prob, None)


# v5 (wgmma, opt-in): its own grid, with block sizes it can take (multiples of 64)
V5_CASES = {
    # name: (T, E, top_k, N, K, B, extra, config or None for the table's)
    "vllm_33_2048_128": (33, 8, 2, 4096, 128, 64, {}, None),
    "vllm_222_1024_1024_gemm1": (222, 64, 6, 2048, 1024, 64, {}, None),
    "vllm_222_1024_1024_gemm2": (222, 8, 6, 1024, 1024, 64, {"gemm2": True, "mul": True}, None),
    "one_token": (1, 8, 2, 256, 128, 64, {}, None),
    "N200_K136_bias_weights": (37, 8, 3, 200, 136, 64, {"bias": np.float32, "mul": True}, None),
    "block_128_n256": (300, 4, 2, 512, 256, 128, {"bias": "same"},
                       {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "warps": 8, "stages": 4}),
    "block_128_tile_64_n64_3_stages": (90, 4, 2, 136, 72, 128, {"mul": True},
                                       {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "warps": 4,
                                        "stages": 3}),
    "expert_map": (29, 8, 2, 160, 128, 64, {"expert_map": True, "bias": np.float32}, None),
}


@gpu
@pytest.mark.parametrize("dkey", ("fp16", "bf16"))
@pytest.mark.parametrize("case", tuple(V5_CASES))
def test_v5_wgmma(case, dkey):
    cp = _cp()
    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("v5 (wgmma, sm_90a) needs a compute capability 9.0 GPU")
    T, E, top_k, N, K, B, extra, cfg = V5_CASES[case]
    extra = dict(extra)
    if extra.get("bias") == "same":
        extra["bias"] = DTYPES[dkey]
    if extra.pop("expert_map", False):
        E_local, emap = reference.determine_expert_map(2, 1, E)
        extra.update(expert_map=emap, E_local=E_local)
    prob = _problem(T, E, top_k, N, K, DTYPES[dkey], B, **extra)
    _check(prob, "v5", **({"config": cfg} if cfg else {}))


# v6 (TMA + cp.async, warp-specialized, persistent; opt-in): the grid of v5 and the nasty
# cases, each under the table's config and under every kind of CTA v6 has (two consumers of
# 64 rows, two splitting 256 columns, one consumer; deep and shallow rings, GROUP_M 4 / 16)
V6_CASES = {
    # name: (T, E, top_k, N, K, B, extra)
    "vllm_33_2048_128": (33, 8, 2, 4096, 128, 64, {}),
    "vllm_222_1024_1024_gemm1": (222, 64, 6, 2048, 1024, 64, {}),
    "vllm_222_1024_1024_gemm2": (222, 8, 6, 1024, 1024, 64, {"gemm2": True, "mul": True}),
    "one_token": (1, 8, 2, 256, 128, 64, {}),
    "N200_K136_bias_weights": (37, 8, 3, 200, 136, 64, {"bias": np.float32, "mul": True}),
    "block_128_bias_same": (300, 4, 2, 512, 256, 128, {"bias": "same"}),
    "experts_without_tokens": (3, 64, 2, 128, 128, 64, {}),
    "all_tokens_on_one_expert": (77, 8, 1, 192, 256, 64, {"one_expert": 5, "mul": True}),
    "expert_map": (29, 8, 2, 160, 128, 64, {"expert_map": True, "bias": np.float32, "mul": True}),
    "N124_gemm2": (41, 16, 4, 124, 96, 64, {"gemm2": True, "mul": True}),
    # ~70 m tiles x 8 n tiles, far more than the SMs: the persistent walk wraps many times
    "persistent_many_tiles": (4096, 8, 2, 1024, 512, 128, {"mul": True}),
}
V6_CONFIGS = {
    "table": None,
    "128x256_s4": (128, 256, 64, 12, 4, 8, 56),
    "128x128_s6_g16": (128, 128, 64, 12, 6, 16, 56),
    "64x256_split_n": (64, 256, 64, 12, 5, 4, 56),
    "64x128_one_consumer_s2": (64, 128, 64, 8, 2, 8, 56),
}


@functools.lru_cache(maxsize=1)     # the configs of a case run back to back (varied fastest)
def _v6_problem(case, dkey):
    T, E, top_k, N, K, B, extra = V6_CASES[case]
    extra = dict(extra)
    if extra.get("bias") == "same":
        extra["bias"] = DTYPES[dkey]
    if extra.pop("expert_map", False):
        E_local, emap = reference.determine_expert_map(2, 1, E)
        extra.update(expert_map=emap, E_local=E_local)
    if "one_expert" in extra:
        extra["ids"] = np.full((T, top_k), extra.pop("one_expert"), dtype=np.int32)
    return _problem(T, E, top_k, N, K, DTYPES[dkey], B, **extra)


def _need_sm90():
    if _cp().cuda.Device().compute_capability != "90":
        pytest.skip("v6 (wgmma, setmaxnreg: sm_90a) needs a compute capability 9.0 GPU")


@gpu
@pytest.mark.parametrize("config", tuple(V6_CONFIGS))
@pytest.mark.parametrize("dkey", ("fp16", "bf16"))
@pytest.mark.parametrize("case", tuple(V6_CASES))
def test_v6_tma_ws(case, dkey, config):
    _need_sm90()
    cand = V6_CONFIGS[config]
    kw = {} if cand is None else {"config": dict(zip(tune.CANDIDATE_KEYS["v6"], cand))}
    _check(_v6_problem(case, dkey), "v6", **kw)


@gpu
def test_v6_rows_named_by_no_block_are_left_alone():
    """ignore_invalid_experts: the rows of non-local slots keep their poison under v6 too."""
    _need_sm90()
    T, E, top_k = 21, 8, 2
    _, emap = reference.determine_expert_map(2, 0, E)
    prob = _problem(T, E, top_k, 128, 128, np.dtype(np.float16), 64, expert_map=emap,
                    E_local=4, ignore_invalid=True)
    got = _run(prob, "v6").astype(np.float64)
    live = np.isfinite(prob["want"]).all(axis=1)
    assert (~live).any() and live.any()
    assert np.isnan(got[~live]).all()
    assert rel_err(got[live], prob["want"][live]) <= TOL[np.dtype(np.float16)]


@gpu
def test_v6_deterministic_and_graph_capturable():
    """No atomics: two calls give the same bits; and a CUDA graph captured around the call
    (after a warm-up that compiles, encodes the tensor map and reads the SM count) replays
    to the same bits, with num_tokens_post_padded read on the device."""
    _need_sm90()
    cp = _cp()
    prob = _problem(300, 8, 2, 384, 512, BF16, 128, mul=True)
    first = _run(prob, "v6")
    assert (first.view(np.uint16) == _run(prob, "v6").view(np.uint16)).all()
    d = prob["dev"]
    out = _poisoned((prob["P"], prob["N"]), prob["dtype"])
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        gg.grouped_gemm(d["a"], d["w"], d["st"], d["ex"], d["nt"], prob["top_k"], prob["B"],
                        d["tw"], True, version="v6", out=out)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    assert (_host(out, BF16).view(np.uint16) == first.view(np.uint16)).all()


# ============================================================================ GPU: end to end
def _stage(name):
    """The CuPy stage when the backend has it, else None (the test then runs it on the host)."""
    try:
        import cuda_kernels.cupy as ck

        return getattr(ck, name)
    except Exception:
        return None


E2E_RUNGS = ([(v, d) for v in ("v2", "v3", "v4") for d in ("fp32", "bf16")]
             + [(v, d) for v in ("v5", "v6") for d in ("fp16", "bf16")])


@gpu
@pytest.mark.parametrize("version,dkey", E2E_RUNGS)
@pytest.mark.parametrize("case", ("plain", "bias_ep"))
def test_fused_experts_end_to_end(version, dkey, case):
    """reference.fused_experts (exact) against: alignment -> GEMM1 (this) -> activation ->
    GEMM2 with the router weight (this) -> moe_sum. The sm_90a rungs (v5, v6) align to their
    own BLOCK_M (a multiple of 64)."""
    hopper = version in ("v5", "v6")
    if hopper:
        _need_sm90()
    dt = DTYPES[dkey]
    T, E, top_k, H, I = 45, 16, 4, 256, 192  # noqa: E741
    rng = rng_for("e2e-wgmma" if hopper else "e2e", version, dkey, case)
    x = uniform(rng, (T, H), 1.0, dt)
    w1 = uniform(rng, (E, 2 * I, H), 1.7 / math.sqrt(H), dt)
    w2 = uniform(rng, (E, H, I), 1.7 / math.sqrt(I), dt)
    ids = distinct_topk_ids(rng, T, E, top_k)
    tw = random_weights(rng, T, top_k)
    emap, b1, b2, E_local = None, None, None, E
    if case == "bias_ep":
        E_local, emap = reference.determine_expert_map(2, 1, E)
        w1, w2 = w1[emap >= 0].copy(), w2[emap >= 0].copy()
        b1 = uniform(rng, (E_local, 2 * I), 0.5, dt)
        b2 = uniform(rng, (E_local, H), 0.5, dt)
    want = reference.fused_experts(x, w1, w2, tw, ids, global_num_experts=E, expert_map=emap,
                                   w1_bias=b1, w2_bias=b2, precision="exact")
    B = gcfg.get_config(T, 2 * I, H, E_local, top_k, dt, version if hopper else None)["BLOCK_M"]
    st, ex, nt = reference.moe_align_block_size(ids, B, E, expert_map=emap)
    d = {k: _dev(v) for k, v in dict(x=x, w1=w1, w2=w2, tw=tw, st=st, ex=ex, nt=nt,
                                         b1=b1, b2=b2).items()}
    c1 = gg.grouped_gemm(d["x"], d["w1"], d["st"], d["ex"], d["nt"], top_k, B, d["tw"], False,
                         d["b1"], version=version)                               # [P, 2I]
    act = _stage("apply_activation")
    if act is not None:
        c2 = act(c1, "silu", True)                                               # [P, I]
    else:
        c2 = _dev(reference.apply_activation(_host(c1, dt), "silu", True))
    c3 = gg.grouped_gemm(c2, d["w2"], d["st"], d["ex"], d["nt"], 1, B, d["tw"], True, d["b2"],
                         version=version)                                        # [P, H]
    msum = _stage("moe_sum")
    if msum is not None:
        out = _host(msum(c3.reshape(T, top_k, H)), dt)
    else:
        out = reference.moe_sum(_host(c3, dt).reshape(T, top_k, H))
    err = rel_err(out, want)
    assert err <= TOL[dt], f"fused experts with {version} ({dkey}): rel err {err:.3e}"


# ============================================================================ GPU: bad input
def _good(dt=np.float16, T=6, E=4, top_k=2, N=64, K=64, B=16):
    prob = _problem(T, E, top_k, N, K, np.dtype(dt), B)
    d = prob["dev"]
    return [d["a"], d["w"], d["st"], d["ex"], d["nt"], top_k, B], prob


@gpu
def test_errors_before_launch():
    cp = _cp()
    args, prob = _good()
    a, w, st, ex, nt, top_k, B = args

    def call(*override, **kw):
        return gg.grouped_gemm(*override, **kw)

    with pytest.raises(TypeError, match="a: expected a cupy.ndarray"):
        call(prob["a"], w, st, ex, nt, top_k, B)
    with pytest.raises(TypeError, match=r"w: expected dtype float16"):
        call(a, w.astype(cp.float32), st, ex, nt, top_k, B)
    with pytest.raises(ValueError, match=r"w: expected shape \[E_local, N, 64\]"):
        call(a, w[:, :, :32].copy(), st, ex, nt, top_k, B)
    with pytest.raises(ValueError, match="a: expected a C-contiguous"):
        call(cp.asfortranarray(a), w, st, ex, nt, top_k, B)
    with pytest.raises(ValueError, match="w: expected a C-contiguous"):
        call(a, w[:, ::2], st, ex, nt, top_k, B)
    with pytest.raises(TypeError, match="sorted_token_ids: expected dtype"):
        call(a, w, st.astype(cp.int64), ex, nt, top_k, B)
    with pytest.raises(ValueError, match="expert_ids: expected length"):
        call(a, w, st, ex[:-1], nt, top_k, B)
    with pytest.raises(ValueError, match=r"bias: expected shape \(4, 64\)"):
        call(a, w, st, ex, nt, top_k, B, bias=cp.zeros((4, 63), cp.float16))
    with pytest.raises(ValueError, match="topk_weights: expected an array"):
        call(a, w, st, ex, nt, top_k, B, None, True)
    with pytest.raises(ValueError, match="topk_weights: expected 12 elements"):
        call(a, w, st, ex, nt, top_k, B, cp.ones(11, cp.float32), True)
    with pytest.raises(TypeError, match="top_k: expected an int"):
        call(a, w, st, ex, nt, 2.0, B)
    with pytest.raises(ValueError, match="version: expected one of"):
        call(a, w, st, ex, nt, top_k, B, version="v9")
    with pytest.raises(ValueError, match="block_size: v4 needs a multiple of 16"):
        st8, ex8, nt8 = (_dev(x) for x in reference.moe_align_block_size(
            np.zeros((6, 2), np.int32) + np.arange(2, dtype=np.int32), 8, 4))
        call(a, w, st8, ex8, nt8, top_k, 8, version="v4")
    with pytest.raises(ValueError, match=r"out: expected shape \(12, 64\)"):
        call(a, w, st, ex, nt, top_k, B, out=cp.empty((12, 63), cp.float16))
    # P = M_a * top_k beyond int32: raised from the sizes alone, nothing is allocated
    with pytest.raises(ValueError, match="int32"):
        call(a, w, st, ex, nt, 2**30, B)


@pytest.mark.multigpu
def test_wrong_device():
    cp = _cp()
    args, _ = _good()
    with cp.cuda.Device(1):
        w1 = cp.asarray(args[1].get())
    with pytest.raises(ValueError, match="w: expected an array on device 0"):
        gg.grouped_gemm(args[0], w1, *args[2:])


def test_cpu_arrays_are_refused_without_cupy_work():
    """Without CuPy (CPU CI) the call fails on the first argument with a clear error."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            gg.grouped_gemm(np.zeros((1, 8), np.float32), None, None, None, None, 1, 16)
        return
    with pytest.raises(TypeError, match="a: expected a cupy.ndarray"):
        gg.grouped_gemm(np.zeros((1, 8), np.float32), None, None, None, None, 1, 16)



# ============================================================================ CPU: emulation
# The kernels themselves, run on the CPU. The .cu text (exactly what NVRTC compiles, from
# _compile.source_text) is compiled by g++ against a small emulator of what the kernels use:
# one OS thread per CUDA thread, CTAs one after another, __syncthreads as a barrier,
# __shared__ as a static, and the five PTX instructions of v4 done in software:
#   cp.async      deferred until the cp.async.wait_group that must complete it (as late as the
#                 hardware may), checked for 16-byte alignment and for reading inside a or w;
#   ldmatrix.x4   a warp barrier, then each lane gathers its pieces of the four 8x8 matrices;
#   mma.m16n8k16  a warp barrier, then each lane computes its accumulators from all 32
#                 lanes' fragments, with the fragment layouts of the PTX ISA.
# This checks the index math, the pipeline's slot rotation and wait counts, the fragment
# layouts and the epilogue on a CPU; timing, real memory ordering and races need the GPU
# (compute-sanitizer runs there).
EMU_HEADER = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <unordered_map>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <utility>
#include <vector>
#define GG_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __grid_constant__
using std::min;
using std::max;

struct EmuDim { unsigned x = 0, y = 0, z = 0; };
thread_local EmuDim threadIdx, blockIdx;
EmuDim blockDim, gridDim;
thread_local int emu_tid;
alignas(1024) unsigned char emu_smem[233472];
long long emu_smem_limit = 0;
// On the GPU the static shared memory (the slots) comes first and the dynamic buffer after
// it, 16-byte aligned only: the emulator starts it 48 bytes in, so a kernel that needs a
// stricter alignment (v5's 1024-byte swizzle atoms) must find it itself, as on the GPU.
#define EMU_SMEM_SHIFT 48
#define GG_DYNAMIC_SMEM(name) unsigned char* name = emu_smem + EMU_SMEM_SHIFT

[[noreturn]] inline void emu_fail(const char* what, long long x) {
    std::fprintf(stderr, "EMULATOR: %s (%lld) in CTA (%u, %u) thread %d\n", what, x, blockIdx.x,
                 blockIdx.y, emu_tid);
    std::fflush(stderr);
    std::_Exit(3);
}

std::barrier<>* emu_cta_bar;
inline void __syncthreads() { emu_cta_bar->arrive_and_wait(); }
template <typename T> inline T __ldg(const T* p) { return *p; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }

// global ranges a cp.async may read: a and w
const unsigned char* emu_lo[2];
const unsigned char* emu_hi[2];

struct EmuCopy { unsigned dst; const unsigned char* src; int bytes; };
thread_local std::vector<EmuCopy> emu_open;
thread_local std::vector<std::vector<EmuCopy>> emu_groups;

// ---- v6's ring: mbarriers, and a checker of the protocol around them. Every 16 bytes of
// shared memory that a copy (cp.async, the tensor-map copy) writes and a wgmma reads carry:
//   the barrier phase its copy completes on (the full barrier, the phase current when the copy
//   landed: a cp.async lands at its thread's cp.async.mbarrier.arrive, a tensor copy at its
//   issue; both as early as the hardware may, so a missing wait cannot hide behind a late copy);
//   the wgmma reads issued on it and not yet released (released at the reader's next
//   mbarrier.arrive after its wgmma.wait_group completed them), and the barrier phase of that
//   release (the empty barrier).
// A wgmma (checked at issue, by lane 0 of each warp: the warpgroup's read) must find every
// piece landed, in a phase its thread has waited for (mbarrier.try_wait), and cp.async's pieces
// behind a fence.proxy.async of that thread after that wait. A copy (checked at issue, when the
// hardware may start writing) must find no unreleased read, and the release in a phase its
// thread has waited for. Either missing wait (consumer on full, producer on empty) fails here
// deterministically, whatever the threads' timing. The checks switch on at the first
// mbarrier.init (v6); the other rungs never use mbarriers.
struct EmuMbar { long gen = 0; int expected = 0, pending = 0; long long tx = 0; long phase = 0; };
struct EmuSeen { long gen = -1, phase = 0, seq = 0; };    // a thread's view of one mbarrier
struct EmuChunk {
    int state = 0;                // 0 never written, 1 a copy in flight, 2 landed
    unsigned bar = 0; long gen = 0, phase = 0; bool generic = false;   // the landing's phase
    int readers = 0;              // wgmma reads issued and not yet released
    bool rel = false; unsigned rel_bar = 0; long rel_gen = 0, rel_phase = 0;   // last release
};
std::mutex emu_mb_m;              // guards the mbarriers and the chunks
std::condition_variable emu_mb_cv;
std::unordered_map<unsigned, EmuMbar> emu_mbars;
long emu_mb_gen = 0;
bool emu_ring_checks = false;
EmuChunk emu_chunks[sizeof(emu_smem) / 16];
thread_local std::unordered_map<unsigned, EmuSeen> emu_seen;
thread_local long emu_seq = 0, emu_fence_seq = -1;
thread_local std::vector<unsigned> emu_read_done;   // chunks of completed, unreleased reads

inline EmuMbar& emu_mbar(unsigned bar) {   // (under emu_mb_m)
    auto it = emu_mbars.find(bar);
    if (it == emu_mbars.end()) emu_fail("mbarrier used before mbarrier.init", bar);
    return it->second;
}
inline bool emu_seen_past(unsigned bar, long gen, long phase) {   // waited past `phase`?
    auto it = emu_seen.find(bar);
    return it != emu_seen.end() && it->second.gen == gen && it->second.phase > phase;
}
inline void emu_check_write(unsigned off, const char* who) {   // (under emu_mb_m)
    EmuChunk& c = emu_chunks[off / 16];
    if (c.readers > 0) {
        std::fprintf(stderr, "EMULATOR: %s overwrites shared memory that an issued wgmma has "
                     "not released (a missing wait on the empty barrier?)\n", who);
        emu_fail("write while read", off);
    }
    if (c.rel && !emu_seen_past(c.rel_bar, c.rel_gen, c.rel_phase)) {
        std::fprintf(stderr, "EMULATOR: %s overwrites shared memory released in an empty-barrier "
                     "phase this thread has not waited for\n", who);
        emu_fail("write before the release is observed", off);
    }
    c.state = 1;
}
inline void emu_land(unsigned off, unsigned bar, const EmuMbar& m, bool generic) {
    EmuChunk& c = emu_chunks[off / 16];
    c.state = 2; c.bar = bar; c.gen = m.gen; c.phase = m.phase; c.generic = generic;
}
inline void emu_mbar_complete(EmuMbar& m) {   // (under emu_mb_m)
    if (m.pending == 0 && m.tx == 0) {
        ++m.phase;
        m.pending = m.expected;
        emu_mb_cv.notify_all();
    }
}
inline void emu_mbar_arrive_locked(unsigned bar, EmuMbar& m) {
    if (m.pending <= 0) emu_fail("mbarrier: arrival with no pending count", bar);
    --m.pending;
    emu_mbar_complete(m);
}

inline unsigned gg_smem_addr(const void* p) {
    return (unsigned)((const unsigned char*)p - emu_smem);
}
inline void gg_cp_async16(unsigned dst, const void* src, int src_bytes) {
    const unsigned char* s = (const unsigned char*)src;
    if (dst % 16) emu_fail("cp.async: shared destination not 16-byte aligned", dst);
    if (dst + 16 > emu_smem_limit) emu_fail("cp.async: past the dynamic shared memory", dst);
    if (dst < EMU_SMEM_SHIFT) emu_fail("cp.async: before the dynamic shared memory", dst);
    if (src_bytes != 0 && src_bytes != 16) emu_fail("cp.async: src-size not 0 or 16", src_bytes);
    if (src_bytes) {
        if ((uintptr_t)s % 16)
            emu_fail("cp.async: global source not 16-byte aligned", (long long)(uintptr_t)s);
        bool inside = false;
        for (int i = 0; i < 2; ++i) inside |= s >= emu_lo[i] && s + 16 <= emu_hi[i];
        if (!inside) emu_fail("cp.async: reads outside a and w", (long long)(uintptr_t)s);
    }
    if (emu_ring_checks) {
        std::lock_guard<std::mutex> l(emu_mb_m);
        emu_check_write(dst, "cp.async");
    }
    emu_open.push_back({dst, s, src_bytes});
}
inline void gg_cp_async_commit() { emu_groups.push_back(std::move(emu_open)); emu_open.clear(); }
template <int PENDING> inline void gg_cp_async_wait() {
    if (!emu_open.empty()) emu_fail("cp.async.wait_group with uncommitted copies", emu_open.size());
    while ((int)emu_groups.size() > PENDING) {
        for (const EmuCopy& c : emu_groups.front()) {
            std::memset(emu_smem + c.dst, 0, 16);
            if (c.bytes) std::memcpy(emu_smem + c.dst, c.src, 16);
        }
        emu_groups.erase(emu_groups.begin());
    }
}

struct EmuWarp {
    std::barrier<> bar{32};
    unsigned addr[32]; unsigned a[32][4]; unsigned b[32][2]; unsigned vote[32];
};
EmuWarp* emu_warps;

// A warp vote, global atomics and fences (for a kernel whose CTAs meet through counters, as a
// split-K reduction's do). CTAs run one after another here (in an order the test may shuffle),
// so a global atomic needs no more than a lock; fences and the .cg loads and stores are plain
// memory operations.
inline unsigned __ballot_sync(unsigned mask, int pred) {
    if (mask != 0xffffffffu) emu_fail("__ballot_sync: only full-warp votes are emulated", mask);
    EmuWarp& w = emu_warps[emu_tid / 32];
    w.vote[emu_tid % 32] = pred ? 1u : 0u;
    w.bar.arrive_and_wait();
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= w.vote[i] << i;
    w.bar.arrive_and_wait();
    return r;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
std::mutex emu_atomic_lock;
inline int atomicAdd(int* p, int v) {
    std::lock_guard<std::mutex> l(emu_atomic_lock);
    const int old = *p;
    *p = old + v;
    return old;
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <typename T> inline T __ldcg(const T* p) { return *p; }
template <typename T> inline void __stcg(T* p, T v) { *p = v; }

inline void gg_ldsm_x4(unsigned* r, unsigned addr) {
    EmuWarp& w = emu_warps[emu_tid / 32];
    const int lane = emu_tid % 32;
    if (addr % 16) emu_fail("ldmatrix: row address not 16-byte aligned", addr);
    if (addr + 16 > emu_smem_limit) emu_fail("ldmatrix: past the dynamic shared memory", addr);
    w.addr[lane] = addr;
    w.bar.arrive_and_wait();
    for (int j = 0; j < 4; ++j)   // lane gets row lane/4, columns 2(lane%4).. of matrix j
        std::memcpy(&r[j], emu_smem + w.addr[8 * j + lane / 4] + (lane % 4) * 4, 4);
    w.bar.arrive_and_wait();
}

inline float emu_f32(float h) { return h; }
inline float emu_f32(__half h) { return __half2float(h); }
inline float emu_f32(__nv_bfloat16 h) { return __bfloat162float(h); }

template <typename H> inline void emu_mma(float* d, const unsigned* a, const unsigned* b) {
    EmuWarp& w = emu_warps[emu_tid / 32];
    const int lane = emu_tid % 32;
    std::memcpy(w.a[lane], a, 16);
    std::memcpy(w.b[lane], b, 8);
    w.bar.arrive_and_wait();
    auto half_of = [](unsigned reg, int k) {
        H h[2];
        std::memcpy(h, &reg, 4);
        return emu_f32(h[k % 2]);
    };
    // A 16x16 row-major: a0 (g, 2q..), a1 (g+8, 2q..), a2 (g, 2q+8..), a3 (g+8, 2q+8..)
    auto A = [&](int r, int k) {
        return half_of(w.a[(r % 8) * 4 + (k % 8) / 2][(r / 8) + 2 * (k / 8)], k);
    };
    // B 16x8 "col": b0 (k 2q.., n g), b1 (k 2q+8.., n g)
    auto B = [&](int k, int n) { return half_of(w.b[n * 4 + (k % 8) / 2][k / 8], k); };
    const int g = lane / 4, q = lane % 4;
    for (int i = 0; i < 4; ++i) {    // d0 (g, 2q), d1 (g, 2q+1), d2 (g+8, 2q), d3 (g+8, 2q+1)
        const int r = g + 8 * (i / 2), n = 2 * q + (i % 2);
        float s = 0.0f;
        for (int k = 0; k < 16; ++k) s += A(r, k) * B(k, n);
        d[i] += s;
    }
    w.bar.arrive_and_wait();
}
inline void gg_mma(float* d, const unsigned* a, const unsigned* b, __half*) {
    emu_mma<__half>(d, a, b);
}
inline void gg_mma(float* d, const unsigned* a, const unsigned* b, __nv_bfloat16*) {
    emu_mma<__nv_bfloat16>(d, a, b);
}

// wgmma (v5): each thread computes its own accumulators from the two shared-memory
// descriptors, when the wgmma.wait_group that must complete the batch runs (as late as the
// hardware may read the operands). K-major layouts, as the PTX ISA's matrix descriptor:
//   no swizzle (type 0): element (r, k) at start + (r/8) SBO + (k/8) LBO + (r%8) 16 + (k%8) 2;
//   swizzle W = 128/64/32 bytes (type 1/2/3): rows of W bytes, element (r, k) at the address
//     A = start + (r/8) SBO + (r%8) W + 2k, then bits [4, 4+log2(W/16)) of A XORed with
//     bits [7, ...) of A (absolute addresses: the atoms must be 1024-byte aligned, base
//     offset 0); a k16 slice must stay inside one W-byte row.
inline void wg_fence_proxy_async() { emu_fence_seq = ++emu_seq; }
// wgmma.fence / wait_group are .sync.aligned: the warp's lanes execute them together (the
// threads of the emulator run freely otherwise: v6's consumer lanes, which each spin on an
// mbarrier, converge here, and a wait_group returns once every lane's share of the batches it
// completes has read its operands: then lane 0 arrives on the empty barrier for all of them)
inline void emu_warp_converge() { emu_warps[emu_tid / 32].bar.arrive_and_wait(); }
inline void wg_fence() { emu_warp_converge(); }
struct EmuWgmma { float* d; unsigned long long da, db; int n; std::vector<unsigned> chunks; };
thread_local std::vector<EmuWgmma> emu_wg_open;
thread_local std::vector<std::vector<EmuWgmma>> emu_wg_groups;
inline unsigned emu_operand_offset(unsigned long long desc, int r, int k) {
    const int type = (int)(desc >> 62);
    if (((desc >> 49) & 7) != 0) emu_fail("wgmma: base offset != 0 is not emulated", 0);
    if (((desc >> 46) & 7) != 0 || ((desc >> 52) & 0x3FF) != 0 || ((desc >> 14) & 3) != 0 ||
        ((desc >> 30) & 3) != 0)
        emu_fail("wgmma: reserved descriptor bits set", (long long)(desc >> 32));
    const unsigned start = (unsigned)(desc & 0x3FFF) << 4;
    const unsigned lbo = (unsigned)((desc >> 16) & 0x3FFF) << 4;
    const unsigned sbo = (unsigned)((desc >> 32) & 0x3FFF) << 4;
    unsigned off;
    if (type == 0) {
        off = start + (r / 8) * sbo + (k / 8) * lbo + (r % 8) * 16 + (k % 8) * 2;
    } else {
        const unsigned W = type == 1 ? 128u : (type == 2 ? 64u : 32u);
        if (sbo != 8 * W) emu_fail("wgmma: swizzled K-major tile with SBO != 8 rows", sbo);
        if ((start % W) + 32 > W)
            emu_fail("wgmma: k16 slice not inside one swizzled row", start);
        const unsigned A = start + (r / 8) * sbo + (r % 8) * W + k * 2;
        off = A ^ (((A >> 7) & (W / 16 - 1)) << 4);
    }
    if (start % 16) emu_fail("wgmma: descriptor start not 16-byte aligned", start);
    if (off + 2 > emu_smem_limit) emu_fail("wgmma: operand past the dynamic shared memory", off);
    if (off < EMU_SMEM_SHIFT) emu_fail("wgmma: operand before the dynamic shared memory", off);
    return off;
}
inline float emu_operand(unsigned long long desc, int r, int k) {
    const unsigned off = emu_operand_offset(desc, r, k);
    GG_T h;
    std::memcpy(&h, emu_smem + off, sizeof(h));
    return emu_f32(h);
}
inline void emu_wgmma_run(const EmuWgmma& m) {
    const int t = emu_tid % 128, wq = t / 32, lane = t % 32, g = lane / 4, q = lane % 4;
    for (int j = 0; j < m.n / 8; ++j)
        for (int i = 0; i < 4; ++i) {   // d[4j+i]: row 16 wq + g (+8), column 8j + 2q (+1)
            const int r = wq * 16 + g + 8 * (i / 2), n = j * 8 + 2 * q + (i % 2);
            float s = 0.0f;
            for (int k = 0; k < 16; ++k) s += emu_operand(m.da, r, k) * emu_operand(m.db, n, k);
            m.d[4 * j + i] += s;
        }
    emu_read_done.insert(emu_read_done.end(), m.chunks.begin(), m.chunks.end());
}
// the 16-byte pieces a wgmma reads (A: 64 rows, B: n rows, 16 k each), checked (see above)
inline void emu_track_reads(EmuWgmma& m) {
    for (int r = 0; r < 64; ++r)
        for (int k = 0; k < 16; k += 8) m.chunks.push_back(emu_operand_offset(m.da, r, k) / 16);
    for (int r = 0; r < m.n; ++r)
        for (int k = 0; k < 16; k += 8) m.chunks.push_back(emu_operand_offset(m.db, r, k) / 16);
    std::sort(m.chunks.begin(), m.chunks.end());
    m.chunks.erase(std::unique(m.chunks.begin(), m.chunks.end()), m.chunks.end());
    std::lock_guard<std::mutex> l(emu_mb_m);
    for (unsigned ci : m.chunks) {
        EmuChunk& c = emu_chunks[ci];
        if (c.state != 2)
            emu_fail("wgmma reads shared memory no copy has landed in (a missing wait on the "
                     "full barrier?)", ci * 16);
        if (!emu_seen_past(c.bar, c.gen, c.phase))
            emu_fail("wgmma reads a copy whose full-barrier phase this thread has not waited "
                     "for", ci * 16);
        if (c.generic && emu_fence_seq < emu_seen[c.bar].seq)
            emu_fail("wgmma reads cp.async data with no fence.proxy.async after the wait", ci * 16);
        ++c.readers;
    }
}
inline void wg_commit() {
    emu_wg_groups.push_back(std::move(emu_wg_open));
    emu_wg_open.clear();
}
template <int PENDING> inline void wg_wait() {
    emu_warp_converge();
    if (!emu_wg_open.empty()) emu_fail("wgmma.wait_group with uncommitted wgmma", 0);
    while ((int)emu_wg_groups.size() > PENDING) {
        for (const EmuWgmma& m : emu_wg_groups.front()) emu_wgmma_run(m);
        emu_wg_groups.erase(emu_wg_groups.begin());
    }
    emu_warp_converge();    // every lane's share of the completed batches has read its operands
}
#define EMU_WGMMA(N)                                                                      \
    inline void gg_wgmma_n##N(float* d, unsigned long long da, unsigned long long db) {   \
        EmuWgmma m{d, da, db, N, {}};                                                     \
        if (emu_ring_checks && emu_tid % 32 == 0) emu_track_reads(m);                     \
        emu_wg_open.push_back(std::move(m));                                              \
    }
EMU_WGMMA(64)
EMU_WGMMA(128)
EMU_WGMMA(256)

#ifndef EMU_WAIT_S
#define EMU_WAIT_S 120      // a wait this long is a deadlock
#endif
// mbarriers (v6): a pending count and a transaction count; a phase completes when both are
// zero, and a try_wait.parity(p) returns once the phase of parity p is over (the current
// phase's parity differs from p). Shared addresses are offsets into emu_smem.
inline void gg_mbar_init(unsigned bar, unsigned count) {
    std::lock_guard<std::mutex> l(emu_mb_m);
    if (bar % 8) emu_fail("mbarrier.init: not 8-byte aligned", bar);
    if (bar + 8 > emu_smem_limit || bar < EMU_SMEM_SHIFT)
        emu_fail("mbarrier.init: outside the dynamic shared memory", bar);
    for (EmuChunk& c : emu_chunks) c = EmuChunk{};   // a new CTA's ring: nothing landed or read
    emu_ring_checks = true;
    EmuMbar& m = emu_mbars[bar];
    m.gen = ++emu_mb_gen;
    m.expected = m.pending = (int)count;
    m.tx = 0;
    m.phase = 0;
}
inline void gg_fence_mbar_init() {}
inline void gg_mbar_arrive(unsigned bar) {
    std::lock_guard<std::mutex> l(emu_mb_m);
    EmuMbar& m = emu_mbar(bar);
    for (unsigned ci : emu_read_done) {   // this thread's completed reads are released here
        EmuChunk& c = emu_chunks[ci];
        --c.readers;
        c.rel = true; c.rel_bar = bar; c.rel_gen = m.gen; c.rel_phase = m.phase;
    }
    emu_read_done.clear();
    emu_mbar_arrive_locked(bar, m);
}
inline void gg_mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    std::lock_guard<std::mutex> l(emu_mb_m);
    EmuMbar& m = emu_mbar(bar);
    m.tx += bytes;
    emu_mbar_arrive_locked(bar, m);
}
inline void gg_mbar_wait(unsigned bar, unsigned parity) {
    std::unique_lock<std::mutex> l(emu_mb_m);
    EmuMbar* m = &emu_mbar(bar);
    if (!emu_mb_cv.wait_for(l, std::chrono::seconds(EMU_WAIT_S),
                            [&] { return (unsigned)(m->phase & 1) != (parity & 1u); })) {
        std::fprintf(stderr, "EMULATOR: waiting for parity %u of the mbarrier at %u: %ld phases "
                     "completed, %d arrivals and %lld bytes pending\n", parity, bar, m->phase,
                     m->pending, m->tx);
        emu_fail("mbarrier.try_wait: no phase completed in time (a deadlock)", bar);
    }
    EmuSeen& s = emu_seen[bar];
    if (s.gen != m->gen) s = EmuSeen{m->gen, 0, 0};
    s.phase = std::max(s.phase, m->phase);
    s.seq = ++emu_seq;
}
// cp.async.mbarrier.arrive.noinc: this thread's copies land (now, as early as allowed once
// they were issued), then its arrival counts
inline void gg_cp_async_mbar_arrive(unsigned bar) {
    std::lock_guard<std::mutex> l(emu_mb_m);
    EmuMbar& m = emu_mbar(bar);
    emu_groups.push_back(std::move(emu_open));
    emu_open.clear();
    for (const auto& g : emu_groups)
        for (const EmuCopy& c : g) {
            std::memset(emu_smem + c.dst, 0, 16);
            if (c.bytes) std::memcpy(emu_smem + c.dst, c.src, 16);
            emu_land(c.dst, bar, m, true);
        }
    emu_groups.clear();
    emu_mbar_arrive_locked(bar, m);
}
inline void gg_cp_async_wait_all() {
    gg_cp_async_commit();
    gg_cp_async_wait<0>();
}
// cp.async.bulk.tensor.3d with an emulated CUtensorMap (EMU_MAIN fills it from the launcher's
// v6_tensor_map_fields): words[0] the global base, [1..3] dims (innermost first), [4..5] the
// strides of dims 1 and 2 in bytes, [6..8] the box, [9] element bytes, [10] swizzle bytes
// (128: 16-byte chunk bits [4, 7) XORed with address bits [7, 10), the destination 1024-byte
// aligned), [11] a magic word. Out-of-bounds elements are zeros; the box's bytes count down
// the barrier's transactions (all of them, filled or not, as on the hardware).
inline void gg_tma_load_3d(unsigned dst, const void* map, int c0, int c1, int c2, unsigned bar) {
    const unsigned long long* v = static_cast<const unsigned long long*>(map);
    if (v[11] != 0x7E45A0C0FFEEull) emu_fail("tensor copy: not an emulated tensor map", 0);
    const unsigned char* base = reinterpret_cast<const unsigned char*>(v[0]);
    const long long dim[3] = {(long long)v[1], (long long)v[2], (long long)v[3]};
    const long long stride[3] = {0, (long long)v[4], (long long)v[5]};   // (dim 0: elements)
    const int box[3] = {(int)v[6], (int)v[7], (int)v[8]};
    const int elem = (int)v[9], sw = (int)v[10];
    const long long row_bytes = (long long)box[0] * elem;
    if (sw != 128 || row_bytes > sw || row_bytes % 16)
        emu_fail("tensor copy: the box's inner extent must be a multiple of 16 bytes <= the "
                 "128-byte swizzle", row_bytes);
    if (dst % 1024) emu_fail("tensor copy: 128-byte swizzle needs a 1024-byte aligned box", dst);
    const long long bytes = row_bytes * box[1] * box[2];
    if (dst < EMU_SMEM_SHIFT || dst + bytes > emu_smem_limit)
        emu_fail("tensor copy: box outside the dynamic shared memory", dst);
    std::lock_guard<std::mutex> l(emu_mb_m);
    EmuMbar& m = emu_mbar(bar);
    for (int z = 0; z < box[2]; ++z)
        for (int y = 0; y < box[1]; ++y)
            for (long long x = 0; x < row_bytes; x += 16) {
                const unsigned lin = (unsigned)(((long long)z * box[1] + y) * row_bytes + x);
                const unsigned o = dst + (lin ^ (((lin >> 7) & 7) << 4));
                emu_check_write(o, "the tensor copy");
                for (int b = 0; b < 16; b += elem) {
                    const long long i0 = c0 + (x + b) / elem, i1 = c1 + y, i2 = c2 + z;
                    unsigned char* d = emu_smem + o + b;
                    if (i0 < 0 || i0 >= dim[0] || i1 < 0 || i1 >= dim[1] || i2 < 0 || i2 >= dim[2])
                        std::memset(d, 0, elem);
                    else
                        std::memcpy(d, base + i0 * elem + i1 * stride[1] + i2 * stride[2], elem);
                }
                emu_land(o, bar, m, false);
            }
    m.tx -= bytes;
    emu_mbar_complete(m);
}
// bar.sync id, count: one std::barrier per (id, count), reused CTA after CTA
inline void gg_bar_named(int id, int count) {
    static std::mutex mu;
    static std::unordered_map<long, std::barrier<>*> bars;
    std::barrier<>* b;
    {
        std::lock_guard<std::mutex> l(mu);
        auto& slot = bars[(long)id << 20 | count];
        if (!slot) slot = new std::barrier<>(count);
        b = slot;
    }
    b->arrive_and_wait();
}
template <int R> inline void gg_setmaxnreg_dec() {}
template <int R> inline void gg_setmaxnreg_inc() {}
"""

EMU_MAIN = r"""
// ---- the launcher: argv[1] = input file (header, then the arrays), argv[2] = output file (c,
// then the extra arrays). Extra kernel arguments (v6's tensor map): up to two arrays, passed
// after the common ones by GG_EMU_EXTRA_ARGS, then up to two ints.
unsigned char* emu_x[2];
int emu_xi[2];
#ifndef GG_EMU_EXTRA_ARGS
#define GG_EMU_EXTRA_ARGS
#endif
#ifdef GG_KERNEL_TAKES_TMAP
// v6's CUtensorMap, emulated: w's base address, then the words of the launcher's
// v6_tensor_map_fields (the first extra array, _emu_tensor_map), then EMU_HEADER's magic word
GgTmap emu_tmap() {
    GgTmap m{};
    m.words[0] = (unsigned long long)(uintptr_t)emu_lo[1];
    std::memcpy(&m.words[1], emu_x[0], 10 * 8);
    m.words[11] = 0x7E45A0C0FFEEull;
    return m;
}
#endif
int main(int argc, char** argv) {
    FILE* f = std::fopen(argv[1], "rb");
    long long h[32];
    if (std::fread(h, 8, 32, f) != 32) return 2;
    const int N = h[0], Kd = h[1], P = h[2], top_k = h[3], B = h[4], L = h[5], mul = h[6],
              bias_kind = h[7], gx = h[8], gy = h[9], bx = h[10], by = h[11];
    emu_smem_limit = EMU_SMEM_SHIFT + h[12];   // the dynamic buffer's end
    // byte sizes of a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights,
    // bias, c
    const long long* nbytes = h + 13;
    std::vector<std::vector<unsigned char>> buf(7);
    for (int i = 0; i < 7; ++i) {
        buf[i].resize(nbytes[i] + 16);
        if (nbytes[i] && std::fread(buf[i].data(), 1, nbytes[i], f) != (size_t)nbytes[i]) return 2;
    }
    for (int i = 0; i < 2; ++i) {
        emu_lo[i] = buf[i].data();
        emu_hi[i] = buf[i].data() + nbytes[i];
    }
    const size_t cbytes = nbytes[7], guard = 4096;
    std::vector<unsigned char> cbuf(cbytes + 2 * guard, 0xAB);   // canaries on both sides
    unsigned char* c = cbuf.data() + guard;
    if (cbytes && std::fread(c, 1, cbytes, f) != cbytes) return 2;   // the caller's c (poisoned)
    // h[21] gz, h[22] CTA order seed (0: x fastest, then y, then z), h[23] extra arrays,
    // h[24..25] their bytes, h[26..27] extra ints
    const int gz = h[21] > 0 ? (int)h[21] : 1, n_extra = (int)h[23];
    std::vector<std::vector<unsigned char>> xbuf(2);
    for (int i = 0; i < 2; ++i) {
        xbuf[i].assign((i < n_extra ? h[24 + i] : 16) + 2 * guard, 0xAB);
        emu_x[i] = xbuf[i].data() + guard;
        if (i < n_extra && h[24 + i] &&
            std::fread(emu_x[i], 1, h[24 + i], f) != (size_t)h[24 + i]) return 2;
        emu_xi[i] = (int)h[26 + i];
    }
    std::fclose(f);
    std::vector<EmuDim> order;
    for (int cz = 0; cz < gz; ++cz)
        for (int cy = 0; cy < gy; ++cy)
            for (int cx = 0; cx < gx; ++cx)
                order.push_back({(unsigned)cx, (unsigned)cy, (unsigned)cz});
    if (h[22]) {
        std::mt19937 gen((unsigned)h[22]);
        std::shuffle(order.begin(), order.end(), gen);
    }
    const int nthreads = bx * by;
    std::barrier<> cta_bar(nthreads);
    emu_cta_bar = &cta_bar;
    emu_warps = new EmuWarp[(nthreads + 31) / 32];
    blockDim = {(unsigned)bx, (unsigned)by, 1};
    gridDim = {(unsigned)gx, (unsigned)gy, (unsigned)gz};
    std::vector<std::thread> ts;
    for (int t = 0; t < nthreads; ++t) {
        ts.emplace_back([&, t] {
            emu_tid = t;
            threadIdx = {(unsigned)(t % bx), (unsigned)(t / bx), 0};
            for (const EmuDim& cta : order) {
                blockIdx = cta;
                GG_KERNEL_NAME((const GG_T*)buf[0].data(), (const GG_T*)buf[1].data(), (GG_T*)c,
                               (const int*)buf[2].data(), (const int*)buf[3].data(),
                               (const int*)buf[4].data(), (const float*)buf[5].data(),
                               (const void*)buf[6].data(), N, Kd, P, top_k, B, L, mul,
                               bias_kind GG_EMU_EXTRA_ARGS);
                if (!emu_open.empty() || !emu_groups.empty())
                    emu_fail("a CTA ended with cp.async copies never waited for",
                             emu_groups.size());
                if (!emu_wg_open.empty() || !emu_wg_groups.empty())
                    emu_fail("a CTA ended with wgmma batches never waited for",
                             emu_wg_groups.size());
                if (!emu_read_done.empty())
                    emu_fail("a CTA ended with wgmma reads never released on a barrier",
                             emu_read_done.size());
                cta_bar.arrive_and_wait();
            }
        });
    }
    for (auto& t : ts) t.join();
    for (size_t i = 0; i < guard; ++i)
        if (cbuf[i] != 0xAB || cbuf[guard + cbytes + i] != 0xAB) {
            std::fprintf(stderr, "EMULATOR: write outside c\n");
            return 4;
        }
    for (int x = 0; x < n_extra; ++x)
        for (size_t i = 0; i < guard; ++i)
            if (xbuf[x][i] != 0xAB || xbuf[x][guard + h[24 + x] + i] != 0xAB) {
                std::fprintf(stderr, "EMULATOR: write outside extra array %d\n", x);
                return 4;
            }
    FILE* o = std::fopen(argv[2], "wb");
    std::fwrite(c, 1, cbytes, o);
    for (int x = 0; x < n_extra; ++x) std::fwrite(emu_x[x], 1, h[24 + x], o);
    std::fclose(o);
    return 0;
}
"""


def _cuda_headers():
    for d in C.cuda_include_dirs():
        if (pathlib.Path(d) / "cuda_fp16.h").is_file():
            return d
    return None


_GXX = shutil.which("g++")
_HDR = _cuda_headers()
emulated = pytest.mark.skipif(_GXX is None or _HDR is None,
                              reason="needs g++ and the CUDA headers (cuda_fp16.h)")


EMU_FLAGS: list = []     # more g++ flags (-DEMU_WAIT_S=10: a shorter deadlock timeout)

# the arguments a kernel takes after GG_KERNEL_ARGS, as the emulator's main passes them
EMU_EXTRA_ARGS = {"gemm_v6_tma_ws.cu": ", emu_tmap()"}


@functools.lru_cache(maxsize=None)
def _emu_binary(cu, kernel_name, define_items):
    """g++ build of one kernel instantiation under the emulator (cached per process)."""
    # the emulator goes between the #defines (it needs GG_T) and the kernel file
    text = C.source_text(cu, dict(define_items))
    cut = text.index(f'#line 1 "{cu}"')
    extra = EMU_EXTRA_ARGS.get(cu)
    src = (text[:cut] + EMU_HEADER + "\n" + text[cut:] + "\n"
           + f"#define GG_KERNEL_NAME {kernel_name}\n"
           + (f"#define GG_EMU_EXTRA_ARGS {extra}\n" if extra else "") + EMU_MAIN)
    out_dir = pathlib.Path(tempfile.mkdtemp(prefix="gg_emu_"))
    cpp = out_dir / "k.cpp"
    cpp.write_text(src)
    exe = out_dir / "k"
    res = subprocess.run([_GXX, "-std=c++20", "-O1", "-pthread", "-w", *EMU_FLAGS, f"-I{_HDR}", str(cpp),
                          "-o", str(exe)], capture_output=True, text=True)
    assert res.returncode == 0, f"g++ failed for {cu} {define_items}:\n{res.stderr[-3000:]}"
    return exe


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
    """v6's tensor map as the emulator takes it (EMU_HEADER's gg_tma_load_3d): the words of
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
    """_problem without the device copies (the emulator reads host arrays)."""
    global _dev
    keep = _dev
    _dev = lambda a: None  # noqa: E731
    try:
        return _problem(T, E, top_k, N, K, dtype, B, **kw)
    finally:
        _dev = keep


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
    # v6 (TMA + cp.async, mbarrier ring, warp-specialized, persistent over EMU_SMS = 3 CTAs),
    # its ring protocol checked as it runs (EMU_HEADER): one consumer (BLOCK_M 64), two
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
    # block_size 128 with 64-row tiles: two tiles of one alignment block
    "v6_block128_tile64": ("v6", "bf16", dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, warps=8,
                                              stages=4, GROUP_M=8, PRODUCER_REGS=56),
                           (90, 4, 2, 136, 72, 128), dict(mul=True)),
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
@emulated
@pytest.mark.parametrize("case", tuple(EMU_CASES))
def test_kernel_on_cpu_emulator(case):
    version, dkey, cfg, args, kw = EMU_CASES[case]
    T, E, top_k, N, K, B = args
    dt = DTYPES[dkey]
    kw = dict(kw)
    if kw.get("bias") == "same":
        kw["bias"] = dt
    if kw.pop("expert_map", False):
        E_local, emap = reference.determine_expert_map(2, 1, E)
        kw.update(expert_map=emap, E_local=E_local)
    prob = _host_problem(T, E, top_k, N, K, dt, B, **kw)
    got = _emulate(prob, version, cfg)
    err = rel_err(got, prob["want"])
    assert err <= TOL[dt], f"{case}: relative error {err:.3e} (NaN rows: " \
                           f"{int(np.isnan(got.astype(np.float64)).any(1).sum())})"


# ---------------------------------------------------------------------------- the launcher too
class _FakeArray(np.ndarray):
    """A NumPy array that answers the few CuPy attributes the launcher reads."""

    @property
    def device(self):
        return types.SimpleNamespace(id=0)

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def get(self):
        return np.asarray(self)


class _FakeDevice:
    compute_capability = "90"                               # (v5 / v6 check it)

    def __init__(self, dev=0):
        self.id = dev
        self.attributes = {"MultiProcessorCount": EMU_SMS}  # v6's persistent grid

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _fake_empty(shape, dtype=np.float32):
    """np.empty, poisoned: NaN for floats, 0x5A bytes otherwise (nothing may read it unwritten)."""
    out = np.empty(shape, dtype)
    out.view(np.uint8)[...] = 0xFF if np.dtype(dtype).kind == "f" else 0x5A
    return out.view(_FakeArray)


def _fake_cupy():
    fake = types.ModuleType("cupy")
    fake.ndarray = _FakeArray
    fake.asarray = lambda x, dtype=None: np.array(x, dtype=dtype).view(_FakeArray)
    fake.empty = _fake_empty
    fake.zeros = lambda shape, dtype=np.float32: np.zeros(shape, dtype).view(_FakeArray)
    fake.ascontiguousarray = lambda x: np.ascontiguousarray(x).view(_FakeArray)
    for name in ("uint8", "uint16", "uint32", "int32", "float16", "float32"):
        setattr(fake, name, getattr(np, name))
    fake.cuda = types.SimpleNamespace(
        Device=_FakeDevice,
        runtime=types.SimpleNamespace(getDeviceProperties=lambda dev: {"name": b"CPU emulator"}))
    return fake


class _EmuKernel:
    def __init__(self, cu, name, defines, order_seed=0):
        self.exe = _emu_binary(cu, name, tuple(sorted(defines.items())))
        self.launches = []
        self.order_seed = order_seed

    def __call__(self, grid, block, args, shared_mem=0):
        _emu_launch(self.exe, grid, block, shared_mem, args, self.order_seed)
        self.launches.append((grid, block, shared_mem))


@pytest.mark.slow
@emulated
@pytest.mark.parametrize("case", ("v4_bf16_bias_weights_out", "default_fp16_k100", "v3_fp32_gemm2",
                                  "v6_bf16_bias_weights_out", "v6_fp16_gemm2_block128"))
def test_launcher_on_cpu_emulator(case, monkeypatch):
    """grouped_gemm() itself (checks, config, geometry, the argument tuple) with CuPy replaced
    by NumPy-backed arrays and the kernel by its emulated build (v6: extra_args' tensor map
    from the fields the launcher would encode, the SM count of the fake device)."""
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
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
    dev = {k: None if v is None else np.ascontiguousarray(v).view(_FakeArray)
           for k, v in prob.items() if k in ("a", "w", "st", "ex", "nt", "tw", "bias")}
    out = None
    if version in ("v4", "v6"):
        out = np.full((prob["P"], prob["N"]), np.nan, prob["dtype"]).view(_FakeArray)
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


# ---------------------------------------------------------------------------- decode_bench's host
def _numpy_as_cupy():
    """NumPy behind CuPy's names (what decode_bench and tune's helpers call), CUDA events on
    the host clock, an H100 as the device."""
    fake = types.ModuleType("cupy")
    fake.__getattr__ = lambda name: getattr(np, name)
    fake.ndarray = np.ndarray

    class Event:
        t = 0.0

        def record(self):
            self.t = __import__("time").perf_counter()

        def synchronize(self):
            pass

    fake.cuda = types.SimpleNamespace(
        Event=Event, get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3 + 1e-3,
        Device=lambda *a: types.SimpleNamespace(id=0),
        runtime=types.SimpleNamespace(getDeviceProperties=lambda d: {
            "name": b"NVIDIA H100 80GB HBM3"}))
    fake.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    return fake


@pytest.mark.slow
def test_decode_bench_host_logic(monkeypatch):
    """decode_bench end to end on the host at decode: routings, alignment per block size (v4
    at 16, v5 at 64), the check against v4, timing plumbing, GB/s and floor columns, --sweep
    adding nothing without v6, and the layer totals; the GEMM itself is the reference, each
    config checked."""
    monkeypatch.setitem(sys.modules, "cupy", _numpy_as_cupy())
    calls = []

    def fake_gemm(a, w, st, ex, nt, top_k, B, tw, mul, *, version, config, out):
        dkey = gcfg.dtype_key(a.dtype)
        cfg = gcfg.get_config(1, w.shape[1], w.shape[2], w.shape[0], 1, a.dtype, version) \
            if config is None else config
        gcfg.fit_config(version, dkey, {k: v for k, v in cfg.items() if k != "version"}, B)
        calls.append((version, B))
        c = reference.grouped_gemm(a.astype(np.float32), w.astype(np.float32), st, ex, nt,
                                   top_k, B, tw, mul)
        out[...] = c.astype(out.dtype)
        return out

    monkeypatch.setattr(gg, "grouped_gemm", fake_gemm)
    lines = []
    res = tune.decode_bench(sys.modules["cupy"], {"tiny": ("Tiny-MoE", 8, 2, 64, 32)}, (1, 5),
                          ("v4", "v5"), reps=3, sweep=True, log=lines.append)
    text = "\n".join(lines)
    assert "3.35 TB/s" in lines[0] and "FAIL" not in text and "skip" not in text, text
    assert "card: NVIDIA H100 80GB HBM3" in lines[0]
    per_gemm = [r for r in res if r["gemm"] != "layer"]
    assert all(r["ok"] and r["rel_err"] <= 1e-2 and 0 < r["floor_fraction"] and r["gbs"] > 0
               for r in per_gemm)
    for T in (1, 5):
        for gemm in ("gemm1", "gemm2"):
            rows = [r for r in per_gemm if r["T"] == T and r["gemm"] == gemm]
            assert [r["label"] for r in rows] == ["v4", "v5"]
        layer = [r for r in res if r["gemm"] == "layer" and r["T"] == T]
        assert [r["label"] for r in layer] == ["v4", "v5"]
        assert all(0 < r["floor_fraction"] and r["vllm_h100_ms"] is None for r in layer)
    assert set(calls) == {("v4", 16), ("v5", 64)}
    assert tune.card_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert tune.card_bandwidth(b"NVIDIA H200") == 4.8e12 and tune.card_bandwidth("RTX") is None


@pytest.mark.slow
def test_decode_bench_prefill_v6_sweep_host_logic(monkeypatch):
    """decode_bench as the prefill bench: v6 aligned to its own BLOCK_M (64 or 128), TF/s per
    GEMM and layer, --sweep over every v6 candidate (each fitted to its block size and
    checked against v4), the layer against vLLM's time where one is known."""
    monkeypatch.setitem(sys.modules, "cupy", _numpy_as_cupy())
    calls = []

    def fake_gemm(a, w, st, ex, nt, top_k, B, tw, mul, *, version, config, out):
        dkey = gcfg.dtype_key(a.dtype)
        cfg = gcfg.get_config(1, w.shape[1], w.shape[2], w.shape[0], 1, a.dtype, version) \
            if config is None else config
        gcfg.fit_config(version, dkey, {k: v for k, v in cfg.items() if k != "version"}, B)
        calls.append((version, B))
        c = reference.grouped_gemm(a.astype(np.float32), w.astype(np.float32), st, ex, nt,
                                   top_k, B, tw, mul)
        out[...] = c.astype(out.dtype)
        return out

    monkeypatch.setattr(gg, "grouped_gemm", fake_gemm)
    monkeypatch.setattr(tune, "VLLM_H100_LAYER_MS", {("Tiny-MoE", 40): 1e3})
    lines = []
    res = tune.decode_bench(sys.modules["cupy"], {"tiny": ("Tiny-MoE", 4, 2, 64, 32)}, (40,),
                          ("v4", "v6"), reps=2, sweep=True, log=lines.append)
    text = "\n".join(lines)
    assert "FAIL" not in text and "skip" not in text, text
    per_gemm = [r for r in res if r["gemm"] != "layer"]
    assert all(r["ok"] and r["tflops"] > 0 for r in per_gemm)
    for gemm in ("gemm1", "gemm2"):
        rows = [r for r in per_gemm if r["gemm"] == gemm]
        assert [r["label"] for r in rows[:2]] == ["v4", "v6"]
        assert len(rows) == 2 + len(tune.V6_CANDIDATES)
    assert sum("best v6 candidate" in line for line in lines) == 2
    layer = [r for r in res if r["gemm"] == "layer"]
    assert len(layer) == 2 + len(tune.V6_CANDIDATES) and all(r["vllm_h100_ms"] for r in layer)
    assert sum("MET" in line for line in lines) == len(layer)
    assert {B for v, B in calls if v == "v6"} == {64, 128}


@pytest.mark.gpu
def test_v6_tensor_map_is_the_driver_bindings_map():
    """The ctypes encoding gives the same 128 bytes as cuda.bindings' (where it is installed)."""
    cp = pytest.importorskip("cupy")
    driver = pytest.importorskip("cuda.bindings.driver")
    if not gg._compile.is_sm90(0):
        pytest.skip("v6 runs on sm_90 only")
    w = cp.zeros((4, 300, 200), dtype=cp.float16)
    cfg = gcfg.fit_config("v6", "fp16", gcfg.heuristic_config("v6", "fp16", 4096), 128)
    fields = gtmap.v6_tensor_map_fields(w.shape, "fp16", cfg)
    ours = gtmap._encode_tensor_map(fields, w.data.ptr).view(np.uint64)
    err, tmap = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3, w.data.ptr,
        [driver.cuuint64_t(x) for x in fields["dims"]],
        [driver.cuuint64_t(x) for x in fields["strides"]],
        [driver.cuuint32_t(x) for x in fields["box"]],
        [driver.cuuint32_t(x) for x in fields["element_strides"]],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    assert err == driver.CUresult.CUDA_SUCCESS
    assert ours.tolist() == [int(x) for x in tmap.opaque]
