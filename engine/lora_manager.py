"""Which LoRA adapters an engine knows and which are loaded (resident), least recently used first.

Invariants: at most max_loras adapters are resident; `resident_names` is in LRU order (oldest first). A use
makes an adapter the newest: a step running it, or the first request that names it (the adapter is loaded then,
to check it before the request is queued). Loading one more evicts the oldest resident adapter the current step
does not run. Every adapter a request named stays *known* (its LoRARequest), so an evicted adapter is read again
from its directory when a step needs it. A name means one adapter for the engine's lifetime: a LoRARequest
reusing a known name with another path is refused. The id is not part of it: each router numbers the adapters it
loads at runtime itself (router/lora_adapters.py), so routers may send one adapter under different ids.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

import torch

from splitserve.common.errors import InvalidRequestError
from splitserve.common.lora import LoRARequest
from splitserve.engine.lora_adapter import LoRAAdapter, load_adapter
from splitserve.engine.models.llama import LlamaFamilyArch
from splitserve.engine.models.lora_linear import LoRABatch, LoRAContext, LoRAGroup


class LoRAManager:
    def __init__(self, arch: LlamaFamilyArch, context: LoRAContext, max_loras: int, max_lora_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        """context: the one the model's LoRALinears read (install_lora_linears)."""
        self.arch = arch
        self.context = context
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.device = device
        self._known: dict[str, LoRARequest] = {}
        self._resident: OrderedDict[str, LoRAAdapter] = OrderedDict()  # oldest use first
        self.num_loads = 0
        """Adapters read from disk so far (a reload after an eviction counts again)."""

    @property
    def resident_names(self) -> tuple[str, ...]:
        """The loaded adapters' names, least recently used first."""
        return tuple(self._resident)

    def register(self, request: LoRARequest) -> None:
        """A request names `request`'s adapter: InvalidRequestError naming lora_request unless it can run on this
        model. A known adapter is only compared with the one known by its name (its directory: the id may differ);
        a new one is loaded (a use)."""
        known = self._known.get(request.lora_name)
        if known is not None:
            if known.lora_path != request.lora_path:
                raise InvalidRequestError("lora_request", f"adapter {request.lora_name!r} is already known as "
                                                          f"{known}; one name means one adapter (got {request})")
            return
        self._use(request, keep=())
        self._known[request.lora_name] = request

    def batch(self, rows_by_name: dict[str, list[int]]) -> LoRABatch:
        """The step's LoRABatch: for each adapter name (every one known), the rows of the flattened batch that
        run it; loads the ones evicted since (the scheduler keeps a step within max_loras adapters)."""
        groups = []
        for name, rows in rows_by_name.items():
            adapter = self._use(self._known[name], keep=rows_by_name)
            groups.append(LoRAGroup(torch.tensor(rows, dtype=torch.long, device=self.device), adapter))
        return LoRABatch(tuple(groups))

    def _use(self, request: LoRARequest, keep: Collection[str]) -> LoRAAdapter:
        """The adapter, loaded if need be (evicting the least recently used not in `keep`), made the newest."""
        adapter = self._resident.get(request.lora_name)
        if adapter is not None:
            self._resident.move_to_end(request.lora_name)
            return adapter
        adapter = load_adapter(request, self.arch, self.max_lora_rank, self.dtype, self.device)
        self.num_loads += 1
        while len(self._resident) >= self.max_loras:
            self._evict(keep)
        self._resident[request.lora_name] = adapter
        return adapter

    def _evict(self, keep: Collection[str]) -> None:
        oldest = next(name for name in self._resident if name not in keep)
        del self._resident[oldest]
