"""The grouped GEMM ladder's config table and heuristics (cuda_kernels/cupy/gemm_configs.py), on
the CPU: the table is well formed, every bucket has a config for every version and dtype,
configs fit every usual block_size, card sections are read on their card only, every table
config is registered for the NVRTC compile test, v6's register split holds.

    m rows per expert bucket, N output width, Kdim reduction width, B block size
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuda_kernels.cupy import _compile as C
from cuda_kernels.cupy import gemm as gg
from cuda_kernels.cupy import gemm_configs as gcfg
from cuda_kernels.cupy import tune
from tests.oracles import BF16
from tests.support import DTYPES


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
             ("mixtral", 256, "v4"): 1.0, ("mixtral", 256, "v5"): 1.5,
             ("mixtral", 512, "v4"): 1.0,                      # v5 not timed: no promotion
             ("qwen3", 64, "v4"): 1.0, ("qwen3", 64, "v5"): 2.0}  # one model: its shapes only
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
        # whether the rung was measured on the card: only the buckets tune.py chose
        assert gcfg.rung_is_tuned(BF16, 100, card) and gcfg.rung_is_tuned(BF16, 256, card)
        assert not gcfg.rung_is_tuned(BF16, 600, card)                   # bucket 512: v5 only
        assert not gcfg.rung_is_tuned(BF16, 100, "Another card")
        assert not gcfg.rung_is_tuned(BF16, 100, None)                     # no GPU here
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


def test_version_by_shape_picks_a_rung_per_model_shape(monkeypatch):
    """version_by_shape (tune.py: the fastest rung of each tuned model and bucket, under both
    of its GEMM shapes) comes before the bucket's rung; other shapes keep the bucket's."""
    times = {("deepseek", 64, "v4"): 2.0, ("deepseek", 64, "v6"): 1.0,
             ("mixtral", 64, "v4"): 3.0, ("mixtral", 64, "v6"): 2.5,
             ("qwen3", 64, "v4"): 1.0, ("qwen3", 64, "v6"): 1.2,
             ("qwen3", 128, "v6"): 1.0}                          # one rung: nothing to choose
    by_shape = tune.version_by_shape(times)
    # Qwen3-30B-A3B: H = 2048, I = 768; GEMM1 is [2I x H], GEMM2 [H x I]
    assert by_shape["bf16"]["64,1536,2048"] == by_shape["bf16"]["64,2048,768"] == "v4"
    assert by_shape["bf16"]["64,4096,7168"] == by_shape["bf16"]["64,7168,2048"] == "v6"
    assert len(by_shape["bf16"]) == 6 and by_shape["fp16"] == by_shape["bf16"]
    by_m = tune.version_by_m(times)
    assert by_m["bf16"] == {"64": "v6"}                           # 4.7 against 6.0 summed
    card = "Card X"
    table = tune.merge_device_section({"configs": gcfg.load_table()["configs"]}, card, [],
                                      by_m, {}, by_shape)
    monkeypatch.setattr(gcfg, "load_table", lambda *a: table)
    gg._plan.cache_clear()
    try:
        assert gcfg.default_version(BF16, 64, card, 1536, 2048) == "v4"     # its shape
        assert gcfg.default_version(BF16, 50, card, 2048, 768) == "v4"      # same bucket
        assert gcfg.default_version(BF16, 64, card, 1024, 1024) == "v6"     # the bucket's
        assert gcfg.default_version(BF16, 64, card) == "v6"
        assert gcfg.default_version(BF16, 128, card, 1536, 2048) == "v4"    # untuned bucket
        assert gcfg.rung_is_tuned(BF16, 64, card, 1024, 1024)
        assert not gcfg.rung_is_tuned(BF16, 128, card, 1536, 2048)
        E, top_k = 128, 8
        assert gcfg.get_config(64 * E // top_k, 1536, 2048, E, top_k, BF16,
                               device=card)["version"] == "v4"
        plan = gg._plan.__wrapped__
        assert plan(None, "bf16", 64, 2048, 768, 128, True, True, None, card)[0] == "v4"
        assert plan(None, "bf16", 64, 7168, 2048, 128, True, True, None, card)[0] == "v6"
        # a later run replaces the shapes it tuned and keeps the others
        again = tune.merge_device_section(table, card, [], {}, {},
                                          {"bf16": {"64,1536,2048": "v6"}})
        picks = again["devices"][card]["version_by_shape"]["bf16"]
        assert picks["64,1536,2048"] == "v6" and picks["64,2048,768"] == "v4"
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
        for dk, by_shape in sec.get("version_by_shape", {}).items():
            for key, v in by_shape.items():
                m, N, K = map(int, key.split(","))
                assert v in gcfg.VERSIONS and m in gcfg.M_BUCKETS and N > 0 and K > 0, key


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
