"""What the benchmark scripts share through sandbox.bench besides the timer: their point
options (--models, --tokens), checked name lists, and a preset's routing."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

import reference
from sandbox import bench


def test_points_options_round_trip_and_refuse_unknown_names():
    p = argparse.ArgumentParser()
    bench.add_points_options(p, ("mixtral-8x7b", "deepseek-v3"), (1, 64))
    bench.add_out_dir(p)
    args = p.parse_args([])
    assert bench.points_of(args, bench.PRESETS) == (["mixtral-8x7b", "deepseek-v3"], [1, 64])
    assert args.out_dir == str(bench.DEFAULT_OUT_DIR)
    args = p.parse_args(["--models", " deepseek-v3,", "--tokens", "4096"])
    assert bench.points_of(args, bench.PRESETS) == (["deepseek-v3"], [4096])
    with pytest.raises(SystemExit, match=r"--models: expected names from .*'grok'"):
        bench.points_of(p.parse_args(["--models", "grok"]), bench.PRESETS)
    with pytest.raises(SystemExit, match="--stages"):
        bench.names_arg("--stages", "route,warp", ("route", "align"))


@pytest.mark.parametrize("name", ["deepseek-v3", "mixtral-8x7b"])
def test_route_preset_is_the_preset_routing(name):
    preset = bench.PRESETS[name]
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, preset.num_experts)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(preset.num_experts)).astype(np.float32)
    w, ids = bench.route_preset(reference, preset, logits, bias)
    if name in bench.GROUPED_ROUTING:
        G, TG, scoring, scale = bench.GROUPED_ROUTING[name]
        want = reference.grouped_topk(None, logits, preset.top_k, True, G, TG, scoring, scale,
                                      bias)
    else:
        want = reference.fused_topk(None, logits, preset.top_k, True)[:2]
    np.testing.assert_array_equal(ids, want[1])
    np.testing.assert_array_equal(w, want[0])


def test_no_gpu_says_why(capsys):
    assert bench.no_gpu(lambda: (False, "no driver")) is True
    assert "no driver" in capsys.readouterr().out
    assert bench.no_gpu(lambda: (True, "")) is False
    assert capsys.readouterr().out == ""
