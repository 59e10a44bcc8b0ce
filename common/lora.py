"""LoRA adapter requests (vLLM's `LoRARequest`), torch-free: the router, the workers and the offline API all
name an adapter with one."""

from __future__ import annotations

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
