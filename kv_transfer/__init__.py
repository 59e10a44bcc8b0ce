"""Moving KV blocks between workers: connectors (per-request state machines) over a backend.

`make_backend` builds a worker's transfer agent; NIXL is imported only when asked for, so
this package imports (and its in-process backend runs) without NIXL installed.
"""

import importlib.util

from splitserve.common.kv_transfer_types import AgentMetadata
from splitserve.kv_transfer.base import (KVLayoutMismatchError, KVTransferError, PullHandle, PullState,
                                         TransferBackend)
from splitserve.kv_transfer.connector import (ConsumerConnector, ConsumerStats, InvalidTransitionError, LeaseState,
                                              ProducerConnector, ProducerStats, PullOutcome, PullStatus,
                                              ReleasedLease)
from splitserve.kv_transfer.inprocess import InProcessBackend

BACKENDS = ("nixl", "inprocess")
NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")
"""Where NIXL's Python API can live, in the order tried: the `nixl` meta package (it picks a CUDA variant),
then a variant installed alone: nixl-cu12 (what this project installs) or nixl-cu13 (a CUDA 13 machine's)."""


def nixl_module() -> str | None:
    """The first of NIXL_MODULES that is installed (found without importing it); None without NIXL."""
    return next((name for name in NIXL_MODULES if importlib.util.find_spec(name) is not None), None)


def make_backend(kind: str, agent_name: str) -> TransferBackend:
    """A new transfer agent of `kind` (one of BACKENDS) named `agent_name`, unique per worker start."""
    if kind == "inprocess":
        return InProcessBackend(agent_name)
    if kind == "nixl":
        from splitserve.kv_transfer.nixl_backend import NixlBackend

        return NixlBackend(agent_name)
    raise ValueError(f"unknown transfer backend {kind!r}: expected one of {', '.join(BACKENDS)}")


__all__ = ["AgentMetadata", "BACKENDS", "NIXL_MODULES", "ConsumerConnector", "ConsumerStats", "InProcessBackend",
           "InvalidTransitionError", "KVLayoutMismatchError", "KVTransferError", "LeaseState", "ProducerConnector",
           "ProducerStats", "PullHandle", "PullOutcome", "PullState", "PullStatus", "ReleasedLease",
           "TransferBackend", "make_backend", "nixl_module"]
