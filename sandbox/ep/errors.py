"""The errors of the expert-parallel runtime. Each says which rank, which operation and why."""
from __future__ import annotations


class EPError(RuntimeError):
    """Base class of every expert-parallel runtime error."""


class CommTimeoutError(EPError, TimeoutError):
    """A collective or point-to-point exchange waited longer than the timeout for a peer."""


class CommPeerError(EPError):
    """A peer died, closed its connection, aborted, or reported a failure."""


class CommUsageError(EPError, ValueError):
    """The ranks called different operations, or with buffers of different sizes."""


class ConfigMismatchError(EPError, ValueError):
    """The ranks were given different configurations (refused before any collective)."""


class StoreTimeoutError(EPError, TimeoutError):
    """The rendezvous store did not answer, or a key did not appear in time."""


class LaunchError(EPError):
    """One or more ranks of a launched group failed; `failures` maps rank -> message."""

    def __init__(self, message: str, failures=None):
        super().__init__(message)
        self.failures = dict(failures or {})
