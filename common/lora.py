"""LoRA adapter requests (vLLM's `LoRARequest`), torch-free: the router, the workers and the offline API all
name an adapter with one."""

from __future__ import annotations

import os
from dataclasses import dataclass

from splitserve.common.errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """One PEFT LoRA adapter a request runs with, as vLLM's `vllm.lora.request.LoRARequest(lora_name, lora_int_id,
    lora_path)`. Within one engine a name always means the same id and directory (EngineCore refuses another)."""

    lora_name: str
    """The adapter's name: what the OpenAI API's `model` field selects, and what salts the prefix cache (requests
    of different adapters never share KV blocks)."""
    lora_int_id: int
    """vLLM's integer id of the adapter, >= 1 (0 is the base model in vLLM)."""
    lora_path: str
    """The adapter's directory: adapter_config.json and adapter_model.safetensors (or adapter_model.bin)."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError("lora_request", f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequestError("lora_request", f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidRequestError("lora_request", f"lora_path must be a non-empty string, got {self.lora_path!r}")


def check_lora_request(lora_request: object) -> None:
    """InvalidRequestError naming lora_request unless it is None or a LoRARequest."""
    if lora_request is not None and not isinstance(lora_request, LoRARequest):
        raise InvalidRequestError("lora_request", f"must be a LoRARequest (splitserve.common.lora) or None, got "
                                                  f"{type(lora_request).__name__}")


def parse_lora_modules(modules: tuple[str, ...]) -> tuple[LoRARequest, ...]:
    """vLLM's `--lora-modules name=path ...` as LoRARequests, ids 1, 2, ... in order, each path made absolute (the
    workers may run in another directory); ValueError naming the item that is not `name=path` or repeats a name."""
    requests: list[LoRARequest] = []
    for item in modules:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules item {item!r} must be NAME=PATH (an adapter's name and its directory)")
        if any(request.lora_name == name for request in requests):
            raise ValueError(f"lora_modules names adapter {name!r} twice")
        requests.append(LoRARequest(name, len(requests) + 1, os.path.abspath(path)))
    return tuple(requests)
