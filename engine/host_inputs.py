"""A step's small index tensors, built on the host and moved to the engine's device without waiting.

On CPU a host tensor is the input itself. On CUDA it is copied into pinned (page-locked) memory and
sent with non_blocking=True: the copy is queued on the current stream ahead of the kernels that
read it, and the host goes on building the step instead of waiting for it (a copy out of pageable
memory blocks the host until the bytes are staged). Pinned blocks come from torch's caching host
allocator, which hands a block out again only after the copies queued from it have completed
(it records an event on the stream of each non-blocking copy), so a later step can never
overwrite inputs that an earlier step's copy has not read yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`; on CUDA through pinned memory, without blocking the host."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def long_tensor(values: Sequence[int] | Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """int64 tensor of `values` on `device` (see to_device)."""
    return to_device(torch.tensor(values, dtype=torch.long), device)
