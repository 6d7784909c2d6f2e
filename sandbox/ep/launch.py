"""Start one process per rank (one per GPU), rendezvous, and stop cleanly when one fails.

Two ways in, one rendezvous:

* `launch(fn, world_size, backend)` (one machine): starts `world_size` processes with
  `multiprocessing.get_context("spawn")` (never fork: a forked child of a process that
  touched CUDA inherits a broken context), hosts the rendezvous store in the parent on
  127.0.0.1, and calls `fn(comm, *args, **kwargs)` in every rank. It returns the list of
  the ranks' return values, or raises LaunchError with every rank's story.
* `init_process_group(backend)` (torchrun, srun, or your own launcher): reads the env://
  variables `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` (falling back
  to SLURM's `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`), rank 0 hosts the store, and
  returns this rank's communicator. See docs/ep.md for the multi-node recipe.

Rendezvous, before any collective: each rank publishes (host, device, backend, world
size); every rank checks them all and refuses with a clear error a world-size or backend
mismatch, two ranks on one device of one host, or a device index that does not exist.
Then the backend's communicator is built (the NCCL unique id goes through the store).

Faults (one machine): a rank that raises reports its traceback, aborts its communicator
(peers blocked on it fail at once) and exits 1; a rank that dies is noted in the store by
the parent (NCCL peers' watchdogs read the note and abort); a rank that hangs makes its
peers' exchanges time out after `timeout` seconds. After the first failure the parent
waits `grace` seconds for the other ranks' own errors, then kills what is left and joins
every child: no orphans. Children also die with the parent (PR_SET_PDEATHSIG on Linux).
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import threading
import time
import traceback

from .errors import (CommPeerError, CommTimeoutError, ConfigMismatchError, LaunchError,
                     StoreTimeoutError)
from .store import StoreClient, StoreServer

__all__ = ["launch", "init_process_group", "DistEnv", "validate_rank_infos"]

BACKENDS = ("cpu", "nccl")


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """The env:// rendezvous variables of one rank."""
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    store_port: int           # where our store listens (0: wherever rank 0's OS puts it)
    host_store: bool          # whether this process starts the store server
    agent_store_key: str = ""  # torchrun: where rank 0 announces the port in the agent's store

    @classmethod
    def from_environ(cls, environ=None) -> "DistEnv":
        env = os.environ if environ is None else environ

        def read(names, what):
            for n in names:
                if env.get(n, "") != "":
                    try:
                        return int(env[n])
                    except ValueError:
                        raise ValueError(f"{n}: expected an integer {what}, got {env[n]!r}")
            raise ValueError(f"{names[0]}: expected the environment variable ({what}; set by "
                             f"torchrun, srun or sandbox.ep.launch), got nothing")

        rank = read(["RANK", "SLURM_PROCID"], "rank")
        world_size = read(["WORLD_SIZE", "SLURM_NTASKS"], "world size")
        local_rank = read(["LOCAL_RANK", "SLURM_LOCALID"], "local rank") \
            if any(env.get(n) for n in ("LOCAL_RANK", "SLURM_LOCALID")) else rank
        if not 0 <= rank < world_size:
            raise ValueError(f"RANK: expected a rank in [0, WORLD_SIZE={world_size}), got {rank}")
        addr = env.get("MASTER_ADDR", "")
        if not addr:
            raise ValueError("MASTER_ADDR: expected the host of rank 0 (127.0.0.1 on one "
                             "machine), got nothing")
        port = read(["MASTER_PORT"], "port")
        # torchrun's agent already serves its own store on MASTER_PORT. A fixed neighbour
        # (MASTER_PORT + 1) is not safe: Linux hands out ephemeral source ports next to the
        # one torchrun just picked, and CI saw that port taken. So rank 0 binds ours on a
        # port the OS chooses and announces it in the agent's store, under a key of this run
        # and restart. Older torchrun (no agent store) leaves the next port to us.
        # EP_STORE_PORT overrides all of it; under launch() the parent hosts the store.
        agent_store_key = ""
        if env.get("EP_STORE_PORT"):
            store_port = read(["EP_STORE_PORT"], "port")
        elif env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            store_port = 0
            agent_store_key = (f"moe_sandbox/{env.get('TORCHELASTIC_RUN_ID', '')}/"
                               f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/store_port")
        elif env.get("TORCHELASTIC_RUN_ID"):
            store_port = port + 1
        else:
            store_port = port
        host_store = rank == 0 and env.get("EP_STORE_HOSTED", "") != "1"
        return cls(rank, world_size, local_rank, addr, port, store_port, host_store,
                   agent_store_key)


def validate_rank_infos(infos: list[dict]) -> None:
    """Refuse a rendezvous whose ranks disagree on the basics (pure function, tested alone).

    infos[p] = {rank, world_size, backend, host, device, device_id}. Raises ValueError /
    ConfigMismatchError naming the ranks."""
    W = len(infos)
    for p, info in enumerate(infos):
        if info["rank"] != p:
            raise ValueError(f"rank {p}: published rank {info['rank']} (two ranks share a RANK?)")
        if info["world_size"] != W:
            raise ConfigMismatchError(f"WORLD_SIZE differs across ranks: rank {p} has "
                                      f"{info['world_size']}, the rendezvous has {W} ranks")
        if info["backend"] != infos[0]["backend"]:
            raise ConfigMismatchError(f"backend differs across ranks: rank {p} has "
                                      f"{info['backend']!r}, rank 0 has {infos[0]['backend']!r}")
    seen = {}
    for p, info in enumerate(infos):
        if info.get("device") is None:
            continue
        key = (info["host"], info.get("device_id") or info["device"])
        if key in seen:
            raise ValueError(
                f"device: ranks {seen[key]} and {p} were both given device {info['device']} "
                f"on host {info['host']} (each rank needs its own GPU; check LOCAL_RANK and "
                f"CUDA_VISIBLE_DEVICES)")
        seen[key] = p


def _device_info(backend, device, local_rank):
    """(device index or None, a stable id of the physical device) for this rank."""
    if backend == "cpu":
        return (None, None) if device is None else (device, f"cpu:{device}")
    index = local_rank if device is None else device
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"device: expected an int GPU index, got {type(index).__name__}")
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    if not 0 <= index < count:
        hint = (" (each process sees only its own GPU, e.g. srun --gpus-per-task=1: pass "
                "device=0)" if count == 1 and device is None else "")
        raise ValueError(f"device: expected a GPU index in [0, {count}) on this host, got "
                         f"{index} (LOCAL_RANK={local_rank}){hint}")
    try:
        dev_id = cupy.cuda.Device(index).pci_bus_id
    except Exception:  # older CuPy: the index is the best we have
        dev_id = f"cuda:{index}"
    return index, dev_id


def _local_address_towards(host: str, port: int) -> str:
    """The address of the interface this machine uses to reach `host` (what peers on other
    nodes can connect to; gethostname() often resolves to 127.0.1.1)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP: no packet is sent, the route is looked up
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


_GENERATION = [0]


def _agent_store_port(env: DistEnv, key: str, own_port: int | None, timeout: float) -> int:
    """Under torchrun: rank 0 announces its store's port in the agent's store; the others
    read it there (waiting up to `timeout`). torch is present wherever torchrun is."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        agent = dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                              timeout=timedelta(seconds=timeout))
        if own_port is not None:
            agent.set(key, str(own_port))
        return int(agent.get(key))
    except RuntimeError as exc:  # torch reports a store timeout or refusal as RuntimeError
        raise StoreTimeoutError(
            f"rank {env.rank}: could not learn the EP store's port from torchrun's store at "
            f"{env.master_addr}:{env.master_port} within {timeout:.1f} s ({exc}); set "
            f"EP_STORE_PORT to choose the port instead") from exc


def init_process_group(backend: str = "cpu", *, device=None, timeout: float = 60.0,
                       init_timeout: float | None = None, environ=None):
    """This rank's communicator, from the env:// variables (see the module docstring).

    backend: "cpu" (sockets, NumPy buffers) or "nccl" (cupy.cuda.nccl, CuPy buffers).
    device: the GPU index for "nccl" (default LOCAL_RANK); for "cpu" an optional label
        used only by the duplicate-device check.
    timeout: seconds any wait on a peer may last (collectives, p2p, config checks) before
        failing.
    init_timeout: the same for joining: the rendezvous and the communicator's creation
        (processes start at different speeds); default max(timeout, 60).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
    init_timeout = max(timeout, 60.0) if init_timeout is None else float(init_timeout)
    env = DistEnv.from_environ(environ)
    if backend == "nccl":
        # NVLink SHARP (multicast) stays off on these machines; respect it in every rank
        os.environ["NCCL_NVLS_ENABLE"] = "0"
    gen = _GENERATION[0]
    _GENERATION[0] += 1
    ns = f"comm{gen}"
    server = None
    store_port = env.store_port
    if env.host_store:
        bind = "127.0.0.1" if env.master_addr in ("127.0.0.1", "localhost") else "0.0.0.0"
        server = StoreServer(bind, store_port)
        store_port = server.port
    if env.agent_store_key:
        store_port = _agent_store_port(env, f"{env.agent_store_key}/{ns}",
                                       store_port if server else None, init_timeout)
    store = StoreClient(env.master_addr, store_port, timeout=init_timeout)
    store._server = server  # keep rank 0's server alive as long as its client
    index, dev_id = _device_info(backend, device, env.local_rank)
    info = dict(rank=env.rank, world_size=env.world_size, backend=backend,
                host=socket.gethostname(), device=index, device_id=dev_id, pid=os.getpid())
    import json

    store.set(f"{ns}/rdzv/{env.rank}", json.dumps(info))
    infos = []
    deadline = time.monotonic() + init_timeout
    for p in range(env.world_size):
        try:
            infos.append(json.loads(store.get(f"{ns}/rdzv/{p}",
                                              timeout=max(0.1, deadline - time.monotonic()))))
        except StoreTimeoutError as exc:
            missing = [q for q in range(env.world_size)
                       if not store.check(f"{ns}/rdzv/{q}")]
            raise StoreTimeoutError(
                f"rank {env.rank}: ranks {missing} did not join the rendezvous within "
                f"{init_timeout:.1f} s (not started, crashed, or a different MASTER_PORT)"
            ) from exc
    validate_rank_infos(infos)

    if backend == "cpu":
        from .comm_cpu import CpuCommunicator

        host = "127.0.0.1" if env.master_addr in ("127.0.0.1", "localhost") else \
            _local_address_towards(env.master_addr, env.master_port)
        comm = CpuCommunicator(env.rank, env.world_size, store, timeout=init_timeout,
                               namespace=ns, host=host)
        comm.timeout = timeout
        store.timeout = timeout
        return comm
    from .comm_nccl import NcclCommunicator

    comm = NcclCommunicator(env.rank, env.world_size, store, device=index, timeout=init_timeout,
                            namespace=ns)
    comm.timeout = timeout   # joined: from now on the exchange timeout applies
    store.timeout = timeout
    return comm


# ---------------------------------------------------------------------------------------
# The single-machine launcher
# ---------------------------------------------------------------------------------------
def _die_with_parent():
    """Ask Linux to SIGKILL this process when its parent dies (no orphans if the launcher is
    killed). Elsewhere a thread polls getppid()."""
    parent = os.getppid()
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:
        pass

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="ep-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _worker_main(fn, rank, world_size, backend, port, timeout, init_timeout, device, args,
                 kwargs, conn):
    _die_with_parent()
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "EP_STORE_HOSTED": "1",
        # never NVLink multicast (NVLS); the machines set it, children keep it
        "NCCL_NVLS_ENABLE": "0",
    })
    comm = None
    try:
        comm = init_process_group(backend, device=device, timeout=timeout,
                                  init_timeout=init_timeout)
        result = fn(comm, *args, **(kwargs or {}))
        comm.synchronize()
        conn.send(("ok", rank, result))
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        tb = traceback.format_exc()
        message = f"{type(exc).__name__}: {exc}"
        if comm is not None:
            comm.report_failure(message)
            try:
                comm.abort()
            except Exception:
                pass
        try:
            conn.send(("error", rank, type(exc).__name__, message, tb))
        except Exception:
            pass
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    try:
        comm.destroy()
    except Exception:
        pass
    conn.close()


_SECONDARY = (CommPeerError.__name__, CommTimeoutError.__name__, StoreTimeoutError.__name__)


def launch(fn, world_size: int, backend: str = "cpu", *, args=(), kwargs=None,
           timeout: float = 60.0, grace: float | None = None, run_timeout: float | None = None,
           devices=None, init_timeout: float | None = None):
    """Run `fn(comm, *args, **kwargs)` in `world_size` spawned processes; return their results.

    fn: a module-level (picklable) function. backend: "cpu" or "nccl".
    timeout: seconds a rank waits on a peer before failing (every exchange, config checks).
    init_timeout: the same for the rendezvous and communicator creation (spawned processes
        start at different speeds); default max(timeout, 60).
    grace: after the first failure, seconds to let the other ranks fail on their own (their
        messages are kept) before they are killed; default min(timeout, 10) + 2.
    run_timeout: optional wall-clock limit of the whole run (then every rank is killed).
    devices: optional per-rank device indices (default: rank r uses device r).
    Raises LaunchError (its `failures` maps rank -> message) if any rank fails.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if devices is not None and len(devices) != world_size:
        raise ValueError(f"devices: expected {world_size} device indices, got {len(devices)}")
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    grace = min(timeout, 10.0) + 2.0 if grace is None else float(grace)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # inherited by the spawned children

    server = StoreServer("127.0.0.1", 0)
    ctx = multiprocessing.get_context("spawn")
    procs, conns = [], []
    results, failures = {}, {}
    order = []  # ranks in the order they failed
    try:
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            dev = None if devices is None else devices[rank]
            p = ctx.Process(target=_worker_main, name=f"ep-rank{rank}", daemon=True,
                            args=(fn, rank, world_size, backend, server.port, timeout,
                                  init_timeout, dev,
                                  tuple(args), kwargs, child_conn))
            p.start()
            child_conn.close()
            procs.append(p)
            conns.append(parent_conn)

        start = time.monotonic()
        stop_at = None  # set at the first failure: now + grace
        pending = set(range(world_size))
        live_conns = {c: r for r, c in enumerate(conns)}
        while pending:
            now = time.monotonic()
            if run_timeout is not None and now - start > run_timeout:
                for r in sorted(pending):
                    failures[r] = (f"still running after the run_timeout of {run_timeout:.1f} s; "
                                   f"killed")
                    order.append(r)
                break
            if stop_at is not None and now > stop_at:
                for r in sorted(pending):
                    failures[r] = (f"still running {grace:.1f} s after rank {order[0]} failed; "
                                   f"killed (hung, or blocked on a peer)")
                    order.append(r)
                break
            waits = list(live_conns) + [procs[r].sentinel for r in pending]
            limit = 0.5 if stop_at is None else max(0.01, min(0.5, stop_at - now))
            ready = multiprocessing.connection.wait(waits, timeout=limit)
            for obj in ready:
                if obj in live_conns:
                    r = live_conns[obj]
                    try:
                        msg = obj.recv()
                    except (EOFError, OSError):
                        del live_conns[obj]
                        continue
                    if msg[0] == "ok":
                        results[r] = msg[2]
                    else:
                        _, _, kind, message, tb = msg
                        failures[r] = (kind, message, tb)
                        order.append(r)
                        server.set_local(f"error/{r}", message.encode())
            for r in list(pending):
                if r in results or r in failures:
                    pending.discard(r)
                    continue
                if procs[r].exitcode is not None:
                    if conns[r] in live_conns and conns[r].poll():
                        continue  # its last message is still in the pipe: read it first
                    code = procs[r].exitcode
                    how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
                    note = server.get_local(f"error/{r}")  # a watchdog's last word, if any
                    why = f" ({note.decode(errors='replace')})" if note else ""
                    failures[r] = ("died", f"rank {r} {how} without reporting a result{why} "
                                           f"(its stderr has the details)", "")
                    order.append(r)
                    server.set_local(f"error/{r}", f"rank {r} {how}".encode())
                    pending.discard(r)
            if failures and stop_at is None:
                stop_at = time.monotonic() + grace
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=3.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=3.0)
        for c in conns:
            c.close()
        server.close()

    if failures:
        raise LaunchError(_summary(failures, order, world_size), {
            r: (f if isinstance(f, str) else f[1]) for r, f in failures.items()})
    return [results[r] for r in range(world_size)]


def _summary(failures, order, world_size):
    """Primary failures first (a rank's own exception or death), then the ranks that only
    saw a peer fail (comm errors), then the ones that were killed."""
    def rank_key(r):
        f = failures[r]
        if isinstance(f, str):
            return 2
        return 1 if f[0] in _SECONDARY else 0

    ranks = sorted(failures, key=lambda r: (rank_key(r), order.index(r)))
    lines = [f"{len(failures)} of {world_size} ranks failed:"]
    for r in ranks:
        f = failures[r]
        if isinstance(f, str):
            lines.append(f"  rank {r}: {f}")
        else:
            lines.append(f"  rank {r}: {f[1]}")
    first = failures[ranks[0]]
    if not isinstance(first, str) and first[2]:
        lines.append(f"traceback of rank {ranks[0]}:\n{first[2]}")
    return "\n".join(lines)

