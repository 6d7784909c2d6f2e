"""Faults and refusals of the expert-parallel runtime on the CPU communicator.

A rank that raises, exits or hangs in the middle of a forward makes every other rank stop
with an error naming it, within the timeout; the launcher kills and joins what is left
(no orphan processes, also when the launcher itself is killed). Bad configurations are
refused before any collective. No test asserts on timings: the timeouts only bound how
long a failing test can take.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sandbox.ep import LaunchError, launch
from sandbox.ep.checks import fault_and_report_pid, run_refusals


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _pids(pid_dir, world_size):
    out = []
    for r in range(world_size):
        path = os.path.join(pid_dir, f"rank{r}.pid")
        if os.path.exists(path):
            out.append(int(open(path).read()))
    return out


@pytest.mark.parametrize("fault,expect", [
    ("raise", [r"rank 1: RuntimeError: injected failure on rank 1",
               r"rank 0: CommPeerError: rank 0: connection to rank 1 closed"]),
    ("exit", [r"rank 1: rank 1 exited with code 7",
              r"rank 0: CommPeerError: rank 0: connection to rank 1 closed"]),
    ("hang", [r"rank 0: CommTimeoutError: rank 0: all_to_all_v \(counts\) timed out after "
              r"4.0 s, still waiting to receive from ranks \[1\]",
              r"rank 1: still running .* killed"]),
])
@pytest.mark.slow
def test_a_failing_rank_stops_the_others_with_a_clear_error(fault, expect, tmp_path):
    import re

    with pytest.raises(LaunchError) as info:
        # generous for a loaded CI machine: the timeouts bound the test, they are not measured
        launch(fault_and_report_pid, 2, args=(fault, 1, str(tmp_path)), timeout=4.0, grace=4.0)
    message = str(info.value)
    for pattern in expect:
        assert re.search(pattern, message), message
    assert set(info.value.failures) == {0, 1}
    pids = _pids(tmp_path, 2)
    assert len(pids) == 2
    assert not any(_alive(p) for p in pids), "a rank outlived the launch"


@pytest.mark.slow
def test_children_die_with_a_killed_launcher(tmp_path):
    """SIGKILL the process that called launch(): its ranks must not be left running."""
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = {sys.path!r}
        from sandbox.ep import launch
        from sandbox.ep.checks import fault_and_report_pid
        launch(fault_and_report_pid, 2, args=("hang", 0, {str(tmp_path)!r}), timeout=300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 120
        while len(_pids(tmp_path, 2)) < 2:
            assert time.monotonic() < deadline, "the ranks never started"
            assert proc.poll() is None, "the launcher exited early"
            time.sleep(0.2)
        pids = _pids(tmp_path, 2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), "ranks outlived their killed launcher"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bad_configs_are_refused_before_any_collective():
    results = launch(run_refusals, 2, timeout=30)
    for res in results:
        assert res["indivisible"].startswith("ValueError: world_size: 2 ranks do not divide "
                                             "the 5 experts")
        assert "not a multiple of the world size 2" in res["indivisible_redundant"]
        assert res["mismatch"].startswith("ConfigMismatchError")
        assert "rank 1 has hidden_size=24 (rank 0: 16)" in res["mismatch"]
        assert "scheme='alltoall' (rank 0: 'allgather')" in res["mismatch_scheme"]
        assert res["healthy_after"], "a refusal must leave the group usable"


def test_two_ranks_on_one_device_are_refused():
    with pytest.raises(LaunchError, match="ranks 0 and 1 were both given device 0"):
        launch(fault_and_report_pid, 2, args=("none",), devices=[0, 0], timeout=10, grace=2)
