"""The quantized GEMMs' config table and routes (cuda_kernels/cupy/quant/configs.py), on the CPU:
the table holds what the routes name and one config per rung, every route ends with the rung
that takes every problem, config_dict and route refuse clearly, block_size_for gives the block
sizes the routes were measured with, and the napkin math adds up.

(Which entry a route picks for a given problem is tested beside each ladder's refusal rules:
tests/cupy/quant/test_w8a8.py and test_wna16.py.)
"""
from __future__ import annotations

import pytest

from cuda_kernels.cupy.quant import configs as Q


def test_routes_name_configs_of_their_ladder_and_end_with_v1():
    for fmt, route in Q.ROUTES.items():
        table = Q.CONFIGS[Q.LADDER_OF[fmt]]
        assert all(name in table for _, _, name in route), fmt
        rows, min_k, last = route[-1]
        assert table[last]["rung"] == "v1" and rows == Q.INF and min_k == 0


def test_every_rung_has_a_config_with_its_tunables():
    for ladder, table in Q.CONFIGS.items():
        assert {c["rung"] for c in table.values()} == set(Q.RUNGS[ladder])
        for name, cfg in table.items():
            assert set(Q.TUNABLES[ladder, cfg["rung"]]) <= set(cfg), name
            assert Q.config_dict(ladder, name) == (name, cfg)


def test_the_table_holds_the_routes_picks_plus_the_opt_in_rungs():
    """Nothing in the table that neither a route picks nor is a rung's only config."""
    picked = {(Q.LADDER_OF[f], n) for f, r in Q.ROUTES.items() for _, _, n in r}
    for ladder, table in Q.CONFIGS.items():
        for name, cfg in table.items():
            alone = sum(c["rung"] == cfg["rung"] for c in table.values()) == 1
            assert (ladder, name) in picked or alone, f"{ladder} {name}: nothing picks it"


def test_config_dict_refuses_clearly():
    with pytest.raises(ValueError, match="expected one of"):
        Q.config_dict("wna16", "nope")
    with pytest.raises(ValueError, match="rung"):
        Q.config_dict("wna16", dict(MT=1))
    with pytest.raises(ValueError, match="missing"):
        Q.config_dict("wna16", dict(rung="v5", MT=3, W=4))
    with pytest.raises(ValueError, match="not of version v4"):
        Q.config_dict("wna16", "t24", "v4")
    with pytest.raises(TypeError, match="name or a dict"):
        Q.config_dict("w8a8", 3)
    name, cfg = Q.config_dict("wna16", dict(Q.CONFIGS["wna16"]["t24"], S=4))
    assert name == "custom" and cfg["S"] == 4 and Q.CONFIGS["wna16"]["t24"]["S"] == 3
    assert Q.config_dict("wna16", dict(MT=1, W=8, D=2, MINB=2), "v4")[1]["rung"] == "v4"


def test_route_order_versions_and_reasons():
    takes_all = lambda cfg: None                                     # noqa: E731
    assert Q.route("int4", 1.0, 4096, takes_all) == ("q8", Q.CONFIGS["wna16"]["q8"])
    assert Q.route("int4", 16.0, 4096, takes_all)[0] == "t24ws"
    assert Q.route("int4", 200.0, 4096, takes_all)[0] == "m64"
    assert Q.route("fp8", 0.25, 7168, takes_all)[0] == "gemv8w4u3ll"
    assert Q.route("fp8", 0.25, 2048, takes_all)[0] == "gemv8w4u2m6"     # min Kdim 4096
    # a rung asked for runs its entries past their rows, then its other configs
    assert Q.route("int4", 500.0, 4096, takes_all, version="v3")[0] == "gemv32"
    assert Q.route("int4", 1.0, 4096, takes_all, version="v6")[0] == "h32"
    only_v1 = lambda cfg: None if cfg["rung"] == "v1" else f"{cfg['rung']} says no"  # noqa: E731
    assert Q.route("int4", 1.0, 4096, only_v1) == ("naive", Q.CONFIGS["wna16"]["naive"])
    with pytest.raises(ValueError, match="version: wna16 v5 cannot run this problem: v5 says no"):
        Q.route("int4", 1.0, 4096, only_v1, version="v5")
    with pytest.raises(ValueError, match="config: t32 .*v5 says no"):
        Q.route("int4", 1.0, 4096, only_v1, config="t32")
    with pytest.raises(ValueError, match="version: expected one of"):
        Q.route("fp8", 1.0, 4096, takes_all, version="v5")


def test_block_size_for():
    assert Q.block_size_for("int4", 0.25) == 16 and Q.block_size_for("int4", 8) == 16
    assert Q.block_size_for("int4", 16) == 48 and Q.block_size_for("int4", 100) == 48
    assert Q.block_size_for("int4", 200) == 64
    assert Q.block_size_for("fp8", 2) == 16 and Q.block_size_for("fp8", 32) == 64
    assert Q.block_size_for("int8", 16) == 16 and Q.block_size_for("w8a16", 17) == 64
    # each block size lets its range's first entry take the problem (tile rows divide it)
    for fmt in Q.ROUTES:
        for rows in (0.25, 1, 4, 8, 16, 64, 128, 256):
            first = next(n for r, _, n in Q.ROUTES[fmt] if rows <= r)
            cfg = Q.CONFIGS[Q.LADDER_OF[fmt]][first]
            assert Q.block_size_for(fmt, rows) % Q.tile_rows(cfg) == 0, (fmt, rows, first)


def test_napkin_math():
    # DeepSeek-V3 fp8 w13 of one expert: 4096 x 7168 codes, 32 x 56 block scales
    assert Q.quant_weight_bytes("fp8", 1, 4096, 7168) == 4096 * 7168 + 4 * 32 * 56
    # Mixtral int4 w13 + w2 of two experts, group 128: 187 MB
    mix = Q.quant_weight_bytes("int4", 2, 28672, 4096) + Q.quant_weight_bytes("int4", 2, 4096,
                                                                              14336)
    assert round(mix / 1e6) == 187
    assert Q.gemm_flops(2, 28672, 4096) == 2 * 2 * 28672 * 4096
