"""The NCCL code path on the CPU, against a fake `cupy` (tests/sandbox/ep/fake_gpu/).

The ranks import a stand-in CuPy whose arrays refuse implicit conversion to NumPy (as real
CuPy arrays do) and whose `cupy.cuda.nccl` runs over the CPU communicator. What this
executes that the CPU-communicator tests do not: `sandbox/ep/comm_nccl.py` (unique-id
exchange, grouped p2p through the NCCL calls, the native collectives' pointer/count/dtype
arguments, the side-stream counts phase, the watchdog and abort), the device-array paths
of dispatch and the layer (host/device mix-ups raise here), the reference-on-host fallback,
and the benchmark harness end to end on tiny shapes. Real GPUs are the multigpu tests' job.
"""
import contextlib
import itertools
import os
import re
import sys

import pytest

from sandbox.ep import LaunchError, launch
from sandbox.ep.checks import (
    COLLECTIVE_CHECKS,
    fault_and_report_pid,
    parity_cases,
    run_collectives,
    run_parity,
    run_refusals,
)
from tests.support import once

FAKE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_gpu")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


@contextlib.contextmanager
def fake_gpu():
    """Spawned ranks copy the parent's sys.path (not its modules): they import the fake cupy,
    even on a machine with a real one. The test process itself never imports the fake."""
    sys.path.insert(0, FAKE)
    try:
        yield
    finally:
        sys.path.remove(FAKE)


_CACHE = {}


def _once(key, fn):
    def in_the_fake_gpu():
        with fake_gpu():
            return fn()
    return once(_CACHE, key, in_the_fake_gpu)


@pytest.mark.parametrize("check", COLLECTIVE_CHECKS)
def test_fake_nccl_collectives(check):
    results = _once("coll", lambda: launch(run_collectives, 2, backend="nccl", timeout=30))
    assert all(r[check] for r in results), [r[check] for r in results]


CASES = [c for c in parity_cases(2) if "eplb_replicas" not in c["name"]]


@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_fake_nccl_parity(name):
    per_rank = _once("parity", lambda: launch(run_parity, 2, backend="nccl",
                                              args=(CASES, "reference"), timeout=60))
    i = [c["name"] for c in CASES].index(name)
    for res in (r[i] for r in per_rank):
        assert res["error"] <= res["tolerance"], res
        assert res.get("error_after_rebalance", 0.0) <= res["tolerance"], res


@pytest.mark.parametrize("fault,pattern", [
    ("raise", r"rank 1: RuntimeError: injected failure on rank 1"),
    ("exit", r"rank 1: rank 1 exited with code 7"),
    ("hang", r"rank 0: CommTimeoutError: rank 0: all_to_all_v \(counts\) (blocked for more "
             r"than|did not complete within) 4.0 s"),
])
@pytest.mark.slow
def test_fake_nccl_faults(fault, pattern, tmp_path):
    with fake_gpu(), pytest.raises(LaunchError) as info:
        launch(fault_and_report_pid, 2, backend="nccl", args=(fault, 1, str(tmp_path)),
               timeout=4.0, grace=4.0)
    message = str(info.value)
    assert re.search(pattern, message), message
    if fault != "hang":  # the surviving rank stopped on its own, told by the store note
        assert re.search(r"rank 0: CommPeerError: rank 0: .*rank 1", message), message


@pytest.mark.slow
def test_fake_nccl_refusals_and_devices():
    results = _once("refusals", lambda: launch(run_refusals, 2, backend="nccl", timeout=30))
    for res in results:
        assert res["mismatch"].startswith("ConfigMismatchError") and res["healthy_after"]
    with fake_gpu(), pytest.raises(LaunchError, match="ranks 0 and 1 were both given device 1"):
        launch(fault_and_report_pid, 2, backend="nccl", args=("none",), devices=[1, 1],
               timeout=10, grace=2)
    with fake_gpu(), pytest.raises(LaunchError, match=r"device: expected a GPU index in \[0, 2\)"
                                                      r" on this host, got 5"):
        launch(fault_and_report_pid, 2, backend="nccl", args=("none",), devices=[0, 5],
               timeout=10, grace=2)


@pytest.mark.slow
def test_fake_nccl_benchmark_harness_runs_end_to_end():
    bench_dir = BENCHMARKS
    sys.path.insert(0, bench_dir)  # the spawned ranks import bench_ep by name too
    try:
        import bench_ep

        _bench_once(bench_ep)
    finally:
        sys.path.remove(bench_dir)


def _bench_once(bench_ep):
    shape = dict(hidden_size=32, top_k=2, num_experts=8, intermediate_size=16,
                 dtype="bfloat16")
    opts = dict(shape=shape, tokens=[16], layer_tokens=[8], schemes=["alltoall", "allgather"],
                alltoall_rows=["token", "slot"], impls=["fused", "stages", "fused2"], breakdown=True,
                reps=1, warmup=1, layer_reps=1, layer_warmup=1, pool=2, layer=True,
                stage_ops="reference", flush_mb=1)
    results = _once("bench", lambda: launch(bench_ep.bench_rank, 2, backend="nccl",
                                            args=(opts,), timeout=60))
    report = results[0]
    assert results[1] is None and report["layer_note"] is None, report.get("layer_note")
    phases = {(r["tokens_per_rank"], r["scheme"], r["phase"]) for r in report["rows"]}
    for T in (16,):
        assert (T, "alltoall", "raw NCCL all-to-all (slot bytes, P rows)") in phases
        for mode, impl in itertools.product(("token", "slot"), ("fused", "stages")):
            for phase in ("dispatch", "combine", "dispatch+combine",
                          "raw NCCL all-to-all (same bytes)", "exchange only (all_to_all_v)"):
                assert (T, "alltoall", f"{phase} ({mode} rows, {impl})") in phases
            steps = [p for (_, _, p) in phases if p.startswith("  step:")
                     and f"({mode} rows, {impl})" in p]
            assert len(steps) == 5, steps
        assert (T, "allgather", "raw ncclAllGather + ncclReduceScatter") in phases
    single = [r for r in report["layer"] if r["what"] == "single-GPU layer forward"]
    assert single and all(e < 1e-2 for e in single[0]["ep_vs_single_rel_error"].values())
    report["target"] = bench_ep._target(report, ["token", "slot"])
    t = report["target"]
    assert t["rows"] == "token" and t["impl"] == "fused" and t["tokens_per_rank"] == 16 and \
        set(t["by_rows"]) == {"token", "slot"}
    assert set(t["other_impls"]) == {"token rows, stages", "slot rows, stages",
                                     "token rows, fused2", "slot rows, fused2"}
    # top-2 of 8 experts over 2 ranks: a token visits at most both ranks, never more rows
    # than slots; slot rows send every slot
    assert t["by_rows"]["token"]["rows_sent"] <= t["by_rows"]["slot"]["rows_sent"] == 16 * 2
    bench_ep.print_table(report)


def test_fake_nccl_fused_path_through_the_gpu_launchers():
    """The fused dispatch's GPU branch (ep_layout.py's launchers, the counts buffer exchanged
    in place, the chunked combine's side stream) with each launch replaced by its NumPy twin
    (tests/sandbox/ep/fake_gpu/mock_ep_kernels.py): fused == stages, one-go and chunked."""
    with fake_gpu():
        import mock_ep_kernels

        per_rank = launch(mock_ep_kernels.run_impl_parity_mocked, 2, backend="nccl", timeout=60)
    for results, calls, load_ok in per_rank:
        assert load_ok
        assert "ep_layout_kernel" in calls and "ep_count_experts_kernel" in calls, calls
        assert any(c.startswith("ep_gather_kernel") for c in calls), calls
        assert any(c.startswith("ep_combine_kernel") for c in calls), calls
        for res in results:
            assert res["impl"] == "fused", res
            assert res["x"] and res["ids"] and res["w"] and res["counts"], res
            assert res["out_vs_stages"] <= 1e-6 and res["chunked_vs_stages"] <= 1e-6, res
            assert res["chunked_x"], res
            assert res["out_vs_loop"] <= res["tolerance"], res
            # the GPU branch's lean path (sandbox/ep/dispatch.py _GpuFused) ran; a second call
            # of the same shape (the plan and its send buffers reused) is right to the bit
            assert res["lean"] and res["reuse_vs_fused"] == 0.0, res


def test_fake_nccl_benchmark_through_the_gpu_launchers():
    """The benchmark's fused rows and breakdown through the mocked GPU launchers."""
    bench_dir = BENCHMARKS
    shape = dict(hidden_size=32, top_k=2, num_experts=8, intermediate_size=16,
                 dtype="bfloat16")
    opts = dict(shape=shape, tokens=[16], layer_tokens=[8], schemes=["alltoall"],
                alltoall_rows=["token", "slot"], impls=["fused", "fused2", "stages"],
                breakdown=True, reps=1, warmup=1, layer_reps=1, layer_warmup=1, pool=2,
                layer=False, stage_ops="reference", flush_mb=1)
    sys.path.insert(0, bench_dir)
    try:
        with fake_gpu():
            import mock_ep_kernels

            results = launch(mock_ep_kernels.bench_rank_mocked, 2, backend="nccl",
                             args=(opts,), timeout=60)
    finally:
        sys.path.remove(bench_dir)
    phases = {r["phase"] for r in results[0]["rows"]}
    for mode in ("token", "slot"):
        for impl in ("fused", "fused2", "stages"):
            assert f"dispatch+combine ({mode} rows, {impl})" in phases, phases
        assert f"  step: layout kernel ({mode} rows, fused)" in phases, phases
