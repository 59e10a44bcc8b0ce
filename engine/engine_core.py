"""EngineCore: one device, no I/O in step(). schedule -> forward -> sample -> stop checks."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch
from tokenizers import Tokenizer

from splitserve.common.block_hash import BlockHasher, check_cache_salt
from splitserve.common.config import EngineConfig, check_priority
from splitserve.common.errors import InvalidRequestError, UnsupportedModelError
from splitserve.common.generation_config import GenerationConfigFile
from splitserve.common.kv_events import KVEventBatch, KVSnapshot, LoadReport, LoraLoad
from splitserve.common.lora import LoRARequest, check_lora_request
from splitserve.common.prompt_truncation import check_prompt_length
from splitserve.common.pooling import ModelPooling, PoolingParams, read_model_pooling, resolve_pooling
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.stats import EngineStats
from splitserve.common.token_logprobs import TokenLogprobs
from splitserve.engine.attention import AttentionBackend, select_backend
from splitserve.common.kv_transfer_types import KV_SCALES_NONE, KV_SCALES_PER_TOKEN_HEAD, KVLayout
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.cuda_graphs import build_decode_graphs, uses_cuda_graphs
from splitserve.common.detokenizer import IncrementalDetokenizer
from splitserve.engine.kv_cache import KVCache, KVCacheSpec, num_blocks_for, sizes_by_utilization
from splitserve.engine.kv_event_log import KVEventLog
from splitserve.engine.kv_quant import kv_quantization
from splitserve.engine.lora_manager import LoRAManager
from splitserve.engine.memory_profile import measure_engine_memory
from splitserve.engine.model_loader import load_hf_config, load_model
from splitserve.engine.models.layer_ops import select_layer_ops
from splitserve.engine.models.lora_linear import install_lora_linears
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.outputs import CompletionDelta
from splitserve.engine.pooling import SequencePool
from splitserve.common.quantization_spec import resolve_quantization
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.sampler import Sampler, SamplingRow, token_logprobs
from splitserve.engine.spec_decode.speculator import Speculator, build_proposer
from splitserve.engine.spec_decode.verifier import SpeculativeRows, VerifiedRun, verify
from splitserve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from splitserve.engine.step_costs import StepCosts
from splitserve.engine.structured_output import GrammarMatchers, GrammarState
from splitserve.engine.structured_output.bitmask import TokenBitmask

@dataclass(frozen=True)
class HeldKV:
    """Producer role: a prefilled request's blocks, kept allocated until release_held_kv()."""

    block_ids: tuple[int, ...]
    num_tokens: int
    """Prompt tokens whose KV the blocks hold."""
    generator_state: bytes | None
    """RNG state after the first sample (seeded requests), so the consumer continues the stream."""


@dataclass(frozen=True)
class FinalPrefillChunk:
    """Producer role: a held prompt whose final prefill chunk the coming forward computes."""

    request_id: str
    block_ids: tuple[int, ...]
    """The blocks it will hold (HeldKV.block_ids once its first token is sampled, unless it stops there)."""
    num_tokens: int
    """Prompt tokens whose KV the blocks hold once the forward ends."""


class PrefillLayerListener(Protocol):
    """Producer role, layer-wise transfer (EngineCore.set_layer_listener): follows the forwards
    that finish held prompts, layer by layer. Both calls run on the engine's thread inside step()."""

    def final_chunks_starting(self, chunks: tuple[FinalPrefillChunk, ...]) -> None:
        """The coming forward computes these prompts' final chunks (their blocks are allocated and
        stay allocated at least until step() returns)."""

    def layer_written(self, layer: int) -> None:
        """The forward wrote layer `layer` of every chunk of the step (layers come in order 0, 1, ...)."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GRAMMAR_REFUSED = InvalidRequestError(
    "structured_output", "its grammar refused the sampled token, so the output cannot go on: no token the grammar "
                         "allows is allowed by the request's other token constraints (allowed_token_ids, bad_words, "
                         "logit_bias, ...), or the grammar outgrew the parser's limits (the worker's log says which)")
"""What ends a request whose grammar refused its sampled token (the sampler had no token both the grammar and
the request's other masks allow, and sampled outside the grammar; or llguidance failed on a grammar too wide):
a request error, which the workers carry to the router, never an output that breaks the grammar."""


def resolve_device(name: str) -> torch.device:
    """The engine's device; a CUDA one always with its index ("cuda" and "auto": the current device), so
    that a thread of its own (a transfer or fence thread) can make it current with torch.cuda.set_device."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    device = torch.device(name)
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None else device


def resolve_dtype(name: str, model_dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """`auto` takes the checkpoint's dtype; float16 is widened to float32 on CPU."""
    if name != "auto":
        return _DTYPES[name]
    dtype = _DTYPES.get(str(model_dtype).removeprefix("torch."), torch.float32)
    return torch.float32 if dtype == torch.float16 and device.type == "cpu" else dtype


class EngineCore:
    def __init__(self, model_dir: str | Path, config: EngineConfig, tokenizer: Tokenizer | None = None,
                 show_progress: bool = False, tokenizer_dir: str | Path | None = None) -> None:
        """`tokenizer`: the engine's own (stop strings, detokenized text), None in a worker (the router
        detokenizes); `tokenizer_dir`: where tokenizer.json is when not in `model_dir` (--tokenizer), for
        the grammars' vocabulary and the draft model's tokenizer check."""
        model_dir = Path(model_dir)
        tokenizer_dir = model_dir if tokenizer_dir is None else Path(tokenizer_dir)
        hf_config = load_hf_config(model_dir)
        self.config = config
        self.device = resolve_device(config.device)
        if config.num_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        dtype = resolve_dtype(config.dtype, getattr(hf_config, "dtype", None), self.device)
        attention = select_backend(config.attention_backend, self.device.type, config.cpu_kernels, dtype,
                                   quantized_kv=kv_quantization(config.kv_cache_dtype) is not None)
        self.quantization = resolve_quantization(config.quantization, config.quantization_group_size,
                                                 getattr(hf_config, "quantization_config", None))
        layer_ops = select_layer_ops(self.device, dtype, config.cpu_kernels)
        measured = sizes_by_utilization(config, self.device)  # gpu_memory_utilization: measure around the load
        free_at_start = torch.cuda.mem_get_info(self.device)[0] if measured else None
        self.model = load_model(model_dir, dtype, self.device, attention, show_progress, layer_ops, self.quantization,
                                fuse_mlp_activation=not config.enable_lora, needs_lm_head=config.runner == "generate")
        arch = self.model.arch
        self.model_pooling: ModelPooling | None = (read_model_pooling(model_dir, config.pooler_config)
                                                   if config.runner == "pooling" else None)
        """runner pooling: how the model embeds (common/pooling.py); None for a generating engine."""
        self._model_name = model_dir.name
        self.lora = self._lora_manager(dtype) if config.enable_lora else None
        self.vocab_size = arch.vocab_size
        self.max_model_len = self._resolve_max_model_len(arch.max_position_embeddings, arch.rope_length_limit)
        self.eos_token_ids = GenerationConfigFile.read(model_dir).eos_token_ids  # the router's reader too
        spec = KVCacheSpec(arch.num_layers, config.block_size, arch.num_kv_heads, arch.head_dim, dtype,
                           kv_quantization(config.kv_cache_dtype))
        graphs = uses_cuda_graphs(config.cuda_graphs, self.device, attention, sparse_moe=arch.moe is not None)
        self.kv_cache = KVCache(spec, self._num_blocks(spec, attention, free_at_start), self.device,
                                reserve_dummy_block=graphs)
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size,
                                          BlockHasher(config.block_size, config.hash_seed),
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len, config.enable_chunked_prefill,
                                                   config.scheduling_policy,
                                                   config.max_loras if config.enable_lora else None),
                                   self.block_manager)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, attention.pads_decode_batches,
                                  attention.needs_paged_metadata,
                                  build_decode_graphs(config, self.model, self.kv_cache, attention, self.max_model_len)
                                  if graphs else None, self.lora)
        self.sampler = Sampler()
        self.speculator = None if config.speculative is None else Speculator(
            config.speculative, build_proposer(config.speculative, tokenizer_dir, self.vocab_size,
                                              self.kv_cache.num_blocks, config.block_size, dtype, self.device,
                                              attention, layer_ops),
            self.max_model_len)
        self.tokenizer = tokenizer
        self.grammars = GrammarMatchers(lambda: _tokenizer_json(tokenizer_dir, tokenizer), self.vocab_size,
                                        self.eos_token_ids)
        self._shared_generator = torch.Generator(self.device).manual_seed(config.seed)
        self._generators: dict[str, torch.Generator] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[CompletionDelta] = []
        self._held: dict[str, HeldKV] = {}
        self._pools: dict[str, SequencePool] = {}
        """The running pool of each unfinished pooling request."""
        self._layer_listener: PrefillLayerListener | None = None
        self._kv_events = KVEventLog()
        self._step_costs = StepCosts()
        self._arrivals = 0
        self._num_steps = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0

    def _lora_manager(self, dtype: torch.dtype) -> LoRAManager:
        """enable_lora: the model's projections wrapped for per-request adapters (docs/lora.md), where it can run
        them: float weights of a dense model (UnsupportedModelError naming enable_lora otherwise)."""
        arch = self.model.arch
        if self.quantization.quantized:
            raise UnsupportedModelError(f"enable_lora: LoRA adapters do not run on quantized weights (quantization "
                                        f"{self.quantization.method!r}); serve the float checkpoint")
        if arch.moe is not None:
            raise UnsupportedModelError(f"enable_lora: LoRA adapters are not supported for mixture-of-experts "
                                        f"models ({arch.architecture})")
        context = install_lora_linears(self.model)
        return LoRAManager(arch, context, self.config.max_loras, self.config.max_lora_rank, dtype, self.device)

    def _resolve_max_model_len(self, max_positions: int, rope_length_limit: int | None) -> int:
        """config.max_model_len, else the longest sequence the model serves exactly: max_positions, or
        rope_length_limit where the RoPE tables hold only that far (LlamaFamilyArch.rope_length_limit), or an
        embedding model's max_seq_length (ModelPooling.max_seq_length)."""
        length = self.config.max_model_len or min(max_positions, rope_length_limit or max_positions,
                                                  self._max_seq_length or max_positions)
        if self._max_seq_length is not None and length > self._max_seq_length:
            raise ValueError(f"max_model_len {length} exceeds max_seq_length {self._max_seq_length} of the model's "
                             "sentence_bert_config.json, the longest prompt it embeds (as vLLM, which refuses it too)")
        if length > max_positions:
            raise ValueError(f"max_model_len {length} exceeds the model's max_position_embeddings {max_positions}")
        if rope_length_limit is not None and length > rope_length_limit:
            raise ValueError(f"max_model_len {length} exceeds original_max_position_embeddings {rope_length_limit} of "
                             "this rope_type 'longrope' model: past it transformers rotates every position with "
                             "long_factor instead of short_factor, which keys already in the KV cache cannot follow; "
                             f"set max_model_len <= {rope_length_limit}")
        if not self.config.enable_chunked_prefill and self.config.max_num_batched_tokens < length:
            raise ValueError(f"without chunked prefill, max_num_batched_tokens "
                             f"({self.config.max_num_batched_tokens}) must be >= max_model_len ({length})")
        return length

    @property
    def _max_seq_length(self) -> int | None:
        return self.model_pooling.max_seq_length if self.model_pooling is not None else None

    def _num_blocks(self, spec: KVCacheSpec, attention: AttentionBackend, free_at_start: int | None) -> int:
        """`free_at_start`: the device's free bytes before the model loaded, measured where gpu_memory_utilization
        sizes the pool (sizes_by_utilization), else None."""
        memory = None if free_at_start is None else measure_engine_memory(
            self.device, free_at_start, self.model, spec, attention, self.config.max_num_batched_tokens,
            self.max_model_len)
        num_blocks = num_blocks_for(self.config, spec, self.device, memory)
        if num_blocks * spec.block_size < self.max_model_len:
            raise ValueError(f"the KV pool holds {num_blocks} blocks x {spec.block_size} tokens, fewer than "
                             f"max_model_len={self.max_model_len}; enlarge the pool or lower max_model_len")
        return num_blocks

    # ---- requests ------------------------------------------------------------------------
    def validate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 cache_salt: str | None = None, priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        """Raise InvalidRequestError (naming the field) if the request can never be served (a priority
        other than 0 included, unless the scheduling policy is priority). A LoRA adapter is loaded the first
        time a request names it (LoRAManager.register), so a bad adapter fails here."""
        if self.model_pooling is not None:
            pools = "embeds" if self.model_pooling.classifier is None else "classifies"
            raise InvalidRequestError("runner", f"this engine runs the model as a pooling model (runner 'pooling'), "
                                                f"which {pools} prompts and generates nothing; start it with runner "
                                                "'generate' to generate")
        self._validate_prompt(request_id, prompt_token_ids, cache_salt, priority, pools=False)
        if params.max_tokens is None:
            raise InvalidRequestError("max_tokens", "None (to the end of the context) must be resolved before the "
                                                    "request reaches the engine (LLM.generate resolves it per prompt)")
        if params.n != 1:
            raise InvalidRequestError("n", f"must be 1 for an engine request, got {params.n}: an engine request is "
                                           f"one sequence (LLM.generate fans n out into one request per sequence)")
        params.check_logit_control_vocabulary(self.vocab_size)
        params.check_logprobs_limit(-1, self.vocab_size)  # the server's limit is the router's to apply
        if params.bad_words and not params.bad_words_token_ids:
            raise InvalidRequestError("bad_words", "must be tokenized before the request reaches the engine "
                                                   "(SamplingParams.with_bad_words_tokenized)")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop", "stop strings need an engine with a tokenizer")
        if params.structured_output is not None:
            self.grammars.check(params.structured_output)
        self._check_lora(lora_request)

    def _validate_prompt(self, request_id: str, prompt_token_ids: list[int], cache_salt: str | None, priority: int,
                         pools: bool) -> None:
        """What every request's prompt must be; `pools`: a pooling request's, which may fill max_model_len."""
        if request_id in self.scheduler.requests or request_id in self._held:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        check_prompt_length(len(prompt_token_ids), self.max_model_len, "prompt", pools)
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError("prompt_token_ids", f"out of vocabulary [0, {self.vocab_size}): {bad[:5]}")
        check_cache_salt(cache_salt)
        check_priority(priority, self.config.scheduling_policy)

    def validate_pooling(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams,
                         cache_salt: str | None = None, priority: int = 0,
                         lora_request: LoRARequest | None = None) -> None:
        """validate()'s counterpart for a pooling request (add_pooling_request); the prompt may fill
        max_model_len (nothing is generated after it)."""
        if self.model_pooling is None:
            raise InvalidRequestError("runner", "Embedding API is not supported by this model: the engine runs it "
                                                "as a generative model (runner 'generate'); start it with runner "
                                                "'pooling' to embed")
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError("pooling_params", f"must be a PoolingParams, got {type(params).__name__}")
        self._validate_prompt(request_id, prompt_token_ids, cache_salt, priority, pools=True)
        self.model_pooling.check_dimensions(params.dimensions, self._model_name)
        self._check_lora(lora_request)

    def add_pooling_request(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams,
                            cache_salt: str | None = None, priority: int = 0,
                            lora_request: LoRARequest | None = None) -> None:
        """Queue a pooling (embedding) request (runner pooling): its prompt is prefilled (in chunks, LAST pooling
        after any cached prefix) and its final delta carries the pooled embedding (CompletionDelta.embedding);
        nothing is sampled. Its blocks are freed when it finishes, as any request's; they enter the prefix cache."""
        self.validate_pooling(request_id, prompt_token_ids, params, cache_salt, priority, lora_request)
        pooling = resolve_pooling(self.model_pooling, params, self._model_name)
        request = Request(request_id, list(prompt_token_ids), SamplingParams(max_tokens=1), frozenset(),
                          self._arrivals, cache_salt=cache_salt, priority=priority,
                          lora_name=None if lora_request is None else lora_request.lora_name, pooling=pooling)
        self._arrivals += 1
        self._pools[request_id] = SequencePool(pooling, self.model.classifier)
        self._num_prompt_tokens += request.num_prompt_tokens
        self.scheduler.add_request(request)

    def _check_lora(self, lora_request: LoRARequest | None) -> None:
        check_lora_request(lora_request)
        if lora_request is None:
            return
        if self.lora is None:
            raise InvalidRequestError("lora_request", "LoRA is not enabled on this engine (start it with "
                                                      "enable_lora=True)")
        self.lora.register(lora_request)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    hold_kv_after_prefill: bool = False, output_token_ids: Sequence[int] = (),
                    cache_salt: str | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request. With hold_kv_after_prefill (producer role) it finishes as 'prefilled'
        after its first token unless it stops there, and its blocks stay held (see take_held_kv).

        `output_token_ids` were generated elsewhere (a request moved off a lost worker): the
        engine prefills prompt + those tokens, as it recomputes a preempted request, and goes on
        sampling from there; they count towards max_tokens. `cache_salt`: its prefix-cache hits are
        blocks of requests with the same salt only (None: of unsalted requests). `priority`: its place
        under the priority scheduling policy (lower first; only 0 under fcfs). `lora_request`: the LoRA
        adapter it runs with (None: the base model); its prefix-cache hits are that adapter's blocks only."""
        self.validate(request_id, prompt_token_ids, params, cache_salt, priority, lora_request)
        request = self._new_request(request_id, list(prompt_token_ids), list(output_token_ids), params, cache_salt,
                                    priority, lora_request)
        request.hold_kv_after_prefill = hold_kv_after_prefill
        self._num_prompt_tokens += request.num_prompt_tokens
        self.scheduler.add_request(request)

    def add_remote_request(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                           params: SamplingParams, num_cached_tokens: int,
                           generator_state: bytes | None, first_token_pending: bool = False,
                           cache_salt: str | None = None, priority: int = 0,
                           lora_request: LoRARequest | None = None) -> tuple[int, ...] | None:
        """Consumer role: admit a request whose prompt KV lives on a producer.

        Allocates blocks for the prompt and the tokens generated elsewhere, and returns the
        prompt's blocks in order: the caller pulls the producer's blocks into them, then calls
        remote_kv_ready() or remote_kv_failed(). Returns None (nothing changed) when the pool has no
        room yet. `first_token_pending` (layer-wise transfer): the producer is still prefilling, so
        output_token_ids is empty and one more token's room is allocated; the caller hands the first
        token over (remote_first_token) before remote_kv_ready() or remote_kv_failed(). `cache_salt`: the
        producer's request's, so the pulled blocks enter this prefix cache under the producer's hashes;
        `lora_request` likewise (and the decode steps run the adapter). `priority`: as add_request's (it
        orders the request once its pull completes).
        """
        self.validate(request_id, prompt_token_ids, params, cache_salt, priority, lora_request)
        request = self._new_request(request_id, list(prompt_token_ids), list(output_token_ids), params, cache_salt,
                                    priority, lora_request)
        # Room for the tokens generated elsewhere too, so the first decode step never waits
        # for a block (a ready request is never preempted to make room for itself).
        if self.block_manager.allocate(request, request.num_tokens + int(first_token_pending)) is None:
            self._forget(request_id)
            return None
        self._continue_remote(request, num_cached_tokens, generator_state)
        self.scheduler.add_remote(request)
        num_prompt_blocks = self.block_manager.blocks_needed(request.num_prompt_tokens)
        return tuple(self.block_manager.block_table(request_id)[:num_prompt_blocks])

    def remote_first_token(self, request_id: str, token_ids: Sequence[int], num_cached_tokens: int,
                           generator_state: bytes | None) -> None:
        """Consumer role, layer-wise transfer: the first token (and RNG state) the producer sampled
        for a request admitted with first_token_pending; it still waits for its KV."""
        request = self.scheduler.requests[request_id]
        if request.status is not RequestStatus.WAITING_FOR_REMOTE_KV or request.num_output_tokens:
            raise ValueError(f"{request_id!r} is not waiting for its first token (status {request.status.value}, "
                             f"{request.num_output_tokens} output tokens)")
        for token_id in token_ids:
            request.append_output_token(token_id)
            self.grammars.accept(request_id, token_id)
            detokenizer = self._detokenizers.get(request_id)
            if detokenizer is not None:
                detokenizer.append(token_id)
        self._continue_remote(request, num_cached_tokens, generator_state)

    def _continue_remote(self, request: Request, num_cached_tokens: int, generator_state: bytes | None) -> None:
        """Carry over what the producer's prefill left: its prefix-cache hit and the RNG state after its sample."""
        request.num_cached_tokens = num_cached_tokens
        if generator_state is not None:
            self._generators[request.request_id].set_state(
                torch.frombuffer(bytearray(generator_state), dtype=torch.uint8))

    def remote_kv_ready(self, request_id: str) -> None:
        self.scheduler.remote_kv_ready(request_id)

    def remote_kv_failed(self, request_id: str) -> None:
        """Recompute the prompt locally instead (from now on it counts as a prompt prefilled here)."""
        self.scheduler.remote_kv_failed(request_id)
        self._num_prompt_tokens += self.scheduler.requests[request_id].num_prompt_tokens

    def take_held_kv(self, request_id: str) -> HeldKV | None:
        """Producer role: the held blocks of a request that finished as 'prefilled'."""
        return self._held.get(request_id)

    def set_layer_listener(self, listener: PrefillLayerListener | None) -> None:
        """Producer role: follow every forward that finishes held prompts layer by layer (None: stop).

        On CUDA `layer_written(l)` runs when layer l's kernels are queued, not done: a listener that
        tells another process must first wait for an event recorded then (prefill_worker/layer_fences.py)."""
        self._layer_listener = listener

    def release_held_kv(self, request_id: str) -> bool:
        """Free a prefilled request's blocks (after the consumer's pull, a lease expiry or a cancel)."""
        if self._held.pop(request_id, None) is None:
            return False
        self.block_manager.free(request_id)
        return True

    @property
    def num_steps(self) -> int:
        """Forward passes run so far."""
        return self._num_steps

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens of the requests this engine prefilled (cached ones included; a prompt
        whose KV was pulled from a producer does not count unless it was recomputed here)."""
        return self._num_prompt_tokens

    @property
    def num_generation_tokens(self) -> int:
        """Tokens sampled so far."""
        return self._num_generation_tokens

    @property
    def num_held(self) -> int:
        return len(self._held)

    def kv_layout(self, model_id: str) -> KVLayout:
        spec = self.kv_cache.spec
        scales = KV_SCALES_NONE if spec.quantization is None else KV_SCALES_PER_TOKEN_HEAD
        return KVLayout(model_id=model_id, dtype=str(spec.storage_dtype).removeprefix("torch."),
                        block_size=spec.block_size, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                        head_dim=spec.head_dim, hash_seed=self.config.hash_seed, scales=scales,
                        memory_kind="VRAM" if self.device.type == "cuda" else "DRAM")

    def _new_request(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                     params: SamplingParams, cache_salt: str | None, priority: int,
                     lora_request: LoRARequest | None) -> Request:
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids, self._arrivals,
                          all_token_ids=prompt_token_ids + output_token_ids, cache_salt=cache_salt, priority=priority,
                          lora_name=None if lora_request is None else lora_request.lora_name)
        self._arrivals += 1
        if params.structured_output is not None:
            self.grammars.add(request_id, params.structured_output, output_token_ids)
        if params.seed is not None:
            self._generators[request_id] = torch.Generator(self.device).manual_seed(params.seed)
        if self.tokenizer is not None and params.detokenize:  # detokenize=False has no stop strings (validated)
            self._detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.stop, params.skip_special_tokens,
                params.include_stop_str_in_output)
            for token_id in output_token_ids:
                self._detokenizers[request_id].append(token_id)
        return request

    def _forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._pools.pop(request_id, None)
        self.grammars.remove(request_id)
        self._detokenizers.pop(request_id, None)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request in any state; its final delta comes out of the next step()."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        self._pending.append(self._finish(request, RequestStatus.FINISHED_ABORTED, ()))
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    def has_work(self) -> bool:
        """True when step() would do something (waiting for remote KV alone is not work)."""
        return self.scheduler.has_schedulable_requests() or bool(self._pending)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[CompletionDelta]:
        """One schedule -> forward -> sample round. If it raises, deltas queued by earlier aborts
        are kept for the next step (the caller decides what to do with the running requests)."""
        output = self.scheduler.schedule()
        if output.is_empty:
            deltas, self._pending = self._pending, []
            self._publish_kv_events()
            return deltas
        self._num_steps += 1
        num_prefill_tokens = self._num_prefill_tokens(output)
        started = time.perf_counter()
        # structured-output rows' masks are filled while the model runs (matchers are not touched until .result())
        masks = self.grammars.start_bitmask([c.request_id for c in output.chunks if c.samples])
        # A pooling engine runs only pooling requests (validate() refuses the others), a generating one none: the
        # step's kind is the engine's, with no walk over the chunks on the hot path.
        pooling = self.model_pooling is not None
        if pooling:
            logits, hidden = self.runner.execute_with_hidden(output)  # hidden [T, hidden]
        else:
            logits = self.runner.execute(output, self._layer_hook(output))
        deltas, self._pending = self._pending, []
        self.scheduler.advance(output)
        if pooling:
            deltas.extend(self._pool_chunks(output.chunks, hidden))
        logits = self._score_prompts(output.chunks, logits)
        sampling = [c for c in output.chunks if c.samples]
        runs = self._sample(logits, sampling, masks.result())
        self._step_costs.record(num_prefill_tokens, output.num_batched_tokens, time.perf_counter() - started)
        for chunk, run in zip(sampling, runs):
            deltas.append(self._append_tokens(self.scheduler.requests[chunk.request_id], chunk, run))
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        self._publish_kv_events()
        return deltas

    def _pool_chunks(self, chunks: tuple[ScheduledChunk, ...], hidden: torch.Tensor) -> list[CompletionDelta]:
        """Pool each pooling chunk's rows of hidden [T, hidden] (chunks in batch order); a request whose prompt is
        now all computed finishes with its embedding (the final delta of the step, its blocks freed)."""
        deltas = []
        offset = 0
        for chunk in chunks:
            if chunk.pools:
                request = self.scheduler.requests[chunk.request_id]
                self._pools[chunk.request_id].add(chunk.start_position, hidden[offset:offset + chunk.num_tokens])
                if chunk.context_len == request.num_prompt_tokens:
                    deltas.append(self._finish_pooled(request))
            offset += chunk.num_tokens
        return deltas

    def _finish_pooled(self, request: Request) -> CompletionDelta:
        embedding = self._pools[request.request_id].embedding(request.num_prompt_tokens)
        return replace(self._finish(request, RequestStatus.FINISHED_STOPPED, ()), embedding=embedding)

    def _layer_hook(self, output: SchedulerOutput) -> Callable[[int], None] | None:
        """With a layer listener and held prompts finishing in this step: tell it which, and hand its
        per-layer call to the forward; otherwise None (the forward runs without a hook)."""
        if self._layer_listener is None:
            return None
        requests = self.scheduler.requests
        # A held prompt samples only in its final chunk, and it stops holding at that sample.
        final = tuple(self._final_chunk(requests[c.request_id]) for c in output.chunks
                      if c.samples and requests[c.request_id].hold_kv_after_prefill)
        if not final:
            return None
        self._layer_listener.final_chunks_starting(final)
        return self._layer_listener.layer_written

    def _final_chunk(self, request: Request) -> FinalPrefillChunk:
        """What _hold will record for this request after its first sample."""
        return FinalPrefillChunk(request.request_id, tuple(self.block_manager.block_table(request.request_id)),
                                 request.num_prompt_tokens)

    def _score_prompts(self, chunks: tuple[ScheduledChunk, ...], logits: torch.Tensor) -> torch.Tensor:
        """Record the prompt logprobs of the chunks that score their prompt, and return the sampling rows
        [sum of num_sampled_rows, vocab] of logits [sum of num_logit_rows, vocab] (logits itself when no
        chunk scores: the common case costs nothing)."""
        if not any(chunk.scores_prompt for chunk in chunks):
            return logits
        sampling_rows: list[int] = []
        offset = 0
        for chunk in chunks:
            if chunk.scores_prompt:
                self._record_prompt_logprobs(self.scheduler.requests[chunk.request_id], chunk,
                                             logits[offset:offset + chunk.num_tokens])
            offset += chunk.num_logit_rows
            sampling_rows.extend(range(offset - chunk.num_sampled_rows, offset))
        return logits[sampling_rows]

    @staticmethod
    def _record_prompt_logprobs(request: Request, chunk: ScheduledChunk, logits: torch.Tensor) -> None:
        """logits [chunk.num_tokens, vocab]: row i follows position start_position + i, so it scores prompt
        token start_position + i + 1 (the prompt's last position scores nothing: it samples)."""
        first = chunk.start_position
        end = min(chunk.context_len, request.num_prompt_tokens - 1)  # positions [first, end) score a token
        if end <= first:
            return
        targets = torch.tensor(request.prompt_token_ids[first + 1:end + 1], device=logits.device)  # [end - first]
        raw_logprobs = torch.log_softmax(logits[:end - first], dim=-1)  # [end - first, vocab]
        entries = token_logprobs(raw_logprobs, targets, [request.sampling_params.prompt_logprobs] * (end - first))
        request.prompt_logprobs[first + 1:end + 1] = entries

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk],
                allowed: TokenBitmask | None) -> list[VerifiedRun]:
        """Each sampling chunk's new tokens; logits [sum of num_sampled_rows, vocab]; `allowed`: the
        grammar masks by chunk index (a structured-output request never speculates). A speculating
        chunk's drafts are verified (engine/spec_decode/verifier.py), the others sample one token."""
        requests = self.scheduler.requests
        speculating = [i for i, c in enumerate(chunks) if c.num_spec_tokens]
        if not speculating:
            result = self.sampler(logits, [self._sampling_row(requests[c.request_id]) for c in chunks], allowed)
            return [VerifiedRun((t,), () if lp is None else (lp,)) for t, lp in zip(result.token_ids, result.logprobs)]
        starts = [0]
        for chunk in chunks:
            starts.append(starts[-1] + chunk.num_sampled_rows)
        runs: list[VerifiedRun | None] = [None] * len(chunks)
        plain = [i for i, c in enumerate(chunks) if not c.num_spec_tokens]
        if plain:
            if allowed is not None:  # its rows are chunk indices, all of them plain chunks
                allowed = replace(allowed, rows=tuple(plain.index(row) for row in allowed.rows))
            result = self.sampler(logits[[starts[i] for i in plain]],
                                  [self._sampling_row(requests[chunks[i].request_id]) for i in plain], allowed)
            for i, t, lp in zip(plain, result.token_ids, result.logprobs):
                runs[i] = VerifiedRun((t,), () if lp is None else (lp,))
        rows = [self._speculative_rows(requests[chunks[i].request_id], chunks[i]) for i in speculating]
        index = [row for i in speculating for row in range(starts[i], starts[i + 1])]
        for i, run in zip(speculating, verify(self.sampler, logits[index], rows)):
            runs[i] = run
            self.speculator.record(chunks[i].request_id, chunks[i].num_spec_tokens, run.num_accepted)
        return runs

    def _speculative_rows(self, request: Request, chunk: ScheduledChunk) -> SpeculativeRows:
        drafts = chunk.token_ids[chunk.num_tokens - chunk.num_spec_tokens:]
        return SpeculativeRows(tuple(self._sampling_row(request, drafts[:j]) for j in range(len(drafts) + 1)),
                               drafts)

    def _num_prefill_tokens(self, output: SchedulerOutput) -> int:
        """Scheduled tokens at prompt positions (the rest are decodes of generated tokens)."""
        requests = self.scheduler.requests
        return sum(max(0, min(c.context_len, requests[c.request_id].num_prompt_tokens) - c.start_position)
                   for c in output.chunks)

    def _sampling_row(self, request: Request, drafts: tuple[int, ...] = ()) -> SamplingRow:
        """The row that samples the token after the request's tokens and then `drafts` (speculation)."""
        generator = self._generators.get(request.request_id, self._shared_generator)
        params = request.sampling_params
        # Penalties and bad words read the tokens before the one sampled: drafts included.
        reads_tokens = (params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty
                        or params.bad_words_token_ids)
        token_ids = request.all_token_ids + list(drafts) if drafts and reads_tokens else request.all_token_ids
        return SamplingRow(params, token_ids, request.num_prompt_tokens, generator,
                           self._banned_token_ids(request, len(drafts)))

    @staticmethod
    def _banned_token_ids(request: Request, num_drafts: int = 0) -> tuple[int, ...]:
        """What the next token may not be: until min_tokens, the tokens that would end the output."""
        params = request.sampling_params
        # The token sampled now is output number n + 1 (after num_drafts more, n + num_drafts + 1).
        if params.may_stop(request.num_output_tokens + num_drafts + 1):
            return ()
        eos = () if params.ignore_eos else tuple(sorted(request.eos_token_ids))
        return eos + params.stop_token_ids

    def _append_tokens(self, request: Request, chunk: ScheduledChunk, run: VerifiedRun) -> CompletionDelta:
        """Append the run's tokens one by one, each checked for a stop as if sampled alone; the tokens
        after a stop are dropped. The emitted drafts' KV was computed this step (all but the last
        emitted token's), and the rest of the drafts' slots are rolled back."""
        status = None
        for count, token_id in enumerate(run.token_ids, start=1):
            request.append_output_token(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                break
        token_ids, logprobs = run.token_ids[:count], run.logprobs[:count]
        self._num_generation_tokens += count
        request.logprobs.extend(logprobs)
        if chunk.num_spec_tokens:
            self.scheduler.accept_draft_tokens(request, count - 1)
        if status is None and request.hold_kv_after_prefill:
            status = RequestStatus.FINISHED_PREFILLED
        if status is not None:
            return self._finish(request, status, token_ids, logprobs)
        return self._delta(request, token_ids, logprobs)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        # Before min_tokens, EOS and stop tokens cannot be sampled (the sampler masks them) and
        # stop strings are not looked for.
        may_stop = params.may_stop(request.num_output_tokens)
        is_eos = may_stop and not params.ignore_eos and token_id in request.eos_token_ids
        is_stop_token = may_stop and token_id in params.stop_token_ids
        detokenizer = self._detokenizers.get(request.request_id)
        # A stop token ends the output without its text (vLLM's, with include_stop_str_in_output false).
        stop_string = None if detokenizer is None or is_eos or is_stop_token else detokenizer.append(token_id, may_stop)
        grammar = self.grammars.accept(request.request_id, token_id)
        if grammar == GrammarState.REJECTED:
            request.error = GRAMMAR_REFUSED
            return RequestStatus.FINISHED_ABORTED
        if is_eos:
            return RequestStatus.FINISHED_STOPPED
        if is_stop_token:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if stop_string is not None:
            request.stop_reason = stop_string
            return RequestStatus.FINISHED_STOPPED
        if grammar == GrammarState.COMPLETE:  # the grammar takes no more tokens (nor EOS, by then)
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus, token_ids: tuple[int, ...],
                logprobs: tuple = ()) -> CompletionDelta:
        """Free everything the request holds, in the same step, and build its final delta.

        A prefilled request (producer role) keeps its blocks, recorded in _held."""
        held = status == RequestStatus.FINISHED_PREFILLED
        self.scheduler.finish(request.request_id, status, keep_blocks=held)
        if held:
            self._held[request.request_id] = self._hold(request)
        delta = self._delta(request, token_ids, logprobs, finished=True)
        self._forget(request.request_id)
        return delta

    def _hold(self, request: Request) -> HeldKV:
        generator = self._generators.get(request.request_id)
        state = bytes(generator.get_state().numpy()) if generator is not None else None
        return HeldKV(tuple(self.block_manager.block_table(request.request_id)), request.num_prompt_tokens, state)

    def _delta(self, request: Request, token_ids: tuple[int, ...], logprobs: tuple,
               finished: bool = False) -> CompletionDelta:
        detokenizer = self._detokenizers.get(request.request_id)
        return CompletionDelta(
            request_id=request.request_id, new_token_ids=token_ids, new_logprobs=logprobs,
            text_delta=detokenizer.take_delta(finished) if detokenizer is not None else "",
            finish_reason=request.finish_reason, stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens, num_cached_tokens=max(request.num_cached_tokens, 0),
            first_scheduled_at=request.first_scheduled_at, prompt_logprobs=_prompt_logprobs(request, token_ids),
            error=request.error)

    # ---- scoring ---------------------------------------------------------------------------
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Next-token logits [len(token_ids), vocab] (float32) at every position of one sequence: row i is
        the distribution after token_ids[: i + 1]. Runs the serving path (paged KV, chunks of at most
        max_num_batched_tokens, this engine's dtype and kernels) outside the scheduler, in blocks it
        frees before returning; nothing is sampled, cached or published."""
        if not 0 < len(token_ids) <= self.max_model_len:
            raise InvalidRequestError("prompt", f"must have 1 to max_model_len={self.max_model_len} tokens")
        request = Request(f"score-{self._arrivals}", list(token_ids), SamplingParams(), frozenset(), self._arrivals)
        self._arrivals += 1
        if self.block_manager.allocate(request, len(token_ids)) is None:
            raise InvalidRequestError("prompt", "the KV pool has no room to score it now")
        try:
            return torch.cat([self.runner.execute_all_positions(SchedulerOutput((chunk,), ()))
                              for chunk in self._scoring_chunks(request)])  # [T, vocab]
        finally:
            self.block_manager.free(request.request_id)

    def _scoring_chunks(self, request: Request) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        table = tuple(self.block_manager.block_table(request.request_id))
        tokens = request.prompt_token_ids
        return [ScheduledChunk(request.request_id, tuple(tokens[start:start + budget]), start, table, samples=False)
                for start in range(0, len(tokens), budget)]

    # ---- reports for routers -------------------------------------------------------------
    @property
    def epoch(self) -> str:
        """This engine's KV-event epoch (new for every EngineCore)."""
        return self._kv_events.epoch

    def has_kv_events_after(self, after_seq: int) -> bool:
        """Whether a batch after `after_seq` is logged, once events since the last step are."""
        self._publish_kv_events()
        return self._kv_events.seq > after_seq

    def _publish_kv_events(self) -> None:
        """Move the block manager's pending events into the log as one batch (if any)."""
        self._kv_events.append(self.block_manager.take_events())

    def kv_report(self, epoch: str | None, after_seq: int) -> tuple[tuple[KVEventBatch, ...], KVSnapshot | None]:
        """KV-event batches after the cursor (epoch, after_seq), or a snapshot when it cannot be
        continued; events since the last step are published first, so nothing waits for a step."""
        self._publish_kv_events()
        return self._kv_events.since(epoch, after_seq, self.block_manager.cached_block_hashes)

    def load_report(self) -> LoadReport:
        requests = self.scheduler.requests.values()
        return LoadReport(
            num_running=len(self.scheduler.running), num_waiting=len(requests) - len(self.scheduler.running),
            num_queued_prefill_tokens=sum(_queued_prefill_tokens(r) for r in requests),
            num_kv_blocks=self.block_manager.num_blocks, num_free_kv_blocks=self.block_manager.num_free_blocks,
            prefill_s_per_token=self._step_costs.prefill_s_per_token, decode_step_s=self._step_costs.decode_step_s,
            lora=self._lora_load())

    def _lora_load(self) -> LoraLoad | None:
        """The adapters of the running and of the waiting requests (waiting: as load_report counts them, every
        unfinished request not running); None without enable_lora."""
        if self.lora is None:
            return None
        running_ids = {request.request_id for request in self.scheduler.running}
        waiting = (r for r in self.scheduler.requests.values() if r.request_id not in running_ids)
        return LoraLoad(self.config.max_loras, _adapter_names(self.scheduler.running), _adapter_names(waiting))

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            num_kv_blocks=self.block_manager.num_blocks, num_free_kv_blocks=self.block_manager.num_free_blocks,
            num_cached_free_kv_blocks=self.block_manager.num_cached_free_blocks,
            prefix_cache_queries=scheduler.prefix_cache_queries, prefix_cache_hits=scheduler.prefix_cache_hits,
            num_preemptions=scheduler.num_preemptions, num_steps=self._num_steps,
            num_prompt_tokens=self._num_prompt_tokens, num_generation_tokens=self._num_generation_tokens,
            kv_cache_dtype=self.kv_cache_dtype, kv_bytes_per_token=self.kv_cache.spec.bytes_per_token,
            quantization=self.quantization.method, weight_bits=self.quantization.bits,
            quantization_group_size=self.quantization.group_size,
            spec_decode=None if self.speculator is None else self.speculator.stats())

    @property
    def kv_cache_dtype(self) -> str:
        """The pool's element type: the model's dtype name, or the quantized format's (int8, fp8_e4m3)."""
        spec = self.kv_cache.spec
        return str(spec.dtype).removeprefix("torch.") if spec.quantization is None else spec.quantization.name


def _tokenizer_json(tokenizer_dir: Path, tokenizer: Tokenizer | None) -> str:
    """The tokenizer the grammar masks are computed for: the engine's own, else the tokenizer.json of
    `tokenizer_dir` (--tokenizer's directory, else the model's)."""
    if tokenizer is not None:
        return tokenizer.to_str()
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        raise InvalidRequestError("structured_output",
                                  f"needs the model's tokenizer.json, not found in {tokenizer_dir}")
    return path.read_text()


def _prompt_logprobs(request: Request, token_ids: tuple[int, ...]) -> tuple[TokenLogprobs | None, ...] | None:
    """The request's prompt logprobs for the delta that carries its first output token, else None."""
    first_output = bool(token_ids) and request.num_output_tokens == len(token_ids)
    if request.sampling_params.prompt_logprobs is None or not first_output:
        return None
    return tuple(request.prompt_logprobs)


def _adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    """The distinct LoRA adapters of `requests`, sorted (base-model requests name none)."""
    return tuple(sorted({request.lora_name for request in requests if request.lora_name is not None}))


def _queued_prefill_tokens(request: Request) -> int:
    """Prompt tokens this engine still has to compute (none for a prompt whose KV is being pulled)."""
    if request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
        return 0
    return max(0, request.num_prompt_tokens - request.num_computed_tokens)
