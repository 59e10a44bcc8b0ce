"""The LoRA adapters a router's OpenAI API serves by name (--lora-modules), and vLLM's runtime loading and unloading
of them (/v1/load_lora_adapter, /v1/unload_lora_adapter, when SPLITSERVE_ALLOW_RUNTIME_LORA_UPDATING allows it).

Invariant: a name means one adapter binding (id and directory) for the router's lifetime. The workers' engines
and the prefix cache know an adapter by its name and directory (its name roots the block hashes; the id, which
each router numbers itself, may differ between routers), so a name reloaded from another directory would meet the
old adapter's weights and KV blocks: it is refused. A name unloaded and loaded
again from the same directory gets its old id back. Ids are never reused for another adapter.
"""

from __future__ import annotations

import os

from splitserve.common.errors import InvalidRequestError
from splitserve.common.lora import LoRARequest
from splitserve.router.tokenizer import check_unicode

ADAPTER_CONFIG = "adapter_config.json"
RUNTIME_UPDATING_ENV = ("SPLITSERVE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
"""Environment variables that turn the runtime loading endpoints on ("true" or "1"; vLLM's name too)."""


def runtime_updating_allowed(environ: dict[str, str] | None = None) -> bool:
    """Whether RUNTIME_UPDATING_ENV asks for the runtime loading endpoints (vLLM gates them the same way)."""
    environ = os.environ if environ is None else environ
    return any(environ.get(name, "").strip().lower() in ("1", "true") for name in RUNTIME_UPDATING_ENV)


class UnknownAdapterError(LookupError):
    """An unload naming no loaded adapter (404, as vLLM)."""


class AdapterRegistry:
    """Name -> LoRARequest of the loaded adapters, in load order; and every binding a name ever had."""

    def __init__(self, adapters: tuple[LoRARequest, ...], model_names: frozenset[str]) -> None:
        """adapters: --lora-modules' (distinct names, none a model name: the cluster config checked them)."""
        self._loaded = {adapter.lora_name: adapter for adapter in adapters}
        self._bindings = dict(self._loaded)
        self._model_names = model_names
        self._next_id = max((adapter.lora_int_id for adapter in adapters), default=0) + 1

    def get(self, name: str | None) -> LoRARequest | None:
        return self._loaded.get(name) if name is not None else None

    def loaded(self) -> tuple[LoRARequest, ...]:
        """The loaded adapters, in load order."""
        return tuple(self._loaded.values())

    def load(self, name: object, path: object) -> LoRARequest:
        """Serve the PEFT adapter at `path` as `name`; InvalidRequestError naming the field for a name already
        loaded, a name without a UTF-8 form (a lone surrogate), a model's name, a name once bound to another
        directory, or a directory without adapter_config.json. The workers load it when a request first names it."""
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("lora_name", f"must be a non-empty string, got {name!r}")
        check_unicode(name, "lora_name")  # every answer naming the adapter (/v1/models, its completions) echoes it
        if not isinstance(path, str) or not path:
            raise InvalidRequestError("lora_path", f"must be a non-empty string, got {path!r}")
        if name in self._loaded:
            raise InvalidRequestError("lora_name", f"The lora adapter '{name}' has already been loaded.")
        if name in self._model_names:
            raise InvalidRequestError("lora_name", f"'{name}' is the served model's name")
        path = os.path.abspath(path)
        earlier = self._bindings.get(name)
        if earlier is not None and earlier.lora_path != path:
            raise InvalidRequestError("lora_name", f"'{name}' was the adapter at {earlier.lora_path} on this server; "
                                                   f"a name serves one adapter for the server's lifetime (the workers "
                                                   f"and the prefix cache know it by name): choose another name")
        if not os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
            raise InvalidRequestError("lora_path", f"{path} has no {ADAPTER_CONFIG} (not a PEFT adapter directory)")
        adapter = earlier or LoRARequest(name, self._take_id(), path)
        self._loaded[name] = self._bindings[name] = adapter
        return adapter

    def unload(self, name: object) -> LoRARequest:
        """Stop serving `name` (requests already running finish with it); UnknownAdapterError if not loaded."""
        if not isinstance(name, str) or name not in self._loaded:
            raise UnknownAdapterError(f"The lora adapter '{name}' cannot be found.")
        return self._loaded.pop(name)

    def _take_id(self) -> int:
        adapter_id, self._next_id = self._next_id, self._next_id + 1
        return adapter_id
