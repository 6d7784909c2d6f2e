"""Expert parallelism: an MoE layer whose experts are spread over ranks (GPUs over NCCL, or
CPU processes over sockets), with two dispatch/combine schemes and EPLB.

    wire.py          how rows travel: bf16 as its uint16 bytes (raw / view_as)
    comm.py          the communicator interface (send/recv in groups, all_gather, ...)
    comm_cpu.py      CPU communicator: sockets between processes (CI runs everything here)
    comm_nccl.py     NCCL through cupy.cuda.nccl, with timeouts and abort
    store.py         the TCP key-value store of the rendezvous
    launch.py        launch() one process per rank; init_process_group() from env://
    eplb_runtime.py  physical experts, logical->physical map, replica choice, load record
    layout.py        the all-to-all-v layout of the fused dispatch, in NumPy (and its choice)
    dispatch.py      all-gather / reduce-scatter and all-to-all-v dispatch and combine
    layer.py         EPMoE: the layer under expert parallelism
    checks.py        the parity and fault checks run inside launched ranks (tests, CLI)
    cli.py           `moe-sandbox ep ...` (cli_main)

docs/ep.md tells the story; `python -m sandbox.ep --help` runs the command line.
"""
from .comm import Communicator
from .errors import (CommPeerError, CommTimeoutError, CommUsageError, ConfigMismatchError,
                     EPError, LaunchError, StoreTimeoutError)
from .launch import init_process_group, launch

__all__ = [
    "Communicator", "CommPeerError", "CommTimeoutError", "CommUsageError",
    "ConfigMismatchError", "EPError", "LaunchError", "StoreTimeoutError",
    "init_process_group", "launch", "cli_main", "EPMoE", "EPConfig",
]


def __getattr__(name):
    # the layer and the CLI pull in the reference and (maybe) CuPy: load them on first use
    if name == "cli_main":
        from .cli import cli_main
        return cli_main
    if name in ("EPMoE", "EPConfig"):
        from . import layer
        return getattr(layer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
