"""Engine and generation-defaults configuration (torch-free, frozen, validated on construction)."""

from __future__ import annotations

import functools
import reprlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import get_args, get_type_hints

from splitserve.common.errors import InvalidRequestError, json_excerpt
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.pooling import RUNNERS, PoolerConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
VLLM_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
"""vLLM's other names of DTYPES (its --dtype and LLM(dtype=...)), mapped to the engine's."""
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flashinfer")
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
"""auto stores KV in the model's dtype; int8 / fp8_e4m3 store codes plus a scale per token per KV head."""
VLLM_KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
"""vLLM's other names of KV_CACHE_DTYPES (its --kv-cache-dtype and LLM(kv_cache_dtype=...): its fp8 is e4m3)."""
SPECULATIVE_METHODS = ("ngram", "draft")
DEFAULT_BATCH_LIMITS = {"ngram": 16, "draft": 2}
"""Per method, the most decoding requests a step speculates for by default (bench/speculative.py
on the development CPU, code continuation: n-gram still paid at 16 and broke even at 32; the
draft model paid at 1 and lost at 4)."""
QUANTIZATION_METHODS = ("auto", "none", "int8", "int4", "gptq", "awq")
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
SCHEDULING_POLICIES = ("fcfs", "priority")
"""vLLM's scheduling policies: first come first served, or by each request's priority (lower first)."""
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30
"""KV pool size when no sizing field is given: 1 GiB."""


def check_priority(priority: object, scheduling_policy: str) -> None:
    """InvalidRequestError naming `priority` unless it is an integer (no bool) the policy serves: any
    under priority, only 0 (the default) under fcfs, as vLLM refuses one when priority scheduling is off."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError("priority", f"must be an integer, got {json_excerpt(priority)}")
    if priority != 0 and scheduling_policy != "priority":
        raise InvalidRequestError("priority", f"is {priority}, but priority scheduling is not enabled: the scheduling "
                                              f"policy is {scheduling_policy!r} (set scheduling_policy, "
                                              f"--scheduling-policy, to 'priority')")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


SCALAR_KINDS = {bool: "a boolean", int: "an integer", float: "a finite number", str: "a string", type(None): "null"}
"""The scalar field types a config checks by value, each as its messages name it."""


def is_scalar_kind(value: object, kind: object) -> bool:
    """Whether `value` is a valid `kind` (one of SCALAR_KINDS): an int is a float, a bool is no number,
    inf and nan are no float."""
    if isinstance(value, bool) or kind is bool:
        return isinstance(value, bool) and kind is bool
    if kind is float:  # the comparison is False for inf and nan
        return isinstance(value, (int, float)) and abs(value) <= sys.float_info.max
    return isinstance(value, kind)


@functools.cache
def _scalar_fields(config_class: type) -> tuple[tuple[str, tuple[type, ...]], ...]:
    """(name, allowed kinds) of config_class's fields typed with scalars only (`int`, `float | None`, ...)."""
    hints = get_type_hints(config_class)
    kinds = {spec.name: get_args(hints[spec.name]) or (hints[spec.name],) for spec in fields(config_class)}
    return tuple((name, allowed) for name, allowed in kinds.items() if all(kind in SCALAR_KINDS for kind in allowed))


def check_scalar_fields(config: object) -> None:
    """ValueError naming the first scalar-typed field whose value is not of its type ("block_size must be
    an integer, got '16'"): a config built in Python is held to what a config file is (deploy/cluster_config)."""
    for name, allowed in _scalar_fields(type(config)):
        value = getattr(config, name)
        _check(any(is_scalar_kind(value, kind) for kind in allowed),
               f"{name} must be {' or '.join(SCALAR_KINDS[kind] for kind in allowed)}, got {reprlib.repr(value)}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding of one engine: a proposer guesses tokens, the target model verifies
    them in one forward pass, and the output distribution stays exactly the target's."""

    method: str = "ngram"
    """ngram (prompt lookup: the tokens that followed the latest earlier occurrence of the
    context's last n tokens) or draft (a smaller model with the same tokenizer, run greedily)."""
    num_speculative_tokens: int = 4
    """Most draft tokens verified per request per step (k); the adaptive rule may use fewer."""
    ngram_min: int = 1
    """ngram: the shortest suffix looked up in the context."""
    ngram_max: int = 4
    """ngram: the longest suffix looked up (longer suffixes are tried first)."""
    draft_model: str | None = None
    """draft: the draft model's directory (or the embedded `default-draft`); it must share the
    target's tokenizer. None with method draft is refused."""
    disable_above_batch_size: int | None = None
    """Nobody speculates in a step that decodes more requests than this (verification costs
    k + 1 tokens of compute per request, which stops paying once the batch fills the device).
    None: the method's default, DEFAULT_BATCH_LIMITS, the crossover bench/speculative.py measured
    on CPU (a draft model's own forward passes stop paying at smaller batches than n-gram lookup)."""
    adaptive: bool = True
    """Each request's k follows its recent acceptance (an average of its accepted lengths, plus
    one), between 1 and num_speculative_tokens; False: always num_speculative_tokens."""

    @property
    def batch_limit(self) -> int:
        """The effective disable_above_batch_size."""
        if self.disable_above_batch_size is not None:
            return self.disable_above_batch_size
        return DEFAULT_BATCH_LIMITS[self.method]

    def __post_init__(self) -> None:
        check_scalar_fields(self)
        _check(self.method in SPECULATIVE_METHODS, f"speculative.method must be one of {SPECULATIVE_METHODS}, "
                                                   f"got {self.method!r}")
        _check(1 <= self.num_speculative_tokens <= 16,
               f"speculative.num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        _check(1 <= self.ngram_min <= self.ngram_max,
               f"speculative ngram sizes need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        _check(self.method != "draft" or bool(self.draft_model),
               "speculative.draft_model must name a model directory when method is 'draft'")
        _check(self.disable_above_batch_size is None or self.disable_above_batch_size >= 0,
               f"speculative.disable_above_batch_size must be >= 0 or null, got {self.disable_above_batch_size}")

    @classmethod
    def from_vllm(cls, mapping: Mapping[str, object]) -> SpeculativeConfig:
        """The config of a speculative-config mapping in vLLM's spelling or ours (speculative_settings)."""
        return cls(**speculative_settings(mapping))


VLLM_SPECULATIVE_METHODS = {"ngram": "ngram", "ngram_gpu": "ngram", "draft_model": "draft"}
"""vLLM's speculative methods that splitserve runs, each as SPECULATIVE_METHODS names it (ngram_gpu is vLLM's
GPU implementation of the same prompt lookup)."""
VLLM_SPECULATIVE_NAMES = {"model": "draft_model", "prompt_lookup_min": "ngram_min", "prompt_lookup_max": "ngram_max",
                          "disable_by_batch_size": "disable_above_batch_size"}
"""vLLM's speculative_config keys, each with the SpeculativeConfig field it sets."""
VLLM_NGRAM_MODEL_NAMES = ("ngram", "[ngram]")
"""`model` values that vLLM reads as the ngram method when `method` is omitted."""


def speculative_settings(mapping: Mapping[str, object]) -> dict[str, object]:
    """The SpeculativeConfig fields a speculative-config mapping sets, the mapping in our field names or in
    vLLM's (`--speculative-config`, `LLM(speculative_config=...)`): `model` is draft_model (and, without
    `method`, means method draft, as in vLLM, unless it is "ngram" / "[ngram]"); method `draft_model` is draft
    and `ngram_gpu` is ngram; prompt_lookup_min / prompt_lookup_max are ngram_min / ngram_max, one given alone
    setting both as vLLM does; disable_by_batch_size N is disable_above_batch_size N - 1 (vLLM stops speculating
    when N or more requests run, splitserve when more than the limit decode); draft_tensor_parallel_size is
    accepted as 1 only. Only the keys given are returned, so a config file's settings stay under the flag's.
    ValueError naming the key for an unknown key, a field spelled both ways, or a vLLM method splitserve does
    not run."""
    known = {spec.name for spec in fields(SpeculativeConfig)}
    settings: dict[str, object] = {}
    for key, value in mapping.items():
        if key == "draft_tensor_parallel_size":
            _check(is_scalar_kind(value, int) and value == 1,
                   f"speculative.draft_tensor_parallel_size: only 1 is supported, got {reprlib.repr(value)}: the "
                   f"draft model runs on its target's device")
            continue
        _check(key in known or key in VLLM_SPECULATIVE_NAMES,
               f"speculative: unknown key {key!r} (known: "
               f"{', '.join(sorted(known | VLLM_SPECULATIVE_NAMES.keys() | {'draft_tensor_parallel_size'}))})")
        name = VLLM_SPECULATIVE_NAMES.get(key, key)
        if name in settings:
            raise ValueError(f"speculative: {_spelling(name, mapping, key)!r} and {key!r} set the same field "
                             f"({name}); give one of them")
        settings[name] = value
    if "method" in settings:
        settings["method"] = _speculative_method(settings["method"])
    elif "model" in mapping:
        settings["method"] = "ngram" if mapping["model"] in VLLM_NGRAM_MODEL_NAMES else "draft"
    if settings.get("method") == "ngram" and settings.get("draft_model") in VLLM_NGRAM_MODEL_NAMES:
        del settings["draft_model"]  # vLLM's ngram names its model "ngram"; there is no draft model
    _lone_prompt_lookup_size(mapping, settings)
    if "disable_by_batch_size" in mapping:
        settings["disable_above_batch_size"] = _vllm_batch_limit(mapping["disable_by_batch_size"])
    return settings


def _spelling(name: str, mapping: Mapping[str, object], other_than: str) -> str:
    """The key of `mapping` other than `other_than` that sets the field `name`."""
    return next(key for key in mapping if key != other_than and VLLM_SPECULATIVE_NAMES.get(key, key) == name)


def _speculative_method(method: object) -> object:
    """Our name of a speculative method in either spelling; ValueError naming a vLLM method splitserve does not run
    (an unknown non-string is left to SpeculativeConfig, which names its type)."""
    if not isinstance(method, str) or method in SPECULATIVE_METHODS:
        return method
    _check(method in VLLM_SPECULATIVE_METHODS,
           f"speculative.method {method!r} is not supported: splitserve runs ngram (prompt lookup; vLLM's ngram, "
           f"ngram_gpu) and draft (a draft model; vLLM's draft_model) speculation (docs/speculative.md)")
    return VLLM_SPECULATIVE_METHODS[method]


def _lone_prompt_lookup_size(mapping: Mapping[str, object], settings: dict[str, object]) -> None:
    """vLLM's rule: prompt_lookup_min or prompt_lookup_max given without the other size sets both."""
    for given, missing in (("prompt_lookup_min", "ngram_max"), ("prompt_lookup_max", "ngram_min")):
        if given in mapping and missing not in settings:
            settings[missing] = mapping[given]


def _vllm_batch_limit(disable_by_batch_size: object) -> int:
    """disable_above_batch_size of vLLM's disable_by_batch_size (speculation is off when that many requests or more
    run): one less."""
    _check(is_scalar_kind(disable_by_batch_size, int) and disable_by_batch_size >= 1,
           f"speculative.disable_by_batch_size must be an integer >= 1, got {reprlib.repr(disable_by_batch_size)}")
    return disable_by_batch_size - 1


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine (one device) needs besides the model directory."""

    block_size: int = 16
    """Tokens per KV block; the unit of allocation, prefix caching and transfer."""
    max_num_seqs: int = 128
    """Most requests in the running batch at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step, shared by decodes (1 each) and prefill chunks."""
    max_model_len: int | None = None
    """Longest prompt + output; None means the model's max_position_embeddings (a `longrope` model's
    original_max_position_embeddings, the longest it can be served exactly: docs/engine.md#models)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical token prefixes across requests."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps to fit the token budget."""
    num_kv_blocks: int | None = None
    """Explicit KV pool size in blocks (overrides the memory-based sizing)."""
    kv_cache_memory_bytes: int | None = None
    """KV pool size in bytes across all layers."""
    kv_cache_memory_fraction: float | None = None
    """KV pool size as a fraction of the device's free memory after loading weights."""
    gpu_memory_utilization: float | None = None
    """vLLM's: on CUDA, the share of the device's total memory, in (0, 1], this engine may hold for its weights,
    activations and KV cache. The pool gets utilization x total memory minus what the engine holds before it: the
    weights (and whatever else loading them left allocated, as torch.cuda.mem_get_info sees it) plus the peak of a
    profiling forward of max_num_batched_tokens prompt tokens (engine/memory_profile.py; the sizing itself is
    engine/kv_cache.py's blocks_for_utilization). CUDA graphs and a draft model (speculative method draft) come
    later and are not counted: they use the remaining share. None (the default; vLLM's is 0.9): the pool is
    DEFAULT_KV_CACHE_MEMORY_BYTES. num_kv_blocks, kv_cache_memory_bytes and kv_cache_memory_fraction win over it
    when set (as vLLM's kv_cache_memory_bytes does). On CPU it is checked and has no effect, as in vLLM (whose CPU
    backend sizes its KV cache from VLLM_CPU_KVCACHE_SPACE): the pool is kv_cache_memory_bytes, else 1 GiB."""
    dtype: str = "auto"
    """Weights/activations/KV dtype; auto takes the model's, with float16 widened on CPU."""
    kv_cache_dtype: str = "auto"
    """KV pool element type: auto (the model's dtype) or int8 / fp8_e4m3 codes with a bfloat16 scale per token
    per KV head, quantized when written and widened inside attention (docs/quantization.md#kv-cache)."""
    device: str = "auto"
    """cpu, cuda, or auto (cuda when available)."""
    attention_backend: str = "auto"
    """Attention implementation: torch (the reference, any device), cpu (tuned for CPU), flashinfer (CUDA,
    float16/bfloat16, the `splitserve[gpu]` extra), or auto (cpu on CPU; on CUDA flashinfer when installed, the
    dtype is 16-bit and kv_cache_dtype is auto, else torch)."""
    hash_seed: int = 0
    """Seed of the chained block hash; must match across router and workers."""
    seed: int = 0
    """Seed of the shared RNG used by requests that bring no seed of their own."""
    num_threads: int | None = None
    """torch intra-op threads on CPU; None keeps torch's default."""
    cuda_graphs: bool | None = None
    """Capture decode steps as CUDA graphs, one per batch-size bucket up to max_num_seqs (1, 2, 4, then multiples
    of 8), and replay them for decode-only steps; the pool gets one more block, where the padding rows write.
    None (auto): wherever the engine runs the flashinfer backend on CUDA, the only place it can. True: the same,
    refused when the engine starts anywhere else. False: never (`--enforce-eager`)."""
    cpu_kernels: bool = True
    """On CPU, run the C++ kernels (paged decode attention, fused RMSNorm / SiLU-and-mul / RoPE), built
    on first use; False, or a machine where they cannot build, runs the pure-torch reference ops."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (docs/speculative.md); None decodes one token per request per step."""
    quantization: str = "auto"
    """Weight-only quantization of the decoder's linear layers (docs/quantization.md): int8 (per output
    channel) or int4 (group-wise) quantize a float checkpoint at load; gptq / awq load such a checkpoint;
    none runs the checkpoint's float weights; auto is the checkpoint's quantization_config, else none."""
    quantization_group_size: int = 128
    """Input channels per scale of `int4` (32, 64 or 128); GPTQ/AWQ checkpoints bring their own."""
    scheduling_policy: str = "fcfs"
    """vLLM's: fcfs admits waiting requests in arrival order and preempts the latest admitted one when
    KV blocks run out; priority orders the waiting requests by (priority, arrival), lower priority
    values first, and preempts the running request with the largest (priority, arrival). Under fcfs
    a request with a priority other than 0 is refused (docs/engine.md, Scheduler)."""
    enable_lora: bool = False
    """Serve PEFT LoRA adapters per request (vLLM's enable_lora; docs/lora.md): float weights, dense models,
    without speculative decoding."""
    max_loras: int = 1
    """With enable_lora: most adapters loaded at once (least recently used evicted) and so most distinct adapters
    in one batch (vLLM's max_loras)."""
    max_lora_rank: int = 16
    """With enable_lora: the highest adapter rank accepted (vLLM's max_lora_rank)."""
    runner: str = "generate"
    """vLLM's --runner: generate (requests sample tokens) or pooling (requests embed their prompt:
    docs/engine.md#pooling-requests); an engine serves one kind and refuses the other."""
    pooler_config: PoolerConfig | None = None
    """vLLM's --pooler-config, with runner pooling: overrides the pooling type / normalization the model's
    sentence-transformers files declare (None: the model's, else LAST pooling, normalized)."""

    def __post_init__(self) -> None:
        check_scalar_fields(self)
        _check(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(self.max_num_batched_tokens >= 1,
               f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.max_model_len is None or self.max_model_len >= 2,
               f"max_model_len must be >= 2, got {self.max_model_len}")
        self._check_kv_sizing()
        _check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _check(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        _check(self.attention_backend in ATTENTION_BACKENDS,
               f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        _check(self.num_threads is None or self.num_threads >= 1, f"num_threads must be >= 1, got {self.num_threads}")
        _check(self.speculative is None or isinstance(self.speculative, SpeculativeConfig),
               f"speculative must be a SpeculativeConfig (splitserve.common.config) or None, "
               f"got {type(self.speculative).__name__} (a dict in vLLM's keys or ours: "
               f"SpeculativeConfig.from_vllm(...), or LLM(speculative_config=...))")
        _check(self.quantization in QUANTIZATION_METHODS,
               f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}")
        _check(self.quantization_group_size in QUANTIZATION_GROUP_SIZES,
               f"quantization_group_size must be one of {QUANTIZATION_GROUP_SIZES}, got {self.quantization_group_size}")
        _check(self.scheduling_policy in SCHEDULING_POLICIES,
               f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        _check(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        _check(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        _check(self.runner in RUNNERS, f"runner must be one of {RUNNERS}, got {self.runner!r}")
        _check(self.pooler_config is None or isinstance(self.pooler_config, PoolerConfig),
               f"pooler_config must be a PoolerConfig (splitserve.common.pooling) or None, "
               f"got {type(self.pooler_config).__name__}")
        _check(self.runner == "pooling" or self.pooler_config is None,
               "pooler_config is for runner 'pooling' (an engine that embeds); set runner='pooling'")
        _check(not (self.enable_lora and self.speculative is not None),
               "enable_lora: LoRA adapters do not run with speculative decoding (the proposer and the verifier "
               "would run the base model); set speculative to None")

    def _check_kv_sizing(self) -> None:
        given = [name for name in ("num_kv_blocks", "kv_cache_memory_bytes", "kv_cache_memory_fraction")
                 if getattr(self, name) is not None]
        _check(len(given) <= 1, f"set at most one of num_kv_blocks, kv_cache_memory_bytes, "
                                f"kv_cache_memory_fraction; got {given}")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
               f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        _check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
               f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        _check(self.kv_cache_memory_fraction is None or 0 < self.kv_cache_memory_fraction <= 1,
               f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        _check(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
               f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


GENERATION_CONFIG_SOURCES = ("auto", "vllm")
"""GenerationConfig.source values that name no folder."""


@dataclass(frozen=True)
class SamplingDefaults:
    """Sampling values a request gets for the fields it leaves unset, under Hugging Face's
    generation_config.json names (the fields vLLM's get_diff_sampling_param reads); None: the
    field has no default here (SamplingParams' own applies). Checked by SamplingParams' rules."""

    temperature: float | None = None
    """Default temperature (0: greedy)."""
    top_p: float | None = None
    """Default top_p, in (0, 1]."""
    top_k: int | None = None
    """Default top_k (-1 or 0: off)."""
    min_p: float | None = None
    """Default min_p, in [0, 1]."""
    repetition_penalty: float | None = None
    """Default repetition_penalty, > 0."""
    presence_penalty: float | None = None
    """Default presence_penalty, in [-2, 2]."""
    frequency_penalty: float | None = None
    """Default frequency_penalty, in [-2, 2]."""
    max_new_tokens: int | None = None
    """Default max_tokens of a chat or Responses request that sets none (completions keep 16, as in
    vLLM); a limit on every request's max_tokens when it comes from the overrides or a
    --generation-config folder (vLLM's rule)."""

    def __post_init__(self) -> None:
        try:
            SamplingParams(**self.sampling_fields())
        except InvalidRequestError as error:
            raise ValueError(f"{error.field} {error.message}") from None
        value = self.max_new_tokens
        _check(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
               f"max_new_tokens must be an integer >= 1, got {value!r}")

    def sampling_fields(self) -> dict[str, float | int]:
        """The set defaults as SamplingParams fields (max_new_tokens, a length, is not one)."""
        return {name: value for name, value in self.set_fields().items() if name != "max_new_tokens"}

    def set_fields(self) -> dict[str, float | int]:
        """The fields that are set (not None), max_new_tokens included."""
        return {name: value for name, value in vars(self).items() if value is not None}


@dataclass(frozen=True)
class GenerationConfig:
    """Where requests' default sampling values come from (vLLM's --generation-config and
    --override-generation-config); they fill only the fields a request leaves unset."""

    source: str = "auto"
    """auto: the model directory's generation_config.json (else config.json's generation fields);
    vllm: no file (SamplingParams' own defaults); anything else: a folder holding a
    generation_config.json to read instead."""
    overrides: SamplingDefaults = SamplingDefaults()
    """Defaults set here win over the file's (with source vllm, they are the only ones)."""

    def __post_init__(self) -> None:
        _check(isinstance(self.source, str) and self.source != "",
               f"source must be auto, vllm or a folder, got {self.source!r}")
        _check(isinstance(self.overrides, SamplingDefaults),
               f"overrides must be a SamplingDefaults, got {type(self.overrides).__name__}")

    @property
    def folder(self) -> str | None:
        """The folder named by source; None for auto and vllm."""
        return None if self.source in GENERATION_CONFIG_SOURCES else self.source
