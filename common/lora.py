"""LoRA adapter requests (vLLM's `LoRARequest`), torch-free: the router, the workers and the offline API all
name an adapter with one; and the checks of a PEFT adapter directory that need no tensors (adapter_config.json,
the weight file's presence), which `serve`'s preflight runs before Ray starts and the engine before it loads the
weights (engine/lora_adapter.py)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from splitserve.common.errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """One PEFT LoRA adapter a request runs with, as vLLM's `vllm.lora.request.LoRARequest(lora_name, lora_int_id,
    lora_path)`. Within one engine a name always means the same directory (EngineCore refuses another; the id may
    differ, as routers number their runtime loads each)."""

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


LORA_MODULE_KEYS = ("base_model_name", "name", "path")
"""The keys of vLLM's JSON form of a --lora-modules item."""


def parse_lora_modules(modules: tuple[str, ...], model_names: tuple[str, ...] = ()) -> tuple[LoRARequest, ...]:
    """vLLM's `--lora-modules` items, `name=path` or its JSON form `{"name", "path", "base_model_name"}`, as
    LoRARequests, ids 1, 2, ... in order, each path made absolute (the workers may run in another directory);
    ValueError naming the item that is neither, repeats a name, or names as base_model_name none of
    `model_names` (the served model's names: every adapter runs on that model)."""
    requests: list[LoRARequest] = []
    for item in modules:
        name, path = _lora_module(item, model_names)
        if any(request.lora_name == name for request in requests):
            raise ValueError(f"lora_modules names adapter {name!r} twice")
        requests.append(LoRARequest(name, len(requests) + 1, os.path.abspath(path)))
    return tuple(requests)


def _lora_module(item: str, model_names: tuple[str, ...]) -> tuple[str, str]:
    """(name, path) of one --lora-modules item."""
    shape = ValueError(f"lora_modules item {item!r} must be NAME=PATH or a JSON object with string name and path "
                       "(and base_model_name)")
    if not item.lstrip().startswith("{"):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise shape
        return name, path
    try:
        fields = json.loads(item)
    except ValueError:
        raise shape from None
    if not isinstance(fields, dict):
        raise shape
    unknown = sorted(set(fields) - set(LORA_MODULE_KEYS))
    if unknown:
        raise ValueError(f"lora_modules item {item!r}: unknown key {unknown[0]!r} (known: {', '.join(LORA_MODULE_KEYS)})")
    name, path, base = fields.get("name"), fields.get("path"), fields.get("base_model_name")
    if not all(isinstance(value, str) and value.strip() for value in (name, path)):
        raise shape
    if base is not None and base not in model_names:
        raise ValueError(f"lora_modules item {item!r}: base_model_name {base!r} is not a served model name "
                         f"{list(model_names)}")
    return name, path


ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")

UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head")
"""Modules PEFT can adapt that the engine does not (vLLM's extra-vocabulary embeddings and output head)."""

PEFT_DEFAULT_ALPHA = 8
"""LoraConfig's lora_alpha when adapter_config.json leaves it out."""


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of adapter_config.json the engine reads, checked."""

    rank: int
    scaling: float
    target_modules: tuple[str, ...] | None
    """The named targets; None when target_modules is a regex string or "all-linear" (the weights say which)."""


def read_adapter_config(directory: Path, max_lora_rank: int) -> AdapterConfig:
    """adapter_config.json's LoRA settings; InvalidRequestError naming lora_request for anything the engine
    cannot run: not a LoRA adapter, rank above max_lora_rank, a bias, DoRA, per-module ranks, saved modules."""
    path = directory / ADAPTER_CONFIG_FILE
    if not path.is_file():
        raise bad_adapter(directory, f"no {ADAPTER_CONFIG_FILE} (not a PEFT adapter directory)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise bad_adapter(directory, f"{ADAPTER_CONFIG_FILE} is not readable JSON ({error})") from None
    if not isinstance(raw, dict):
        raise bad_adapter(directory, f"{ADAPTER_CONFIG_FILE} is not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise bad_adapter(directory, f"{ADAPTER_CONFIG_FILE} is not a LoRA adapter's (peft_type {raw['peft_type']!r})")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise bad_adapter(directory, f"r must be an integer >= 1, got {rank!r}")
    if rank > max_lora_rank:
        raise bad_adapter(directory, f"rank {rank} exceeds max_lora_rank {max_lora_rank} (raise --max-lora-rank)")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise bad_adapter(directory, f"lora_alpha must be a number, got {alpha!r}")
    _check_unsupported_fields(directory, raw)
    targets = raw.get("target_modules")
    named = tuple(targets) if isinstance(targets, list) else None
    for target in named or ():
        if target in UNSUPPORTED_TARGETS:
            raise bad_adapter(directory, f"target module {target!r} is not supported (LoRA applies to the decoder "
                                         f"layers' projections only)")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, float(scaling), named)


def _check_unsupported_fields(directory: Path, raw: dict) -> None:
    if raw.get("bias", "none") != "none":
        raise bad_adapter(directory, f"bias {raw['bias']!r} is not supported (only \"none\")")
    for name in ("use_dora", "fan_in_fan_out"):
        if raw.get(name):
            raise bad_adapter(directory, f"{name} is not supported")
    for name in ("rank_pattern", "alpha_pattern"):
        if raw.get(name):
            raise bad_adapter(directory, f"{name} (per-module ranks or alphas) is not supported")
    if raw.get("modules_to_save"):
        raise bad_adapter(directory, f"modules_to_save {raw['modules_to_save']!r} is not supported (the adapter "
                                     f"would replace whole modules)")


def adapter_weight_file(directory: Path) -> Path:
    """The adapter's weight file (ADAPTER_WEIGHT_FILES, safetensors first); InvalidRequestError when it has none."""
    for name in ADAPTER_WEIGHT_FILES:
        if (directory / name).is_file():
            return directory / name
    raise bad_adapter(directory, f"no {' or '.join(ADAPTER_WEIGHT_FILES)}")


def bad_adapter(directory: Path, reason: str) -> InvalidRequestError:
    """The error of an adapter directory the engine cannot run, naming lora_request and the directory."""
    return InvalidRequestError("lora_request", f"LoRA adapter {str(directory)!r}: {reason}")
