"""The cross-validation harness on CPU: reference against torch, a deliberately broken
backend caught at the right stage, near-ties, NaN rows, JSON, unavailable backends."""

from __future__ import annotations

import importlib
import json
import pathlib
import zlib

import ml_dtypes
import numpy as np
import pytest

import cuda_kernels.torch as torch_backend
from sandbox import STAGES, FusedMoE, registry, validate
from sandbox.validate import (
    ValidationReport,
    compare_align,
    compare_float,
    compare_ids,
    selection_scores,
)

pytest.importorskip("torch")


def rng_for(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def make(seed=0, t=27, nan_rows=(), **kw):
    kw = {"num_experts": 8, "top_k": 2, "hidden_size": 32, "intermediate_size": 48, **kw}
    layer = FusedMoE.random(seed=seed, **kw)
    rng = rng_for("validate", seed, t, tuple(sorted(kw)))
    x = rng.standard_normal((t, layer.hidden_size)).astype(np.float32)
    logits = rng.standard_normal((t, layer.num_router_experts)).astype(np.float32)
    for r in nan_rows:
        logits[r, 1] = np.nan
    return layer, x, logits


def statuses(report, backend):
    return {r["stage"]: r["status"] for r in report.rows if r["backend"] == backend}


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("dtype", [None, ml_dtypes.bfloat16, np.float16])
def test_reference_vs_torch_all_ok(dtype):
    layer, x, logits = make(seed=1, nan_rows=(4,), has_bias=True)
    report = validate(layer, x, logits, backends=["reference", "torch"], dtype=dtype)
    assert report.ok, report.table()
    for b in ("reference", "torch"):
        assert statuses(report, b) == {s: "ok" for s in STAGES + ("end_to_end",)}
        assert report.first_divergence[b] is None
    want = "float32" if dtype is None else str(np.dtype(dtype))
    assert report.meta["dtype"] == want and report.meta["nan_rows"] == 1


@pytest.mark.parametrize("cfg", [
    dict(num_experts=16, top_k=4, use_grouped_topk=True, num_expert_group=4, topk_group=2,
         scoring_func="sigmoid", routed_scaling_factor=2.5,
         e_score_correction_bias=np.linspace(-0.1, 0.1, 16, dtype=np.float32),
         n_shared_experts=1),
    dict(activation="swigluoai", has_bias=True),
    dict(zero_expert_num=2, zero_expert_type="identity", ep_size=2, ep_rank=1),
    dict(tp_size=2, tp_rank=1, activation="gelu_tanh"),
], ids=["deepseek", "gpt_oss", "zero_ep", "tp_gelu"])
def test_reference_vs_torch_configs(cfg):
    layer, x, logits = make(seed=2, nan_rows=(0, 5), **cfg)
    report = validate(layer, x, logits, backends=["reference", "torch"])
    assert report.ok, report.table()


def test_empty_batch():
    layer, x, logits = make(seed=3, t=0)
    report = validate(layer, x, logits, backends=["reference", "torch"])
    assert report.ok, report.table()


# ----------------------------------------------------------------------------- broken backends
def test_broken_activation_caught_at_activation(monkeypatch):
    real = torch_backend.apply_activation

    def broken(x, activation="silu", is_act_and_mul=True):
        return real(x, activation, is_act_and_mul) * 1.001    # 1e-3: far above fp32's 1e-5

    monkeypatch.setattr(torch_backend, "apply_activation", broken)
    layer, x, logits = make(seed=4)
    report = validate(layer, x, logits, backends=["reference", "torch"])
    assert not report.ok
    assert report.first_divergence == {"reference": None, "torch": "activation"}
    s = statuses(report, "torch")
    assert s["route"] == s["align"] == s["gemm1"] == "ok"
    assert s["activation"] == "fail"
    assert s["gemm2"] == s["combine"] == "ok"                # fed the reference's inputs
    assert s["end_to_end"] == "fail"
    row = report.row("torch", "activation")
    assert 5e-4 < row["rel_err"] < 2e-3 and "rel err" in row["detail"]
    assert "first divergence at activation" in report.table()


def test_broken_align_caught_at_align(monkeypatch):
    real = torch_backend.moe_align_block_size

    def broken(topk_ids, block_size, num_experts, expert_map=None, **kw):
        sorted_ids, expert_ids, ntpp = real(topk_ids, block_size, num_experts, expert_map, **kw)
        other = int((expert_ids != expert_ids[0]).nonzero()[0])    # first block of expert 2
        sorted_ids = sorted_ids.clone()
        a, b = 0, other * block_size
        sorted_ids[[a, b]] = sorted_ids[[b, a]]               # a slot moves to another expert
        return sorted_ids, expert_ids, ntpp

    monkeypatch.setattr(torch_backend, "moe_align_block_size", broken)
    layer, x, logits = make(seed=5, t=40, block_size=4)
    report = validate(layer, x, logits, backends=["torch"])
    assert report.first_divergence["torch"] == "align", report.table()
    assert "expert run" in report.row("torch", "align")["detail"]


def test_align_order_within_an_expert_is_free(monkeypatch):
    real = torch_backend.moe_align_block_size

    def reversed_within_experts(topk_ids, block_size, num_experts, expert_map=None, **kw):
        """Same blocks, but each expert's run reversed (as an atomics-based kernel might)."""
        import torch

        sorted_ids, expert_ids, ntpp = real(topk_ids, block_size, num_experts, expert_map, **kw)
        s = sorted_ids.clone()
        n = int(ntpp[0])
        blocks = expert_ids[: n // block_size].tolist()
        start = 0
        for b in range(1, len(blocks) + 1):
            if b == len(blocks) or blocks[b] != blocks[start]:
                lo, hi = start * block_size, b * block_size
                s[lo:hi] = torch.flip(s[lo:hi], [0])
                start = b
        return s, expert_ids, ntpp

    monkeypatch.setattr(torch_backend, "moe_align_block_size", reversed_within_experts)
    layer, x, logits = make(seed=6, t=40, block_size=4)
    report = validate(layer, x, logits, backends=["torch"])
    assert report.ok, report.table()
    assert report.row("torch", "align")["ids"] == "exact (as sets per expert)"


def test_nan_where_reference_is_finite_fails(monkeypatch):
    real = torch_backend.moe_sum

    def leaky(x, *ids_and_map, **kw):
        out = real(x, *ids_and_map, **kw).clone()
        out[2, 3] = float("nan")
        return out

    monkeypatch.setattr(torch_backend, "moe_sum", leaky)
    layer, x, logits = make(seed=7)
    report = validate(layer, x, logits, backends=["torch"])
    assert report.first_divergence["torch"] == "combine"
    assert "NaN" in report.row("torch", "combine")["detail"]


def test_nan_logit_row_has_defined_weights(monkeypatch):
    # vLLM's routing today: a NaN logit makes the row's scores non-finite, and a non-finite
    # score is 0, so the row gets ids 0..K-1 with weight 0 (it was NaN weights before issue
    # 38). A backend that still leaves NaN there diverges at route.
    real = torch_backend.select_experts

    def nan_keeper(*args, **kw):
        w, ids, z = real(*args, **kw)
        w = w.clone()
        w[3] = float("nan")                                  # the old NaN-logit row
        return w, ids, z

    layer, x, logits = make(seed=8, nan_rows=(3,))
    report = validate(layer, x, logits, backends=["reference", "torch"])
    assert report.ok, report.table()
    monkeypatch.setattr(torch_backend, "select_experts", nan_keeper)
    report = validate(layer, x, logits, backends=["torch"])
    assert report.first_divergence["torch"] == "route"
    assert "where the reference is finite" in report.row("torch", "route")["detail"]


def _padding_router(hidden_states, gating_output, topk, renormalize):
    """Every third slot and token 2 routed nowhere (-1), NumPy or torch in and out."""
    import reference

    torch_in = hasattr(gating_output, "cpu")
    host = np.asarray(gating_output.cpu() if torch_in else gating_output)
    w, ids, _ = reference.fused_topk(None, host, topk, renormalize)
    ids = ids.copy()
    ids.reshape(-1)[::3] = -1
    ids[2] = -1
    if torch_in:
        import torch

        return torch.from_numpy(w), torch.from_numpy(ids)
    return w, ids


def test_slots_routed_nowhere_are_judged_on_the_rows_computed(monkeypatch):
    # a skipped slot's GEMM / activation rows are never written (vLLM's kernels): whatever
    # they hold must not fail a backend, and the combine must leave them out
    import torch

    real = torch_backend.grouped_gemm

    def garbage(a, w, sorted_token_ids, *rest, **kw):
        out = real(a, w, sorted_token_ids, *rest, **kw).clone()
        n = int(rest[1].reshape(-1)[0])
        live = sorted_token_ids[:n]
        dead = np.ones(out.shape[0], bool)
        dead[live[live < out.shape[0]].numpy()] = False
        out[torch.from_numpy(dead)] = 12345.0                       # what memory held
        return out

    monkeypatch.setattr(torch_backend, "grouped_gemm", garbage)
    layer, x, logits = make(seed=26, custom_routing_function=_padding_router)
    report = validate(layer, x, logits, backends=["reference", "torch"])
    assert report.ok, report.table()
    assert statuses(report, "torch") == {s: "ok" for s in STAGES + ("end_to_end",)}

    def leaky_sum(x_, *ids_and_map, **kw):   # a combine that still sums the skipped rows
        return x_.sum(dim=1)

    monkeypatch.setattr(torch_backend, "moe_sum", leaky_sum)
    report = validate(layer, x, logits, backends=["torch"])
    assert report.first_divergence["torch"] == "combine"


def test_wrong_dtype_fails(monkeypatch):
    real = torch_backend.grouped_gemm

    def upcast(*args, **kw):
        import torch

        return real(*args, **kw).to(torch.float32)

    monkeypatch.setattr(torch_backend, "grouped_gemm", upcast)
    layer, x, logits = make(seed=9, params_dtype=ml_dtypes.bfloat16)
    report = validate(layer, x, logits, backends=["torch"])
    assert report.first_divergence["torch"] == "gemm1"
    assert "dtype" in report.row("torch", "gemm1")["detail"]


def test_raising_backend_is_an_error_row(monkeypatch):
    def boom(*args, **kw):
        raise RuntimeError("kernel launch failed\nsecond line")

    monkeypatch.setattr(torch_backend, "moe_sum", boom)
    layer, x, logits = make(seed=10)
    report = validate(layer, x, logits, backends=["torch"])
    row = report.row("torch", "combine")
    assert row["status"] == "error" and row["detail"] == "RuntimeError: kernel launch failed"
    assert report.first_divergence["torch"] == "combine" and not report.ok


# ----------------------------------------------------------------------------- routing ties
def _swap_route(row, slot, new_id):
    real = torch_backend.select_experts

    def swapped(*args, **kw):
        w, ids, z = real(*args, **kw)
        ids = ids.clone()
        ids[row, slot] = new_id
        return w, ids, z

    return swapped


def test_near_tie_swap_is_reported_not_failed(monkeypatch):
    layer, x, logits = make(seed=11)
    logits[0] = [5.0, 2.0, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0]    # experts 1 and 5 tie for slot 1
    monkeypatch.setattr(torch_backend, "select_experts", _swap_route(0, 1, 5))
    report = validate(layer, x, logits, backends=["torch"])
    assert report.ok, report.table()
    row = report.row("torch", "route")
    assert row["near_ties"] == 1 and "near-tie" in row["ids"]
    assert report.row("torch", "end_to_end")["near_ties"] == 1   # left out end to end


def test_non_tie_swap_fails_at_route(monkeypatch):
    layer, x, logits = make(seed=12)
    logits[0] = [5.0, 2.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    monkeypatch.setattr(torch_backend, "select_experts", _swap_route(0, 1, 5))
    report = validate(layer, x, logits, backends=["torch"])
    assert report.first_divergence["torch"] == "route"
    assert "1/27" in report.row("torch", "route")["ids"]


def test_compare_ids_units():
    scores = np.array([[0.5, 0.2, 0.2, np.float32(0.2) + np.spacing(np.float32(0.2)) * 8]],
                      np.float32)
    want = np.array([[0, 1]], np.int32)
    assert compare_ids(np.array([[0, 2]], np.int32), want, scores, 4)["status"] == "ok"
    assert compare_ids(np.array([[0, 3]], np.int32), want, scores, 4)["status"] == "fail"
    assert compare_ids(np.array([[0, 0]], np.int32), want, scores, 4)["status"] == "fail"
    assert compare_ids(np.array([[0, 2]], np.int64), want, scores, 4)["status"] == "fail"
    assert compare_ids(np.array([[0, 2]], np.int32), want, None, 4)["status"] == "fail"


def test_compare_float_units():
    want = np.array([[1.0, 2.0], [np.nan, np.nan]])
    ok = compare_float(np.array([[1.0, 2.0], [np.nan, np.nan]], np.float32), want, np.float32)
    assert ok["status"] == "ok" and ok["rel_err"] == 0.0
    bad = compare_float(np.array([[1.0, np.nan], [np.nan, np.nan]], np.float32), want, np.float32)
    assert bad["status"] == "fail" and "NaN" in bad["detail"]
    zero = compare_float(np.zeros((2, 2), np.float32), np.zeros((2, 2)), np.float32)
    assert zero["status"] == "ok"
    off = compare_float(np.full((2, 2), 1e-9, np.float32), np.zeros((2, 2)), np.float32)
    assert off["status"] == "fail"


def test_compare_align_units():
    # P = 3 slots, B = 2: expert 0 holds slots {0, 2}, expert 1 slot {1}
    want = (np.array([0, 2, 1, 3, 3, 3], np.int32), np.array([0, 1, -1], np.int32),
            np.array([4], np.int32))
    same_set = (np.array([2, 0, 1, 3, 3, 3], np.int32),) + want[1:]
    assert compare_align(same_set, want, 3, 2)["status"] == "ok"
    moved = (np.array([0, 1, 2, 3, 3, 3], np.int32),) + want[1:]
    assert compare_align(moved, want, 3, 2)["status"] == "fail"
    junk_tail = (np.array([0, 2, 1, 3, 3, 0], np.int32),) + want[1:]
    assert "padding" in compare_align(junk_tail, want, 3, 2)["detail"]


def test_selection_scores_follow_the_router():
    layer, _, logits = make(seed=13, e_score_correction_bias=np.ones(8, np.float32))
    s = selection_scores(layer, logits)
    import reference

    assert np.allclose(s, reference.softmax(logits) + 1)


def test_each_backend_judged_at_its_own_block_size(monkeypatch):
    """A GEMM whose config asks for BLOCK_M 16 is fed (and its alignment compared at) 16."""
    seen = []
    real = torch_backend.moe_align_block_size

    def spy(topk_ids, block_size, *args, **kw):
        seen.append(block_size)
        return real(topk_ids, block_size, *args, **kw)

    monkeypatch.setattr(torch_backend, "moe_align_block_size", spy)
    monkeypatch.setattr(registry.Backend, "gemm_config",
                        lambda self, *a: {"BLOCK_M": 16} if self.name == "torch" else None)
    layer, x, logits = make(seed=21, t=30)
    report = validate(layer, x, logits, backends=["reference", "torch"])
    assert report.ok, report.table()
    assert report.meta["block_sizes"] == {"reference": 64, "torch": 16}
    assert set(seen) == {16}
    assert "torch 16" in report.table()


# ----------------------------------------------------------------------------- report
def test_json_round_trip():
    layer, x, logits = make(seed=14, nan_rows=(1,))
    report = validate(layer, x, logits, backends=["reference", "torch", "cupy"])
    text = json.dumps(report.to_json())
    back = ValidationReport.from_json(json.loads(text))
    assert back.to_json() == report.to_json()
    assert back.ok == report.ok and back.first_divergence == report.first_divergence
    assert ValidationReport.from_json(text).rows == back.rows
    # non-finite numbers survive as strings
    report.rows[0]["rel_err"] = float("inf")
    again = ValidationReport.from_json(json.dumps(report.to_json()))
    assert again.rows[0]["rel_err"] == float("inf")
    assert json.loads(json.dumps(report.to_json()))["rows"][0]["rel_err"] == "inf"


def test_unavailable_backends_listed_with_reason(monkeypatch):
    v = importlib.import_module("sandbox.validate")   # the module: sandbox.validate is the function

    real = v.get_backend
    fake = registry.Backend("cupy", None, False, "no CUDA device here", "cupy")
    monkeypatch.setattr(v, "get_backend", lambda n: fake if n == "cupy" else real(n))
    layer, x, logits = make(seed=15)
    report = validate(layer, x, logits, backends=["torch", "cupy"])
    assert report.ok
    assert report.skipped == {"cupy": "no CUDA device here"}
    assert statuses(report, "cupy") == {"*": "skipped"}
    assert "cupy: skipped (no CUDA device here)" in report.table()
    assert "cupy" not in report.first_divergence


def test_nothing_but_the_reference_ran_is_not_ok(monkeypatch):
    """Asked for cupy and numba on a machine with neither: both are listed as skipped with
    the reason, and the report is not ok (nothing was compared), the table says why."""
    v = importlib.import_module("sandbox.validate")   # the module: sandbox.validate is the function

    real = v.get_backend
    fakes = {"cupy": registry.Backend("cupy", None, False, "no CUDA device here", "cupy"),
             "numba": registry.Backend("numba", None, False, "no GPU and no simulator",
                                       "numba")}
    monkeypatch.setattr(v, "get_backend", lambda n: fakes.get(n) or real(n))
    layer, x, logits = make(seed=22, t=5)
    report = validate(layer, x, logits, backends=["cupy", "numba"])
    assert not report.ok and not report.diverged and report.compared == []
    assert report.skipped == {"cupy": "no CUDA device here", "numba": "no GPU and no simulator"}
    table = report.table()
    assert "cupy: skipped (no CUDA device here)" in table
    assert "numba: skipped (no GPU and no simulator)" in table
    assert "NOTHING COMPARED" in table and "no backend but the reference ran" in table
    back = ValidationReport.from_json(json.loads(json.dumps(report.to_json())))
    assert report.to_json()["ok"] is False and not back.ok
    # with one backend that ran, the same skips do not spoil the verdict
    both = validate(layer, x, logits, backends=["torch", "cupy"])
    assert both.ok and both.compared == ["torch"] and "cupy" in both.skipped
    # the reference alone, asked for: its rounding against the exact answer is the point
    own = validate(layer, x, logits, backends=["reference"], end_to_end=False)
    assert own.ok and own.compared == []


def test_backend_that_runs_no_asked_stage_is_skipped_with_the_reason(monkeypatch):
    # the package binds a stage on first use (PEP 562): the stage goes from the package and
    # from the module that defines it, or the next look-up would bind it again
    monkeypatch.delattr(torch_backend, "moe_sum")
    monkeypatch.delattr(importlib.import_module("cuda_kernels.torch.combine"), "moe_sum")
    layer, x, logits = make(seed=23, t=5)
    report = validate(layer, x, logits, backends=["torch"], stages=("combine",),
                      end_to_end=False)
    assert not report.ok and report.compared == []
    assert "moe_sum" in report.skipped["torch"]
    assert "torch: skipped (" in report.table()


def test_progress_only_for_slow_backends_and_never_when_quiet(monkeypatch, capsys):
    """A backend that runs past PROGRESS_AFTER_S seconds gets a line per stage on stderr
    (the CUDA simulator takes minutes); a fast run prints nothing; quiet=True never does."""
    v = importlib.import_module("sandbox.validate")   # the module: sandbox.validate is the function

    layer, x, logits = make(seed=24, t=5)
    assert validate(layer, x, logits, backends=["torch"]).ok
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(v, "PROGRESS_AFTER_S", 0.0, raising=False)   # everything is "slow"
    assert validate(layer, x, logits, backends=["torch"]).ok
    err = capsys.readouterr().err
    for stage in STAGES + ("end_to_end",):
        assert f"validate: torch: {stage} (" in err, err
    assert "validate: torch: done in" in err
    assert validate(layer, x, logits, backends=["torch"], quiet=True).ok
    assert capsys.readouterr().err == ""


def test_progress_line_while_a_long_stage_runs(monkeypatch, capsys):
    """The first line comes when the mark passes, even in the middle of a stage."""
    import time

    v = importlib.import_module("sandbox.validate")

    monkeypatch.setattr(v, "PROGRESS_AFTER_S", 0.05, raising=False)
    real = torch_backend.moe_sum

    def slow_sum(x, *ids_and_map, **kw):
        time.sleep(0.3)
        return real(x, *ids_and_map, **kw)

    monkeypatch.setattr(torch_backend, "moe_sum", slow_sum)
    layer, x, logits = make(seed=25, t=5)
    assert validate(layer, x, logits, backends=["torch"], end_to_end=False).ok
    err = capsys.readouterr().err
    assert "validate: torch: combine (" in err and "still running" in err, err


def test_missing_stage_is_skipped(monkeypatch):
    # the package binds a stage on first use (PEP 562): the stage goes from the package and
    # from the module that defines it, or the next look-up would bind it again
    monkeypatch.delattr(torch_backend, "moe_sum")
    monkeypatch.delattr(importlib.import_module("cuda_kernels.torch.combine"), "moe_sum")
    layer, x, logits = make(seed=16)
    report = validate(layer, x, logits, backends=["torch"])
    assert report.ok
    s = statuses(report, "torch")
    assert s["combine"] == "skipped" and s["end_to_end"] == "skipped" and s["gemm2"] == "ok"


def test_stage_subset_and_errors():
    layer, x, logits = make(seed=17)
    report = validate(layer, x, logits, backends=["torch"], stages=("gemm1", "gemm2"),
                      end_to_end=False)
    assert [r["stage"] for r in report.rows] == ["gemm1", "gemm2"]
    with pytest.raises(ValueError, match=r"unknown backend 'tpu'.*reference"):
        validate(layer, x, logits, backends=["tpu"])
    with pytest.raises(ValueError, match=r"unknown stage 'permute'.*route"):
        validate(layer, x, logits, stages=("permute",))


# ----------------------------------------------------------------------------- GPU / simulator
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_every_available_backend_on_gpu(dtype):
    layer, x, logits = make(seed=18, t=300, num_experts=16, top_k=4, hidden_size=256,
                            intermediate_size=384, nan_rows=(7,), has_bias=True)
    report = validate(layer, x, logits, dtype=dtype)
    print(report.table())
    assert report.ok, report.table()


_SIM_SCRIPT = """
import sys, numpy as np, ml_dtypes
from sandbox import FusedMoE, validate
ok, why = __import__("sandbox").available_backends()["numba"]
if not ok:
    print("UNAVAILABLE", why); sys.exit(3)
for dt, t in ((np.float32, 5), (ml_dtypes.bfloat16, 3)):
    layer = FusedMoE.random(seed=19, num_experts=4, top_k=2, hidden_size=8,
                            intermediate_size=8, params_dtype=dt, block_size=4)
    x, logits = layer.random_inputs(t, seed=20)
    logits[1, 2] = np.nan
    # end to end once (fp32): the simulator runs ~2,000 threads a second
    report = validate(layer, x, logits, backends=["numba"], end_to_end=dt == np.float32)
    print(report.table())
    if not report.ok:
        sys.exit(1)
"""


@pytest.mark.slow
@pytest.mark.simulator
def test_numba_simulator_through_harness():
    """The numba backend under the CUDA simulator (which must be switched on before numba is
    imported, hence a fresh interpreter), tiny shapes: fp32 with a NaN-logit row, and bf16."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, "-c", _SIM_SCRIPT], env=env, capture_output=True,
                          check=False,
                          text=True, timeout=600, cwd=pathlib.Path(__file__).resolve().parents[2])
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
