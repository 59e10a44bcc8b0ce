"""Offline API: `LLM(model_dir, **engine_config).generate(prompts, sampling_params)`, shaped like vLLM's
(its prompt forms, its `RequestOutput.outputs`, `chat` over one or many conversations, `enforce_eager`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict, get_args

import jinja2
import torch
from llguidance.gbnf_to_lark import any_to_lark
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import _compile_jinja_template

from splitserve.common.beam_search import Beam, BeamSearch, BeamSearchParams, Candidate, candidates_of, start
from splitserve.common.block_hash import check_cache_salt
from splitserve.common.chat_template import (TEMPLATE_VARIABLES, ContentFormat, check_template_kwargs,
                                             content_parts, parse_call_arguments, resolve_content_format,
                                             template_content)
from splitserve.common.config import (VLLM_DTYPE_ALIASES, VLLM_KV_CACHE_DTYPE_ALIASES, EngineConfig,
                                      GenerationConfig, SamplingDefaults, SpeculativeConfig)
from splitserve.common.generation_config import SAMPLING_KEYS, GenerationConfigFile, resolve_request_defaults
from splitserve.common.errors import InvalidRequestError
from splitserve.common.lora import LoRARequest, check_lora_request
from splitserve.common.pooling import (Classifier, PoolerConfig, PoolingParams, check_cross_encoder,
                                       cosine_similarity, score_pairs)
from splitserve.common.model_dir import check_tokenizer_option, check_tokenizer_vocabulary, tokenizer_dir
from splitserve.common.prompt_truncation import PromptTruncation, prompt_truncation
from splitserve.common.sampling_params import MAX_LOGPROBS, SamplingParams
from splitserve.common.stats import EngineStats
from splitserve.common.structured_output import StructuredOutputKind, grammar_as_lark
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.outputs import (BeamSearchOutput, BeamSearchSequence, ClassificationOutput,
                                       ClassificationRequestOutput, CompletionDelta, CompletionOutput, EmbeddingOutput,
                                       EmbeddingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput)
from splitserve.engine.tiny_model import resolve_model_path
from splitserve.common.token_logprobs import TokenLogprobs


class TextPrompt(TypedDict):
    """vLLM's TextPrompt: text the model's tokenizer encodes."""

    prompt: str
    cache_salt: NotRequired[str]
    """Salts the prefix cache: the prompt reuses cached blocks only of prompts with the same salt."""


class TokensPrompt(TypedDict):
    """vLLM's TokensPrompt: token ids run as given; "prompt" is their text, only reported back."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]
    """As TextPrompt's."""


Prompt = str | list[int] | TextPrompt | TokensPrompt
Conversation = list[dict[str, Any]]
"""Message dicts: "role", "content" (a string, or a list of OpenAI text parts), and what the template reads."""
ChatTemplateContentFormat = Literal["auto", "string", "openai"]

_UNSUPPORTED_PROMPT_KEYS = frozenset({
    "multi_modal_data", "mm_processor_kwargs", "media_io_kwargs", "multi_modal_uuids", "token_type_ids",
    "prompt_token_offsets", "prompt_embeds", "prompt_is_token_ids", "encoder_prompt", "decoder_prompt"})
"""Keys of vLLM's prompt dicts that splitserve has no counterpart for (multi-modal inputs, embeddings,
encoder-decoder and cross-encoder models): refused by name rather than silently ignored."""
_PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


@dataclass(frozen=True)
class PromptInput:
    """A prompt in any of its forms, resolved to what the engine runs."""

    text: str | None
    """The prompt's text when the caller gave one (RequestOutput.prompt)."""
    token_ids: list[int]
    cache_salt: str | None = None
    """The prompt dict's cache_salt (None: unsalted)."""

    def truncated(self, truncation: PromptTruncation | None) -> PromptInput:
        """The prompt with its token ids cut as `truncation` says (None: as it is); its text kept, as vLLM
        reports it."""
        if truncation is None:
            return self
        return replace(self, token_ids=list(truncation.applied(tuple(self.token_ids))))


CHAT_TEMPLATE_CONTENT_FORMATS: tuple[ChatTemplateContentFormat, ...] = get_args(ChatTemplateContentFormat)
"""vLLM's chat_template_content_format values chat() takes (common.chat_template.CONTENT_FORMAT_OPTIONS)."""


def _reserved_template_kwargs() -> dict[str, str]:
    """chat_template_kwargs keys chat() refuses, each with why: its own arguments, the conversation, and
    apply_chat_template's other parameters (they would change tokenization, not the template's variables).
    `documents` is let through: it is how vLLM's offline chat passes documents to the template."""
    own = {"chat_template", "add_generation_prompt", "continue_final_message", "tools"}
    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
    tokenizer_arguments = {parameter.name for parameter in parameters if parameter.name != "self"
                           and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)}
    reserved = {name: "is an argument of the tokenizer's apply_chat_template that chat() sets itself, not a "
                      "template variable" for name in tokenizer_arguments - own - TEMPLATE_VARIABLES}
    reserved.update({name: f"is chat()'s own argument: pass {name}=... to chat() instead" for name in own})
    reserved["messages"] = "is the conversation itself (chat()'s messages)"
    return reserved


_RESERVED_TEMPLATE_KWARGS = _reserved_template_kwargs()


@dataclass(frozen=True)
class ChatOptions:
    """How chat() renders its conversations (vLLM's LLM.chat arguments), checked before any is rendered."""

    chat_template: str | None = None
    """A Jinja template used instead of the tokenizer's; None: the tokenizer's."""
    add_generation_prompt: bool = True
    """End the prompt with the template's opening of an assistant turn."""
    continue_final_message: bool = False
    """End the prompt inside the last message's content (no end of turn): the model continues it."""
    tools: list[dict[str, Any]] | None = None
    """The template's `tools` variable (JSON schemas, the Hugging Face convention); None: no tools."""
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """More template variables; none of _RESERVED_TEMPLATE_KWARGS."""

    def __post_init__(self) -> None:
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise InvalidRequestError("chat_template", f"must be a Jinja template string or None, got "
                                                       f"{type(self.chat_template).__name__}")
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(name, f"must be a bool, got {getattr(self, name)!r}")
        if self.continue_final_message and self.add_generation_prompt:
            # transformers' (and so vLLM's) refusal, raised before anything is rendered.
            raise InvalidRequestError("continue_final_message", "continue_final_message and add_generation_prompt "
                                                                "are not compatible: pass add_generation_prompt="
                                                                "False to continue the final message")
        if self.tools is not None:
            _check_tools(self.tools)
        _check_template_kwargs(self.template_kwargs)

    def apply_chat_template_kwargs(self) -> dict[str, Any]:
        """apply_chat_template's arguments (template_kwargs become template variables)."""
        return dict(self.template_kwargs, chat_template=self.chat_template, tools=self.tools,
                    add_generation_prompt=self.add_generation_prompt,
                    continue_final_message=self.continue_final_message)


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


class _Accumulator:
    """Collects one sequence's deltas (one engine request's) into its CompletionOutput."""

    def __init__(self, wants_logprobs: bool):
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[TokenLogprobs] | None = [] if wants_logprobs else None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.final: CompletionDelta | None = None

    def add(self, delta: CompletionDelta) -> None:
        self.token_ids.extend(delta.new_token_ids)
        self.text += delta.text_delta
        if self.logprobs is not None:
            self.logprobs.extend(delta.new_logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = list(delta.prompt_logprobs)
        if delta.finished:
            self.final = delta

    def completion(self, index: int) -> CompletionOutput:
        cumulative = None if self.logprobs is None else sum(entry.logprob for entry in self.logprobs)
        return CompletionOutput(index, self.text, self.token_ids, cumulative, self.logprobs, self.final.finish_reason,
                                self.final.stop_reason)


@dataclass(frozen=True)
class _Job:
    """One prompt of a generate() call: the RequestOutput it becomes, run as one engine request per sequence."""

    request_id: str
    prompt: PromptInput
    sequences: tuple[tuple[str, SamplingParams], ...]
    """(engine request id, sampling) of sequence i at index i: the job's own id when there is one sequence,
    else `<id>-<i>`; sequence i samples with SamplingParams.for_sequence(i)."""
    lora_request: LoRARequest | None = None
    """The adapter every sequence runs with (None: the base model)."""

    def output(self, accumulators: dict[str, _Accumulator]) -> RequestOutput:
        """The prompt-level fields are sequence 0's (every sequence runs the same prompt)."""
        first = accumulators[self.sequences[0][0]]
        completions = [accumulators[request_id].completion(i) for i, (request_id, _) in enumerate(self.sequences)]
        return RequestOutput(self.request_id, self.prompt.text, self.prompt.token_ids, first.prompt_logprobs,
                             completions, True, first.final.num_cached_tokens)


def _engine_dtype(dtype: object) -> object:
    """EngineConfig's name of a dtype as vLLM's LLM(dtype=...) takes it: a torch dtype, or its "half" / "float";
    anything else as given (EngineConfig names what it accepts)."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return VLLM_DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype


class LLM:
    def __init__(self, model: str | Path, show_progress: bool = False, enforce_eager: bool = False,
                 generation_config: str = "auto", override_generation_config: dict[str, float | int] | None = None,
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, trust_remote_code: bool = False,
                 tokenizer: str | Path | None = None, speculative_config: Mapping[str, object] | None = None,
                 task: str | None = None, **engine_config) -> None:
        """`engine_config`: EngineConfig's fields (`dtype` also in vLLM's spellings: "half", "float", a torch
        dtype; `kv_cache_dtype` "fp8", vLLM's e4m3). `enforce_eager` (vLLM's, the CLI's `--enforce-eager`):
        never capture CUDA graphs, i.e. cuda_graphs=False; refused together with cuda_graphs=True.
        `tensor_parallel_size` / `pipeline_parallel_size` (vLLM's): 1 only, one device per engine, as the CLI's
        flags; `trust_remote_code` (vLLM's) is accepted and changes nothing: no model-directory code runs.
        `generation_config` and `override_generation_config` (vLLM's, the CLI's `--generation-config` and
        `--override-generation-config`): where get_default_sampling_params() takes its values from.
        `model`: a model directory, or an embedded model's name ("default", "default-draft") as on the CLI.
        `tokenizer` (vLLM's, the CLI's `--tokenizer`): the directory the tokenizer (and its chat template) is
        loaded from instead of the model's; generation_config.json (EOS ids, defaults) is still the model's.
        UnsupportedModelError naming --tokenizer for a directory without tokenizer.json, and for a tokenizer with
        more ids than the model's vocab_size.
        `speculative_config` (vLLM's): a speculative decoding mapping in vLLM's keys or ours
        (SpeculativeConfig.from_vllm), instead of `speculative`, a SpeculativeConfig; passing both is refused.
        `runner` (vLLM's): "generate" (the default) or "pooling" (embed(), classify(), score():
        docs/engine.md#pooling-requests); `task` (older vLLM's spelling): "embed", "classify" and "score" are runner
        "pooling", "generate" runner "generate". `pooler_config`: a
        PoolerConfig or vLLM's dict of it ({"pooling_type": "MEAN", "use_activation": False})."""
        for name, size in (("tensor_parallel_size", tensor_parallel_size),
                           ("pipeline_parallel_size", pipeline_parallel_size)):
            if size != 1:
                raise ValueError(f"{name}: only 1 is supported, got {size!r}: an engine runs on one device; scale "
                                 "out with `splitserve serve --prefill-workers / --decode-workers` instead")
        _resolve_runner(task, engine_config)
        model = resolve_model_path(model)
        self._default_params = _default_sampling_params(model, GenerationConfig(
            generation_config, _sampling_overrides(override_generation_config or {})))
        if enforce_eager:
            if engine_config.get("cuda_graphs"):
                raise ValueError("enforce_eager=True and cuda_graphs=True contradict each other: enforce_eager "
                                 "means cuda_graphs=False; pass one of them")
            engine_config["cuda_graphs"] = False
        if speculative_config is not None:
            if "speculative" in engine_config:
                raise ValueError("speculative and speculative_config both set speculative decoding; pass one of "
                                 "them (speculative_config: vLLM's dict, speculative: a SpeculativeConfig)")
            engine_config["speculative"] = SpeculativeConfig.from_vllm(speculative_config)
        if "dtype" in engine_config:
            engine_config["dtype"] = _engine_dtype(engine_config["dtype"])
        if "kv_cache_dtype" in engine_config:
            kv_cache_dtype = engine_config["kv_cache_dtype"]
            if isinstance(kv_cache_dtype, str):  # anything else reaches EngineConfig, which names what it accepts
                engine_config["kv_cache_dtype"] = VLLM_KV_CACHE_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
        if tokenizer is not None:
            check_tokenizer_option(tokenizer)
        files = tokenizer_dir(model, tokenizer)
        self.tokenizer = load_tokenizer(files)
        if tokenizer is not None:
            check_tokenizer_vocabulary(len(self.tokenizer), files, model)
        self.engine = EngineCore(model, EngineConfig(**engine_config), self.tokenizer.backend_tokenizer,
                                 show_progress, files)
        self._counter = 0
        self._kept: dict[str, list[CompletionDelta]] = {}
        """Deltas a step made for requests that another call on this LLM consumes (a stream open while
        generate() or another stream steps the engine), in order, until that call takes them."""
        self._abandoned: set[str] = set()
        """Requests aborted because their call ended early: their final (abort) deltas are dropped."""

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer prompts are encoded and outputs decoded with (vLLM's LLM.get_tokenizer): the model's,
        or the `tokenizer` directory's; the same object as `self.tokenizer`."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling_params samples with (vLLM's): the model's generation_config.json
        values (temperature, top_p, top_k, min_p, penalties; max_new_tokens as max_tokens) under the overrides,
        else SamplingParams(). Params a call passes are used as they are, not merged with these."""
        return self._default_params

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order. `prompts`: one prompt or a list; a
        prompt is a str, a list of token ids, a TextPrompt or a TokensPrompt (vLLM's forms). `use_tqdm`
        (vLLM's): True shows a progress bar of finished sequences, a callable (e.g.
        `functools.partial(tqdm, leave=False)`) makes it, called with `total` and `desc`. `lora_request`
        (vLLM's; needs enable_lora): the LoRA adapter every prompt runs with, or a list with one per prompt
        (None in it: that prompt runs the base model). `priority` (vLLM's): one integer per prompt, for an
        engine whose scheduling_policy is "priority" (lower runs first); None: every prompt's is 0.

        A prompt whose SamplingParams.n > 1 runs n sequences (seeded as SamplingParams.for_sequence says), the
        n CompletionOutputs of its one RequestOutput. Every prompt is validated before any is queued, so a bad
        one leaves nothing allocated.
        """
        self._check_generates()
        _check_use_tqdm(use_tqdm)
        prompt_list = _prompt_list(prompts)
        params = [self._tokenized(sp) for sp in _broadcast_params(
            self._default_params if sampling_params is None else sampling_params, len(prompt_list))]
        priorities = _priorities(priority, len(prompt_list))
        loras = _broadcast_lora_requests(lora_request, len(prompt_list))
        jobs = [self._job(*self._prepared(self._resolve(p), sp), lora)
                for p, sp, lora in zip(prompt_list, params, loras)]
        requests = [(request_id, job.prompt, sp, rank, job.lora_request) for job, rank in zip(jobs, priorities)
                    for request_id, sp in job.sequences]
        for request_id, prompt, sp, rank, lora in requests:
            sp.check_logprobs_limit(MAX_LOGPROBS, self.engine.vocab_size)  # vLLM's default --max-logprobs
            self.engine.validate(request_id, prompt.token_ids, sp, prompt.cache_salt, rank, lora)
        accumulators = {request_id: _Accumulator(sp.logprobs is not None)
                        for request_id, _, sp, _, _ in requests}
        try:
            for request_id, prompt, sp, rank, lora in requests:
                self.engine.add_request(request_id, prompt.token_ids, sp, cache_salt=prompt.cache_salt, priority=rank,
                                        lora_request=lora)
            with _progress_bar(use_tqdm, len(requests)) as progress:
                for delta in self._deltas(set(accumulators)):
                    accumulators[delta.request_id].add(delta)
                    progress.update(int(delta.finished))
        finally:  # an interrupt or an error (queueing included): nothing of this call stays running
            self._abandon(accumulators)
        return [job.output(accumulators) for job in jobs]

    def embed(self, prompts: Prompt | Sequence[Prompt], *, use_tqdm: bool | Callable[..., tqdm] = False,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed (runner "pooling"): one embedding per prompt, in input order, each a pooling request
        (EngineCore.add_pooling_request) run to the end of its prefill. `pooling_params`: one for every prompt or
        one per prompt (None: the model's defaults). `truncate_prompt_tokens`: keep the last k tokens of each
        prompt (-1: the last max_model_len, as vLLM's; nothing is generated after a pooled prompt). Every prompt is
        validated before any is queued."""
        model = self.engine.model_pooling
        if model is None or model.classifier is not None:
            raise ValueError("Embedding API is not supported by this model. Try converting the model using "
                             "`--convert embed`. (splitserve: start the LLM with runner=\"pooling\" on an "
                             "embedding model)")
        prompt_list = [self._resolve(prompt) for prompt in _prompt_list(prompts)]
        pooled = self._pool(prompt_list, use_tqdm, pooling_params, lora_request, truncate_prompt_tokens)
        return [EmbeddingRequestOutput(request_id, EmbeddingOutput(list(final.embedding)), token_ids,
                                       final.num_cached_tokens, True) for request_id, token_ids, final in pooled]

    def classify(self, prompts: Prompt | Sequence[Prompt], *, use_tqdm: bool | Callable[..., tqdm] = False,
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """vLLM's LLM.classify (runner "pooling", a sequence-classification model): each prompt's `probs`, the
        head's logits through the model's activation (Classifier.classified; a PoolingParams with
        use_activation=False: the logits). Arguments as embed()'s."""
        classifier = self._classifier("Classification")
        prompt_list = [self._resolve(prompt) for prompt in _prompt_list(prompts)]
        params = _broadcast_pooling_params(pooling_params, len(prompt_list))
        pooled = self._pool(prompt_list, use_tqdm, params, lora_request, truncate_prompt_tokens)
        return [ClassificationRequestOutput(request_id,
                                            ClassificationOutput(list(classifier.classified(final.embedding,
                                                                                            p.use_activation))),
                                            token_ids, final.num_cached_tokens, True)
                for (request_id, token_ids, final), p in zip(pooled, params)]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], *,
              use_tqdm: bool | Callable[..., tqdm] = False, pooling_params: PoolingParams | None = None,
              lora_request: LoRARequest | None = None,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: one score per pair of data_1 x data_2 (1:1, 1:N or N:N, common.pooling.score_pairs). An
        embedding model scores the cosine similarity of the two texts' embeddings; a sequence-classification model
        (one label) runs each pair as one prompt, the tokenizer's pair encoding (vLLM's cross-encoder prompt), and
        scores its logit through Classifier.score_activation (use_activation=False: the logit)."""
        model = self.engine.model_pooling
        if model is None:
            raise ValueError("Score API is not supported by this model. (splitserve: start the LLM with "
                             "runner=\"pooling\")")
        pairs = score_pairs(data_1, data_2, "data_1", "data_2")
        params = pooling_params or PoolingParams()
        if model.classifier is None:
            return self._embedding_scores(pairs, use_tqdm, params, lora_request, truncate_prompt_tokens)
        check_cross_encoder(model.classifier)
        prompt_list = [PromptInput(None, self.tokenizer(text=query, text_pair=document)["input_ids"])
                       for query, document in pairs]
        pooled = self._pool(prompt_list, use_tqdm, params, lora_request, truncate_prompt_tokens)
        return [ScoringRequestOutput(request_id,
                                     ScoringOutput(model.classifier.scored(final.embedding, params.use_activation)),
                                     token_ids, final.num_cached_tokens, True)
                for request_id, token_ids, final in pooled]

    def _embedding_scores(self, pairs: list[tuple[str, str]], use_tqdm: bool | Callable[..., tqdm],
                          params: PoolingParams, lora_request: LoRARequest | None,
                          truncate_prompt_tokens: int | None) -> list[ScoringRequestOutput]:
        """Each distinct text embedded once, each pair scored by cosine similarity; a pair's prompt_token_ids are
        vLLM's: the first text's, the pad token when the tokenizer has one, then the second's."""
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        pooled = self._pool([self._resolve(text) for text in texts], use_tqdm, params, lora_request,
                            truncate_prompt_tokens)
        by_text = dict(zip(texts, pooled))
        padding = [] if self.tokenizer.pad_token_id is None else [self.tokenizer.pad_token_id]
        outputs = []
        for query, document in pairs:
            (first_id, first_ids, first), (second_id, second_ids, second) = by_text[query], by_text[document]
            outputs.append(ScoringRequestOutput(f"{first_id}_{second_id}", ScoringOutput(
                cosine_similarity(first.embedding, second.embedding)), first_ids + padding + second_ids,
                first.num_cached_tokens + second.num_cached_tokens, True))
        return outputs

    def _classifier(self, api: str) -> Classifier:
        model = self.engine.model_pooling
        if model is None or model.classifier is None:
            raise ValueError(f"{api} API is not supported by this model. (splitserve: start the LLM with "
                             f"runner=\"pooling\" on a sequence-classification model)")
        return model.classifier

    def _pool(self, prompt_list: list[PromptInput], use_tqdm: bool | Callable[..., tqdm],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
              truncate_prompt_tokens: int | None) -> list[tuple[str, list[int], CompletionDelta]]:
        """Each prompt as a pooling request, run to its end: (request id, the prompt's token ids as run, its final
        delta, whose embedding is the pooled vector) in input order. Every prompt is validated before any is
        queued."""
        _check_use_tqdm(use_tqdm)
        truncation = prompt_truncation(truncate_prompt_tokens, None, self.engine.max_model_len, pools=True)
        prompt_list = [prompt.truncated(truncation) for prompt in prompt_list]
        params = _broadcast_pooling_params(pooling_params, len(prompt_list))
        loras = _broadcast_lora_requests(lora_request, len(prompt_list))
        request_ids = [self._next_id() for _ in prompt_list]
        for request_id, prompt, sp, lora in zip(request_ids, prompt_list, params, loras):
            self.engine.validate_pooling(request_id, prompt.token_ids, sp, prompt.cache_salt, 0, lora)
        finals: dict[str, CompletionDelta] = {}
        try:
            for request_id, prompt, sp, lora in zip(request_ids, prompt_list, params, loras):
                self.engine.add_pooling_request(request_id, prompt.token_ids, sp, prompt.cache_salt,
                                                lora_request=lora)
            with _progress_bar(use_tqdm, len(request_ids)) as progress:
                for delta in self._deltas(set(request_ids)):
                    if delta.finished:
                        finals[delta.request_id] = delta
                        progress.update(1)
        finally:  # an interrupt or an error: nothing of this call stays running
            self._abandon(request_ids)
        return [(request_id, prompt.token_ids, finals[request_id])
                for request_id, prompt in zip(request_ids, prompt_list)]

    def _check_generates(self) -> None:
        if self.engine.model_pooling is not None:
            raise ValueError("LLM.generate() is only supported for generative models. Try passing "
                             "`--runner generate` to use the model as a generative model.")

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., tqdm] = False,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, chat_template: str | None = None,
             chat_template_content_format: ChatTemplateContentFormat = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             mm_processor_kwargs: None = None, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """One conversation (a list of message dicts) or a list of conversations through the chat template;
        one output per conversation, in order, as vLLM's `LLM.chat`, with its arguments and defaults:
        `chat_template` (a Jinja template string used instead of the tokenizer's), `add_generation_prompt`,
        `continue_final_message` (the prompt ends inside the last message, which the model continues),
        `tools` and `chat_template_kwargs` (more template variables, e.g. {"enable_thinking": False}).
        `chat_template_content_format`: how content reaches the template, as in vLLM: "string" (a list of
        text parts joined with newlines), "openai" (every content a list of {"type": "text", "text": ...}
        parts), or "auto" ("openai" when the template loops over a message's content, else "string").
        `lora_request`: as generate()'s (one adapter, or one per conversation). `priority`: as generate()'s,
        one integer per conversation (vLLM's LLM.chat has none; its generate does). `mm_processor_kwargs` is
        accepted as None only (text-only models). Every conversation is rendered before any is queued."""
        _refuse_given("mm_processor_kwargs", mm_processor_kwargs, "models here are text-only")
        options = ChatOptions(chat_template, add_generation_prompt, continue_final_message, tools,
                              {} if chat_template_kwargs is None else chat_template_kwargs)
        content_format = self._content_format(chat_template_content_format, options)
        if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
            raise InvalidRequestError("messages", f"must be a conversation (a list of message dicts) or a list of "
                                                  f"conversations, got {type(messages).__name__}")
        if _is_one_conversation(messages):
            prompts = [self._chat_prompt(messages, options, content_format, "messages")]
        else:
            prompts = [self._chat_prompt(conversation, options, content_format, f"messages[{index}]")
                       for index, conversation in enumerate(messages)]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request, priority)

    def beam_search(self, prompts: Sequence[Prompt], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    priority: Sequence[int] | None = None) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`, over the same core as the server's use_beam_search (common/beam_search.py):
        each step runs every live beam of every prompt as one generate() batch (one token, 2 x beam_width
        logprobs; the prefix cache holds the shared prefixes). A beam's tokens keep the EOS that completed it
        and its text is the prompt's and the beam's tokens decoded, as vLLM's offline beams are (so
        include_stop_str_in_output changes nothing here). A step's candidates are ranked by cumulative logprob,
        as vLLM's server does; vLLM's offline LLM ranks them by the length-penalised score, which orders them
        differently only under ignore_eos, when a candidate is EOS. `lora_request`: as generate()'s.
        `priority`: as generate()'s, one integer per prompt, which every step's beams of that prompt run with."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestError("params", f"must be a BeamSearchParams, got {type(params).__name__}")
        params.check_logprobs_limit(MAX_LOGPROBS, self.engine.vocab_size)  # vLLM's default --max-logprobs
        resolved = [self._resolve(prompt) for prompt in _prompt_list(prompts)]
        loras = _broadcast_lora_requests(lora_request, len(resolved))
        priorities = _priorities(priority, len(resolved))
        kept_eos = replace(params, include_stop_str_in_output=True)
        searches = [start(replace(kept_eos, max_tokens=min(params.max_tokens, self._room(p))), p.token_ids,
                          self.tokenizer.eos_token_id) for p in resolved]
        while not all(search.done for search in searches):
            searches = self._beam_step(searches, resolved, loras, priorities)
        return [BeamSearchOutput([self._beam_sequence(search, beam) for beam in search.best()]) for search in searches]

    def _prepared(self, prompt: PromptInput, params: SamplingParams) -> tuple[PromptInput, SamplingParams]:
        """The prompt cut as params.truncate_prompt_tokens says (PromptInput.truncated), and params
        with max_tokens None resolved to the room the cut prompt leaves: what the engine runs."""
        prompt = prompt.truncated(prompt_truncation(params.truncate_prompt_tokens, None, self.engine.max_model_len))
        return prompt, params.resolved_max_tokens(self._room(prompt))

    def _room(self, prompt: PromptInput) -> int:
        """Output tokens the context leaves a prompt (at least one, or generate() refuses the prompt)."""
        return max(self.engine.max_model_len - len(prompt.token_ids), 1)

    def _beam_step(self, searches: list[BeamSearch], prompts: list[PromptInput], loras: list[LoRARequest | None],
                   priorities: list[int]) -> list[BeamSearch]:
        """Every unfinished search one step on, all their beams in one generate() call (each beam with its
        prompt's adapter and priority)."""
        live = [(index, search) for index, search in enumerate(searches) if not search.done]
        beams = [(index, tokens) for index, search in live for tokens in search.step_prompts()]
        batch = [{"prompt_token_ids": list(tokens), **_salt(prompts[index])} for index, tokens in beams]
        step = SamplingParams(max_tokens=1, temperature=live[0][1].params.temperature,
                              logprobs=live[0][1].params.num_logprobs)
        outputs = iter(self.generate(batch, step, lora_request=[loras[index] for index, _ in beams],
                                     priority=[priorities[index] for index, _ in beams]))
        stepped = list(searches)
        for index, search in live:
            stepped[index] = search.step([_candidates(next(outputs)) for _ in search.beams])
        return stepped

    def _beam_sequence(self, search: BeamSearch, beam: Beam) -> BeamSearchSequence:
        tokens = list(search.prompt_token_ids + beam.token_ids)
        return BeamSearchSequence(tokens, beam.cum_logprob, self.tokenizer.decode(tokens), beam.finish_reason,
                                  beam.stop_reason)

    def _content_format(self, option: object, options: ChatOptions) -> ContentFormat:
        """chat_template_content_format resolved: "auto" read from the template chat() renders with
        (the tokenizer's when options give none; "string" when there is none, which rendering reports)."""
        if option not in CHAT_TEMPLATE_CONTENT_FORMATS:
            raise InvalidRequestError("chat_template_content_format", f"must be one of "
                                                                      f"{', '.join(CHAT_TEMPLATE_CONTENT_FORMATS)}, "
                                                                      f"got {option!r}")
        try:
            template = self.tokenizer.get_chat_template(options.chat_template, options.tools)
        except ValueError:  # the tokenizer has no template: apply_chat_template says so
            return resolve_content_format(str(option), None)
        return resolve_content_format(str(option), _parse_chat_template(template))

    def _chat_prompt(self, conversation: Conversation, options: ChatOptions, content_format: ContentFormat,
                     where: str) -> TokensPrompt:
        """One conversation rendered by transformers' apply_chat_template: its text (RequestOutput.prompt, as
        vLLM's chat reports) and that text's token ids without added special tokens (the template writes every
        one; what apply_chat_template(tokenize=True) returns). A template's refusal is an InvalidRequestError
        naming what it refused."""
        if not isinstance(conversation, list) or not all(isinstance(message, dict) for message in conversation):
            raise InvalidRequestError(where, "must be a list of {role, content} message dicts")
        messages = [_template_message(message, content_format, f"{where}[{index}]")
                    for index, message in enumerate(conversation)]
        try:
            text = self.tokenizer.apply_chat_template(messages, **options.apply_chat_template_kwargs(), tokenize=False)
        except jinja2.TemplateSyntaxError as error:
            raise InvalidRequestError("chat_template", f"does not compile: {error} (line {error.lineno})") from error
        except jinja2.TemplateError as error:  # raise_exception(...) in the template, sandbox refusals
            raise InvalidRequestError(where, f"rejected by the chat template: {error}") from error
        except TypeError as error:  # chat_template_kwargs replacing what the template calls (as in the router)
            raise InvalidRequestError(where, f"rejected by the chat template: TypeError: {error}") from error
        return TokensPrompt(prompt_token_ids=self.tokenizer.encode(text, add_special_tokens=False), prompt=text)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               priority: int = 0, lora_request: LoRARequest | None = None) -> Iterator[CompletionDelta]:
        """Deltas of one request as the engine produces them. Several streams (and generate() calls)
        may be open at once: each step serves all their requests, and each gets its own deltas.
        Closing the stream early aborts its request. `priority`: as one of generate()'s. `lora_request`: the
        adapter it runs with (enable_lora)."""
        self._check_generates()
        request_id = self._next_id()
        prompt_input, params = self._prepared(self._resolve(prompt), self._tokenized(
            self._default_params if sampling_params is None else sampling_params))
        self.engine.add_request(request_id, prompt_input.token_ids, params, cache_salt=prompt_input.cache_salt,
                                priority=priority, lora_request=lora_request)
        try:
            for delta in self._deltas({request_id}):
                yield delta
        finally:
            self._abandon([request_id])

    def prompt_logits(self, prompt: Prompt) -> torch.Tensor:
        """Next-token logits [num_prompt_tokens, vocab] (float32) at every prompt position (EngineCore.prompt_logits)."""
        return self.engine.prompt_logits(self._resolve(prompt).token_ids)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _deltas(self, request_ids: set[str]) -> Iterator[CompletionDelta]:
        """The deltas of `request_ids` (each request's in order) until all have finished, stepping the
        engine when none is kept for them; a step's deltas of other requests are kept for their calls."""
        unfinished = set(request_ids)
        while unfinished:
            owned = [request_id for request_id in self._kept if request_id in unfinished]
            ready = [delta for request_id in owned for delta in self._kept.pop(request_id)]
            if not ready and not self.engine.has_unfinished_requests():
                return
            if not ready:
                for delta in self.engine.step():  # all kept before any is yielded: a caller may stop at a yield
                    self._keep(delta)
            for delta in ready:
                if delta.finished:
                    unfinished.discard(delta.request_id)
                yield delta

    def _keep(self, delta: CompletionDelta) -> None:
        if delta.request_id not in self._abandoned:
            self._kept.setdefault(delta.request_id, []).append(delta)
        elif delta.finished:
            self._abandoned.discard(delta.request_id)

    def _abandon(self, request_ids: Iterable[str]) -> None:
        """Abort those of `request_ids` still in the engine (their call ended early) and drop what is
        kept for them; a later step's abort delta is dropped too."""
        for request_id in request_ids:
            self._kept.pop(request_id, None)
            if self.engine.abort_request(request_id):
                self._abandoned.add(request_id)

    def _job(self, prompt: PromptInput, params: SamplingParams, lora_request: LoRARequest | None) -> _Job:
        request_id = self._next_id()
        ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        return _Job(request_id, prompt, tuple((sequence_id, params.for_sequence(i))
                                              for i, sequence_id in enumerate(ids)), lora_request)

    def _tokenized(self, params: SamplingParams) -> SamplingParams:
        """params with its bad_words tokenized by the model's tokenizer and a GBNF grammar as Lark (as the router
        does); InvalidRequestError naming sampling_params when it is not a SamplingParams."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", f"must be a SamplingParams (or None), got "
                                                         f"{type(params).__name__}")
        params = _with_lark_grammar(params)
        if not params.bad_words or params.bad_words_token_ids:
            return params
        return params.with_bad_words_tokenized(lambda text: self.tokenizer.encode(text, add_special_tokens=False))

    def _resolve(self, prompt: Prompt) -> PromptInput:
        if isinstance(prompt, dict):
            return self._resolve_dict(prompt)
        if isinstance(prompt, str):
            return PromptInput(prompt, self.tokenizer.encode(prompt, add_special_tokens=True))
        if not _is_token_list(prompt):
            raise InvalidRequestError("prompt", "must be a string, a list of token ids, {'prompt': str} or "
                                                "{'prompt_token_ids': list[int]}")
        return PromptInput(None, list(prompt))

    def _resolve_dict(self, prompt: dict) -> PromptInput:
        """vLLM's TokensPrompt when it has "prompt_token_ids", else its TextPrompt (either with an optional
        "cache_salt")."""
        for key in prompt:
            if key in _UNSUPPORTED_PROMPT_KEYS:
                raise InvalidRequestError(key, "vLLM's prompt key is not supported: splitserve takes a prompt's "
                                               "text or token ids (and a cache_salt) only")
            if key not in _PROMPT_KEYS:
                raise InvalidRequestError(key, "unknown prompt key: a prompt dict has 'prompt' (TextPrompt) or "
                                               "'prompt_token_ids' and an optional 'prompt' (TokensPrompt), and "
                                               "an optional 'cache_salt'")
        # vLLM's LLM salts only with a truthy cache_salt: "" is no salt (its HTTP API refuses "", as ours do).
        text, cache_salt = prompt.get("prompt"), prompt.get("cache_salt") if prompt.get("cache_salt") != "" else None
        if "prompt" in prompt and not isinstance(text, str):
            raise InvalidRequestError("prompt", f"must be a string, got {type(text).__name__}")
        check_cache_salt(cache_salt)
        if "prompt_token_ids" in prompt:
            if not _is_token_list(prompt["prompt_token_ids"]):
                raise InvalidRequestError("prompt_token_ids", "must be a list of token ids")
            return PromptInput(text, list(prompt["prompt_token_ids"]), cache_salt)
        if text is None:
            raise InvalidRequestError("prompt", "a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return PromptInput(text, self.tokenizer.encode(text, add_special_tokens=True), cache_salt)

    def _next_id(self) -> str:
        self._counter += 1
        return f"offline-{self._counter}"


def _with_lark_grammar(params: SamplingParams) -> SamplingParams:
    """params with a GBNF / EBNF grammar constraint (xgrammar's, what vLLM's offline examples write) converted to
    Lark as the router converts a request's grammar; a Lark grammar comes back as it is."""
    constraint = params.structured_output
    if constraint is None or constraint.kind != StructuredOutputKind.GRAMMAR:
        return params
    return replace(params, structured_output=replace(constraint, spec=grammar_as_lark(constraint.spec, any_to_lark)))


def _salt(prompt: PromptInput) -> dict[str, str]:
    return {} if prompt.cache_salt is None else {"cache_salt": prompt.cache_salt}


def _candidates(output: RequestOutput) -> tuple[Candidate, ...]:
    """A beam's step candidates: its one token's logprobs (the sampled token first, as vLLM's)."""
    entry = output.outputs[0].logprobs[0]
    return candidates_of(Candidate(entry.token_id, entry.logprob), entry.top)


def _parse_chat_template(template: str) -> jinja2.nodes.Template | None:
    """`template`'s syntax tree in the environment apply_chat_template renders it in (its extension tags
    included; the compiled environment is cached by transformers), None when it does not parse."""
    try:
        return _compile_jinja_template(template).environment.parse(template)
    except jinja2.TemplateSyntaxError:
        return None


def _template_message(message: dict[str, Any], content_format: ContentFormat, field: str) -> dict[str, Any]:
    """A copy of `message` as vLLM's LLM.chat hands it to the template (and as the router does): content
    in `content_format`, and an assistant's tool calls with their JSON arguments parsed (null or "": {}),
    which templates render with `tojson` or iterate."""
    texts = content_parts(message.get("content"), f"{field}.content")
    rendered = {**message, "content": template_content(texts, content_format)}
    if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
        rendered["tool_calls"] = [_parsed_tool_call(call, f"{field}.tool_calls[{index}]")
                                  for index, call in enumerate(message["tool_calls"])]
    return rendered


def _parsed_tool_call(call: object, field: str) -> object:
    """`call` with its function's arguments parsed; a call of another shape is the template's to read."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = call["function"]
    return {**call, "function": {**function, "arguments": parse_call_arguments(function.get("arguments"),
                                                                              f"{field}.function")}}


def _prompt_list(prompts: object) -> list[object]:
    """generate()'s prompts as a list (each is checked as it is resolved); InvalidRequestError naming
    `prompts` when they are neither one prompt nor a list or tuple of them."""
    if _is_one_prompt(prompts):
        return [prompts]
    if not isinstance(prompts, list | tuple):
        raise InvalidRequestError("prompts", f"must be a prompt (a str, a list of token ids, a TextPrompt or a "
                                             f"TokensPrompt dict) or a list of prompts, got {type(prompts).__name__}")
    return list(prompts)


def _is_one_prompt(prompts: object) -> bool:
    """An empty list is no prompts (vLLM's prompt_to_seq), not one prompt of no tokens."""
    return isinstance(prompts, str | dict) or (bool(prompts) and _is_token_list(prompts))


def _is_one_conversation(messages: object) -> bool:
    """A conversation is a non-empty list of message dicts; anything else (an empty list too: no
    conversations, as vLLM's conversation_to_seq reads it) is taken as a list of conversations."""
    return isinstance(messages, list) and bool(messages) and not all(isinstance(m, list) for m in messages)


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _sampling_overrides(values: dict[str, float | int]) -> SamplingDefaults:
    """override_generation_config as SamplingDefaults; ValueError naming keys it has no field for."""
    unknown = sorted(set(values) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"override_generation_config: no such default {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(sorted(SAMPLING_KEYS))}")
    return SamplingDefaults(**values)


def _default_sampling_params(model_dir: Path, config: GenerationConfig) -> SamplingParams:
    """SamplingParams with the defaults `config` resolves for `model_dir` (as the servers resolve them)."""
    defaults = resolve_request_defaults(config, GenerationConfigFile.read(model_dir)).sampling
    max_tokens = {} if defaults.max_new_tokens is None else {"max_tokens": defaults.max_new_tokens}
    return SamplingParams(**defaults.sampling_fields(), **max_tokens)


def _priorities(priority: Sequence[int] | None, num_prompts: int) -> list[int]:
    """One priority per prompt (vLLM's LLM.generate `priority`); None: 0 for each. Each is checked by the engine."""
    if priority is None:
        return [0] * num_prompts
    if not isinstance(priority, list | tuple):
        raise InvalidRequestError("priority", f"must be a list of integers (one per prompt) or None, got "
                                              f"{type(priority).__name__}")
    if len(priority) != num_prompts:
        raise InvalidRequestError("priority", f"got {len(priority)} for {num_prompts} prompts")
    return list(priority)


def _broadcast_params(params: SamplingParams | Sequence[SamplingParams], count: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, list | tuple):  # each item is checked by LLM._tokenized
        raise InvalidRequestError("sampling_params", f"must be a SamplingParams, a list of them (one per prompt) "
                                                     f"or None, got {type(params).__name__}")
    params = list(params)
    if len(params) != count:
        raise InvalidRequestError("sampling_params", f"got {len(params)} for {count} prompts")
    return params


def _resolve_runner(task: str | None, engine_config: dict) -> None:
    """vLLM's older `task` as engine_config's runner ("embed": pooling), and a pooler_config dict as a PoolerConfig."""
    if task is not None:
        runners = {"embed": "pooling", "classify": "pooling", "score": "pooling", "generate": "generate"}
        if task not in runners:
            raise ValueError(f"task must be 'embed', 'classify', 'score' or 'generate' (vLLM's older spelling of "
                             f"runner), got {task!r}")
        if engine_config.get("runner", runners[task]) != runners[task]:
            raise ValueError(f"task={task!r} contradicts runner={engine_config['runner']!r}; pass one of them")
        engine_config["runner"] = runners[task]
    if isinstance(engine_config.get("pooler_config"), dict):
        engine_config["pooler_config"] = PoolerConfig(**engine_config["pooler_config"])


def _broadcast_pooling_params(params: PoolingParams | Sequence[PoolingParams] | None,
                              count: int) -> list[PoolingParams]:
    if params is None or isinstance(params, PoolingParams):
        return [params or PoolingParams()] * count
    if not isinstance(params, list | tuple):  # each item is checked by EngineCore.validate_pooling
        raise InvalidRequestError("pooling_params", f"must be a PoolingParams, a list of them (one per prompt) or "
                                                    f"None, got {type(params).__name__}")
    if len(params) != count:
        raise InvalidRequestError("pooling_params", f"got {len(params)} for {count} prompts")
    return list(params)


def _broadcast_lora_requests(lora_request: object, count: int) -> list[LoRARequest | None]:
    """vLLM's forms: None or one LoRARequest for every prompt, or a list (or tuple) of one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if not isinstance(lora_request, list | tuple):
        raise InvalidRequestError("lora_request", f"must be a LoRARequest, a list of them (one per prompt) or None, "
                                                  f"got {type(lora_request).__name__}")
    if len(lora_request) != count:
        raise InvalidRequestError("lora_request", f"got {len(lora_request)} for {count} prompts")
    for item in lora_request:
        check_lora_request(item)
    return list(lora_request)


def _refuse_given(name: str, value: object, reason: str) -> None:
    """vLLM arguments splitserve has no counterpart for: accepted as None (their default) only."""
    if value is not None:
        raise InvalidRequestError(name, f"{reason}; pass None (got {type(value).__name__})")


def _check_tools(tools: object) -> None:
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise InvalidRequestError("tools", f"must be a list of tool dicts (JSON schemas) or None, got {tools!r}")


def _check_template_kwargs(template_kwargs: object) -> None:
    if not isinstance(template_kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs", f"must be a dict of template variables or None, got "
                                                          f"{type(template_kwargs).__name__}")
    for key in template_kwargs:
        if not isinstance(key, str):
            raise InvalidRequestError("chat_template_kwargs", f"keys are template variable names (strings), got "
                                                              f"{key!r}")
    check_template_kwargs(template_kwargs, _RESERVED_TEMPLATE_KWARGS)


def _check_use_tqdm(use_tqdm: object) -> None:
    if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
        raise InvalidRequestError("use_tqdm", f"must be a bool or a callable making a tqdm, got {use_tqdm!r}")


def _progress_bar(use_tqdm: bool | Callable[..., tqdm], total: int) -> tqdm:
    """The bar a generate() call counts finished sequences on (vLLM's use_tqdm)."""
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="generate")
    return tqdm(total=total, disable=not use_tqdm, desc="generate")
