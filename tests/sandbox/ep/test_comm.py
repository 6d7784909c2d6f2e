"""The expert-parallel runtime's pieces on the CPU: the store, env:// parsing, rendezvous
checks, the CPU communicator's collectives (one launched group checks them all), and the
EPLB runtime maps. Multi-process parity and faults live in test_layer.py / test_faults.py."""
import threading

import numpy as np
import pytest

from reference import determine_expert_map
from sandbox.ep import launch
from sandbox.ep.checks import COLLECTIVE_CHECKS, run_collectives
from sandbox.ep.comm_cpu import CpuCommunicator
from sandbox.ep.eplb_runtime import ExpertPlacement, LoadRecorder, check_divisible, rearrange_plan
from sandbox.ep.errors import ConfigMismatchError, StoreTimeoutError
from sandbox.ep.launch import DistEnv, validate_rank_infos
from sandbox.ep.store import StoreClient, StoreServer


# ------------------------------------------------------------------------------- store
def test_store_set_get_add_keys_and_blocking_get():
    server = StoreServer("127.0.0.1", 0)
    try:
        a = StoreClient("127.0.0.1", server.port, timeout=5)
        b = StoreClient("127.0.0.1", server.port, timeout=5)
        a.set("x", b"\x00\x01binary")
        assert b.get("x") == b"\x00\x01binary"
        assert a.add("n", 2) == 2 and b.add("n", 3) == 5
        assert a.check("x") and not a.check("missing")
        a.set("error/1", "boom")
        assert b.keys("error/") == ["error/1"]
        got = []
        t = threading.Thread(target=lambda: got.append(b.get("late", timeout=5)))
        t.start()
        a.set("late", b"here")
        t.join(5)
        assert got == [b"here"]
        with pytest.raises(StoreTimeoutError, match="'never' did not appear"):
            a.get("never", timeout=0.2)
    finally:
        server.close()


def test_store_unreachable_is_a_clear_error():
    import socket

    # a port we hold (bound, not listening): connections are refused, and no other process
    # can start a server there while the test runs
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        with pytest.raises(StoreTimeoutError, match="could not reach the rendezvous store"):
            StoreClient("127.0.0.1", port, timeout=0.3)


# ------------------------------------------------------------------------------- env://
def test_dist_env_from_torchrun_and_slurm_variables():
    env = DistEnv.from_environ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                "MASTER_ADDR": "node0", "MASTER_PORT": "29500"})
    assert (env.rank, env.world_size, env.local_rank, env.store_port) == (3, 8, 1, 29500)
    assert not env.host_store
    # under torchrun the agent owns MASTER_PORT: rank 0 picks a free port and announces it
    # in the agent's store, under a key of this run and restart
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500",
                "TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "1",
                "TORCHELASTIC_USE_AGENT_STORE": "True"}
    env = DistEnv.from_environ(torchrun)
    assert env.store_port == 0 and env.host_store and env.local_rank == 0
    assert env.agent_store_key == "moe_sandbox/x/1/store_port"
    # an older torchrun without the agent store leaves the next port free; EP_STORE_PORT wins
    env = DistEnv.from_environ({**torchrun, "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert (env.store_port, env.agent_store_key) == (29501, "")
    env = DistEnv.from_environ({**torchrun, "EP_STORE_PORT": "4321"})
    assert (env.store_port, env.agent_store_key) == (4321, "")


@pytest.mark.slow
def test_torchrun_agent_store_unreachable_names_the_way_out():
    """A rank that cannot reach torchrun's store fails in time, naming EP_STORE_PORT."""
    pytest.importorskip("torch")
    from sandbox.ep import init_process_group

    environ = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(_free_port()), "TORCHELASTIC_RUN_ID": "x",
               "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with pytest.raises(StoreTimeoutError, match="torchrun's store .* EP_STORE_PORT"):
        init_process_group("cpu", timeout=1, init_timeout=2, environ=environ)
    env = DistEnv.from_environ({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                                "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank) == (5, 16, 1)


@pytest.mark.parametrize("environ,match", [
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK: expected"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     r"RANK: expected a rank in \[0, WORLD_SIZE=2\)"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "MASTER_ADDR: expected"),
    ({"RANK": "0", "WORLD_SIZE": "two", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     "WORLD_SIZE: expected an integer"),
])
def test_dist_env_errors_name_the_variable(environ, match):
    with pytest.raises(ValueError, match=match):
        DistEnv.from_environ(environ)


def _info(rank, world=2, backend="nccl", host="a", device=None, device_id=None):
    return dict(rank=rank, world_size=world, backend=backend, host=host, device=device,
                device_id=device_id)


def test_validate_rank_infos_refuses_bad_rendezvous():
    validate_rank_infos([_info(0, device=0), _info(1, device=1)])
    validate_rank_infos([_info(0, device=0), _info(1, device=0, host="b")])  # other host
    with pytest.raises(ValueError, match="ranks 0 and 1 were both given device 0"):
        validate_rank_infos([_info(0, device=0), _info(1, device=0)])
    with pytest.raises(ValueError, match="both given device"):  # same PCI id, other index
        validate_rank_infos([_info(0, device=0, device_id="0000:1b"),
                             _info(1, device=1, device_id="0000:1b")])
    with pytest.raises(ConfigMismatchError, match="WORLD_SIZE differs"):
        validate_rank_infos([_info(0), _info(1, world=4)])
    with pytest.raises(ConfigMismatchError, match="backend differs"):
        validate_rank_infos([_info(0), _info(1, backend="cpu")])


# ------------------------------------------------------------------------------- EPLB runtime
@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("E,W", [(8, 2), (12, 4), (16, 8), (6, 1)])
def test_initial_placement_matches_determine_expert_map(placement, E, W):
    pl = ExpertPlacement.initial(E, W, placement)
    for r in range(W):
        _, emap = determine_expert_map(W, r, E, placement)
        if emap is None:
            want = np.arange(E)
        else:
            want = np.flatnonzero(emap >= 0)[np.argsort(emap[emap >= 0])]
        assert pl.local_logical(r).tolist() == want.tolist()


def test_initial_placement_with_redundant_experts():
    pl = ExpertPlacement.initial(6, 2, "linear", num_redundant=2)
    assert pl.phys2log.tolist() == [0, 1, 2, 3, 4, 5, 0, 1]
    assert pl.logcnt.tolist() == [2, 2, 1, 1, 1, 1]
    assert pl.log2phy[0].tolist() == [0, 6] and pl.log2phy[2].tolist() == [2, -1]
    rr = ExpertPlacement.initial(6, 2, "round_robin", num_redundant=2)
    assert rr.local_logical(0).tolist() == [0, 2, 4, 0] and rr.local_logical(1).tolist() == \
        [1, 3, 5, 1]


def test_to_physical_alternates_replicas_deterministically():
    pl = ExpertPlacement.initial(4, 2, "linear", num_redundant=2)   # 0 and 1 twice
    ids = np.array([[0, 2], [0, 3], [0, 1], [1, 0]], dtype=np.int32)
    phys = pl.to_physical(ids, rank=0)
    # expert 0's replicas are slots 0 and 4: token t takes replica (t + rank) % 2
    assert phys.tolist() == [[0, 2], [4, 3], [0, 1], [5, 4]]
    assert np.array_equal(pl.phys2log[phys], ids)
    assert np.array_equal(pl.to_physical(ids, rank=1), [[4, 2], [0, 3], [4, 5], [1, 0]])


def test_rearrange_plan_moves_every_slot_from_a_holder():
    rng = np.random.default_rng(0)
    old = ExpertPlacement.initial(8, 4, "linear", num_redundant=4)
    new = ExpertPlacement.rebalanced(rng.zipf(1.5, 8).astype(float), 12, 4)
    plan = rearrange_plan(old, new)
    assert sorted((d, dj) for _, _, d, dj in plan) == [(d, j) for d in range(4) for j in range(3)]
    for s, sj, d, dj in plan:
        assert old.local_logical(s)[sj] == new.local_logical(d)[dj]
        if new.local_logical(d)[dj] in old.local_logical(d):
            assert s == d  # already there: a local copy


def test_check_divisible_refuses_with_the_reason():
    check_divisible(8, 4)
    check_divisible(6, 4, 2)
    with pytest.raises(ValueError, match="4 ranks do not divide the 6 experts"):
        check_divisible(6, 4)
    with pytest.raises(ValueError, match="not a multiple of the world size 4"):
        check_divisible(6, 4, 1)
    with pytest.raises(ValueError, match="8 ranks do not divide the 4 experts"):
        check_divisible(4, 8)


def test_load_recorder_counts_logical_experts():
    rec = LoadRecorder(5)
    rec.record(np.array([[0, 1], [1, 4]], dtype=np.int32))
    rec.record(np.zeros((0, 2), dtype=np.int32))
    assert rec.counts.tolist() == [1, 2, 0, 0, 1] and rec.steps == 2


# ------------------------------------------------------------------------------- CPU communicator
def test_single_rank_communicator_needs_no_sockets():
    comm = CpuCommunicator(0, 1, store=None, timeout=1)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert np.array_equal(comm.all_gather(x)[0], x)
    assert np.array_equal(comm.reduce_scatter(x[None]), x)
    out, counts = comm.all_to_all_v(x, [2])
    assert np.array_equal(out, x) and counts.tolist() == [2]
    comm.destroy()


def _size_mismatch(comm):
    """Rank 1 receives into a buffer of the wrong size: a clear error, not a hang."""
    if comm.rank == 0:
        comm.send(np.zeros(10, dtype=np.float32), 1)
        return "sent"
    comm.recv(np.zeros(12, dtype=np.float32), 0)


@pytest.fixture(scope="module")
def collective_results():
    return launch(run_collectives, 3, timeout=30)


@pytest.mark.parametrize("check", COLLECTIVE_CHECKS)
def test_cpu_collectives(collective_results, check):
    assert all(res[check] for res in collective_results), \
        [res[check] for res in collective_results]


@pytest.mark.slow
def test_size_mismatch_is_a_clear_error():
    from sandbox.ep import LaunchError

    with pytest.raises(LaunchError, match="rank 0 sent a message of 40 bytes .* where 48 bytes"):
        launch(_size_mismatch, 2, timeout=10, grace=3)


def test_launch_argument_errors():
    with pytest.raises(ValueError, match="backend: expected one of"):
        launch(run_collectives, 2, backend="mpi")
    with pytest.raises(ValueError, match="world_size: expected a positive int"):
        launch(run_collectives, 0)
    with pytest.raises(ValueError, match="devices: expected 2 device indices"):
        launch(run_collectives, 2, devices=[0])


# ------------------------------------------------------------------------------- env:// without launch()
_ENV_SCRIPT = """
import os
import sys
sys.path[:0] = {path!r}
import numpy as np
from sandbox.ep import init_process_group
comm = init_process_group("cpu", timeout=60)
total = comm.all_reduce(np.array([comm.rank + 1], dtype=np.int64))
comm.barrier()
# One write(2) of a short line is atomic on a pipe: ranks that share stdout (torchrun) cannot
# interleave their words, as print()'s separate writes did under torchrun on CI.
os.write(1, f"RESULT {{comm.rank}} {{comm.world_size}} {{int(total[0])}}\\n".encode())
comm.destroy()
"""


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(cmds_envs, timeout=120):
    import subprocess

    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for cmd, env in cmds_envs]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


@pytest.mark.slow
def test_env_rendezvous_without_the_launcher():
    """Ranks started by someone else (srun, a shell loop): rank 0 serves the store on
    MASTER_PORT; SLURM's variables stand in for RANK / WORLD_SIZE / LOCAL_RANK."""
    import os
    import sys

    port = _free_port()
    script = _ENV_SCRIPT.format(path=sys.path)
    runs = []
    for r in range(3):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "EP_STORE_HOSTED")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if r == 2:  # this one looks like an srun task
            env.update(SLURM_PROCID="2", SLURM_NTASKS="3", SLURM_LOCALID="2")
        else:
            env.update(RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r))
        runs.append(([sys.executable, "-c", script], env))
    for code, out, err in _run_ranks(runs):
        assert code == 0, err
        assert "RESULT" in out and out.split("RESULT")[1].split()[1:] == ["3", "6"], out


@pytest.mark.slow
def test_torchrun_starts_cpu_ranks(tmp_path):
    """torchrun's agent owns MASTER_PORT: our store's port goes through the agent's store."""
    import os
    import shutil
    import sys

    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable),
                                                         "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed")
    script = tmp_path / "ep_rank.py"
    script.write_text(_ENV_SCRIPT.format(path=sys.path))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    [(code, out, err)] = _run_ranks([([torchrun, "--standalone", "--nproc-per-node", "2",
                                       str(script)], env)], timeout=300)
    assert code == 0, err[-3000:]
    results = sorted(line for line in out.splitlines() if line.startswith("RESULT"))
    assert results == ["RESULT 0 2 3", "RESULT 1 2 3"], out
