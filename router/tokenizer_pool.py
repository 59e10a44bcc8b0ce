"""Tokenization for the router's APIs: small prompts on the event loop, the rest in a few threads,
with admission on that pool.

`RouterTokenizer` encodes with `encode_batch`, which releases the GIL, so a long prompt encoded in
a thread leaves the event loop free (a process pool would only add a copy of the prompt).
Rendering a chat template is Python (jinja2) and holds the GIL, but its input is bounded by
RequestLimits (message count and bytes). A prompt that is provably over max_model_len never
gets here (RequestLimits.check_prompt_bytes), and a rendered chat is checked the same way
before it is encoded.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import MAX_LOGPROBS, SamplingParams
from splitserve.router.api_types import RouterError
from splitserve.router.orchestrator import Orchestrator
from splitserve.router.request_limits import RequestLimits, utf8_length
from splitserve.router.tokenizer import DEFAULT_CHAT_OPTIONS, ChatTemplateOptions, RouterTokenizer

T = TypeVar("T")
INLINE_MAX_CHARS = 1024
"""A prompt (or a chat's contents together) of at most this many characters is tokenized on the
event loop: it takes well under a millisecond, less than the trip to a thread and back."""
INLINE_MAX_MESSAGES = 16
"""A chat of more messages goes to the pool whatever its size (each costs template work)."""
BUSY_REASON = "tokenizer_busy"
"""The admission rejection reason of a request refused because the pool is full."""


class TokenizerPool:
    """One tokenizer, the limits it tokenizes within, and the threads it runs in; shared by every
    API of a router, so its admission bounds the router's tokenization work as a whole."""

    def __init__(self, tokenizer: RouterTokenizer, limits: RequestLimits, count_rejection: Callable[[str], None],
                 num_threads: int = 2, max_pending: int = 64) -> None:
        """`count_rejection(reason)` notes a request refused for a full pool (Orchestrator.count_rejection);
        `max_pending`: prompts queued or being tokenized in the threads, beyond which a request that
        needs the pool is refused with RESOURCE_EXHAUSTED."""
        self.tokenizer = tokenizer
        self.limits = limits
        self._count_rejection = count_rejection
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="splitserve-tokenize")
        self._max_pending = max_pending
        self._pending = 0
        """Jobs submitted and not finished (cancelled while queued counts as finished); guarded by _lock."""
        self._lock = threading.Lock()

    @classmethod
    def for_orchestrator(cls, tokenizer: RouterTokenizer, orchestrator: Orchestrator,
                         max_prompt_bytes: int | None = None, num_threads: int = 2,
                         max_pending: int = 64, max_logprobs: int = MAX_LOGPROBS) -> TokenizerPool:
        """The pool an orchestrator's APIs share, with the limits of the model its workers serve
        (call after Orchestrator.start); `max_prompt_bytes` None derives it (RequestLimits.for_model);
        `max_logprobs`: --max-logprobs."""
        limits = RequestLimits.for_model(orchestrator.max_model_len, orchestrator.vocab_size,
                                         tokenizer.max_bytes_per_token, max_prompt_bytes, max_logprobs)
        return cls(tokenizer, limits, orchestrator.count_rejection, num_threads, max_pending)

    async def encode(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        """Token ids of a text prompt, with the tokenizer's special tokens (a BOS) unless told not
        to (InvalidRequestError `prompt` if it is not valid Unicode)."""
        if len(text) <= INLINE_MAX_CHARS:
            return tuple(self.tokenizer.encode(text, add_special_tokens))
        return tuple(await self._in_thread(self.tokenizer.encode, text, add_special_tokens))

    async def encode_pair(self, text: str, text_pair: str) -> tuple[int, ...]:
        """A cross-encoder's prompt: the pair's token ids (RouterTokenizer.encode_pair), in the pool when long."""
        if len(text) + len(text_pair) <= INLINE_MAX_CHARS:
            return tuple(self.tokenizer.encode_pair(text, text_pair))
        return tuple(await self._in_thread(self.tokenizer.encode_pair, text, text_pair))

    async def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                                  options: ChatTemplateOptions = DEFAULT_CHAT_OPTIONS) -> tuple[int, ...]:
        """Token ids of the rendered chat; InvalidRequestError `messages` when the rendered prompt is
        over RequestLimits.max_prompt_bytes (found before encoding it). A request's own template is
        compiled in the threads the first time it is seen (RouterTokenizer.compiles_template)."""
        size = _render_size(messages, options)
        compiles = self.tokenizer.compiles_template(options)  # a request's own template, seen first
        if size <= INLINE_MAX_CHARS and len(messages) <= INLINE_MAX_MESSAGES and not compiles:
            return tuple(self._chat(messages, add_generation_prompt, options))
        return tuple(await self._in_thread(self._chat, messages, add_generation_prompt, options))

    async def tokenize_bad_words(self, params: SamplingParams) -> SamplingParams:
        """params with its bad_words tokenized (SamplingParams.with_bad_words_tokenized: each word
        encoded twice) and their ids checked against the vocabulary; params itself when it has none.
        Words of at most INLINE_MAX_CHARS characters together are tokenized on the event loop, more
        in the pool, as a prompt is (check_sampling bounds them: 128 words of 1024 characters)."""
        if not params.bad_words:
            return params
        if sum(len(word) for word in params.bad_words) <= INLINE_MAX_CHARS:
            return self._bad_words_tokenized(params)
        return await self._in_thread(self._bad_words_tokenized, params)

    def _bad_words_tokenized(self, params: SamplingParams) -> SamplingParams:
        try:
            tokenized = params.with_bad_words_tokenized(lambda word: self.tokenizer.encode(word, False))
        except InvalidRequestError as error:
            if error.field == "bad_words":
                raise
            raise InvalidRequestError("bad_words", error.message) from None  # not valid Unicode
        tokenized.check_logit_control_vocabulary(self.limits.vocab_size)
        return tokenized

    def close(self) -> None:
        """Drop queued jobs and let running ones end on their own (no new jobs afterwards)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
              options: ChatTemplateOptions) -> list[int]:
        text = self.tokenizer.render_chat_template(messages, add_generation_prompt, options)
        self.limits.check_prompt_bytes(utf8_length(text), "messages")
        return self.tokenizer.encode(text, add_special_tokens=True) if options.add_special_tokens \
            else self.tokenizer.encode_rendered(text)

    async def _in_thread(self, work: Callable[..., T], *args: object) -> T:
        if not self._reserve():
            self._count_rejection(BUSY_REASON)
            raise RouterError("RESOURCE_EXHAUSTED", f"the router has {self._max_pending} prompts waiting to be "
                                                    "tokenized, its limit (router.max_pending_tokenizations); "
                                                    "retry later")
        job = self._executor.submit(work, *args)
        job.add_done_callback(self._release)  # in the thread that ran it, or here if cancelled while queued
        # Cancelling this await (the client went away) cancels a job still queued; a running one ends.
        return await asyncio.wrap_future(job)

    def _reserve(self) -> bool:
        with self._lock:
            if self._pending >= self._max_pending:
                return False
            self._pending += 1
            return True

    def _release(self, _job: object) -> None:
        with self._lock:
            self._pending -= 1


def _render_size(messages: Sequence[Mapping[str, Any]], options: ChatTemplateOptions) -> int:
    """Characters of what a chat's template renders: the contents, an assistant's reasoning (under
    two names, rendered by templates that show earlier reasoning: counted once), the tools and tool
    calls (as JSON), which templates write into the prompt, and a request's own template's text."""
    size = sum(len(message["content"]) + len(message.get("reasoning") or "") for message in messages)
    calls = [message["tool_calls"] for message in messages if message.get("tool_calls")]
    if calls:
        size += len(json.dumps(calls, default=str))
    size += len(options.chat_template or "")
    return size + (len(json.dumps(options.tools, default=str)) if options.tools else 0)
