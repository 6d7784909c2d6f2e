"""The GEMM benchmark's host logic (cuda_kernels/cupy/tune.py: decode_bench) on the CPU, with
NumPy behind CuPy's names and the reference as the GEMM: routings, alignment per block size,
the check against v4, the timing plumbing, GB/s, TF/s and floor columns, --sweep, the layer
totals, the card's bandwidth.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

import reference
from cuda_kernels.cupy import gemm as gg
from cuda_kernels.cupy import gemm_configs as gcfg
from cuda_kernels.cupy import tune
from tests.cupy.fake_cupy import numpy_cupy


def _on_the_host(monkeypatch):
    """NumPy as CuPy, and the reference as the GEMM (each config fitted to its block size
    first, as the launcher would); returns the list of (version, block size) calls."""
    monkeypatch.setitem(sys.modules, "cupy", numpy_cupy())
    calls = []

    def reference_gemm(a, w, st, ex, nt, top_k, B, tw=None, mul=False, *, version, config=None,
                       out=None):
        dkey = gcfg.dtype_key(a.dtype)
        cfg = gcfg.get_config(1, w.shape[1], w.shape[2], w.shape[0], 1, a.dtype, version) \
            if config is None else config
        gcfg.fit_config(version, dkey, {k: v for k, v in cfg.items() if k != "version"}, B)
        calls.append((version, B))
        c = reference.grouped_gemm(a.astype(np.float32), w.astype(np.float32), st, ex, nt,
                                   top_k, B, tw, mul)
        if out is None:
            return c.astype(a.dtype)
        out[...] = c.astype(out.dtype)
        return out

    monkeypatch.setattr(gg, "grouped_gemm", reference_gemm)
    return calls


@pytest.mark.slow
def test_decode_bench_host_logic(monkeypatch):
    """decode_bench end to end on the host at decode: routings, alignment per block size (v4
    at 16, v5 at 64), the check against v4, timing plumbing, GB/s and floor columns, --sweep
    adding nothing without v6, and the layer totals; the GEMM itself is the reference, each
    config checked."""
    calls = _on_the_host(monkeypatch)
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
    """decode_bench as the prefill bench: v6 aligned to its own BLOCK_M (64, 128 or 256), TF/s per
    GEMM and layer, --sweep over every v6 candidate (each fitted to its block size and
    checked against v4), the layer against vLLM's time where one is known."""
    calls = _on_the_host(monkeypatch)
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
    assert {B for v, B in calls if v == "v6"} == {64, 128, 256}


@pytest.mark.slow
def test_tune_blocks_limit_the_alignment_blocks(monkeypatch):
    """tune(blocks=...) times only the candidates of those alignment blocks (--blocks 256: the
    256-row tile alone), and --blocks names what it expected when given a block no rung takes."""
    calls = _on_the_host(monkeypatch)
    monkeypatch.setattr(tune, "MODELS", {"tiny": ("Tiny-MoE", 4, 2, 64, 32)})
    monkeypatch.setattr(tune, "BEST_BY_VERSION", {})
    rows = tune.tune(["tiny"], [128], reps=2, versions=("v6",), blocks={256}, log=lambda s: None)
    # each candidate: one check and its timed calls, the same count for each of the two GEMMs
    n256 = sum(c[0] == 256 for c in tune.V6_CANDIDATES)
    assert set(calls) == {("v4", 256), ("v6", 256)} and calls.count(("v4", 256)) == 2
    assert calls.count(("v6", 256)) % (2 * n256) == 0
    assert {r["BLOCK_M"] for r in rows} == {256} and len(rows) == 4   # 2 GEMMs x bf16, fp16
    assert tune._blocks_arg(None) is None and tune._blocks_arg("64,256") == {64, 256}
    with pytest.raises(SystemExit, match="--blocks: expected alignment blocks among"):
        tune._blocks_arg("96")
    gg._plan.cache_clear()
