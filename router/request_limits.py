"""The limits every public API holds a request to (gRPC Generation, Triton, OpenAI HTTP): one table,
`RequestLimits`, and the checks that apply it. Each raises InvalidRequestError naming the field
(INVALID_ARGUMENT / HTTP 400), so the three APIs refuse the same requests for the same reasons.

Every API applies them in the same order, cheapest first and each before the work it protects:
admission (Orchestrator.admit, O(1), before the request is parsed or tokenized), then
while parsing the sizes and values checked here (linear in what the client sent, never in
tokens), then tokenization in a bounded pool (router/tokenizer_pool.py, which also checks a
rendered chat's size before encoding it). A max_tokens longer than what the prompt leaves of the
context is served, as vLLM serves it: generation ends at the end of the context (finish reason length).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from splitserve.common.errors import ContextLengthExceededError, InvalidRequestError
from splitserve.common.log_escape import quote_for_log
from splitserve.common.prompt_truncation import PromptTruncation, check_prompt_length, prompt_truncation
from splitserve.common.beam_search import BeamSearchParams
from splitserve.common.sampling_params import (MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_LOGPROBS,
                                               MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams)
from splitserve.common.validation import require

REQUEST_ID_CHARS = frozenset(map(chr, range(0x21, 0x7F)))
"""Printable ASCII without the space: an id is one word of a log line and can never break one."""
MAX_TEMPERATURE = 2.0
"""The hottest temperature a served request may ask for: OpenAI's bound, which vLLM holds every request to
(SamplingParams itself takes any temperature >= 0: the engine and its offline LLM sample at any)."""
QUOTED_CHARS = 64
"""Characters of a client's value an error message quotes."""
MAX_SEQUENCES = 128
"""Most sequences one request may ask for (prompts x best_of, or n): each is a request of the
cluster's own, so an unbounded fan-out would let one client flood it."""
MAX_BODY_BYTES = 16 << 20
"""Largest HTTP body or gRPC message accepted whatever the model (the gRPC server's message limit)."""
JSON_BYTES_PER_STRING_BYTE = 6
"""The most bytes a JSON string spends on one UTF-8 byte of its value: a control character is
written \\u0001 (6 for 1); other characters take at most 12 bytes for 4 (a surrogate pair)."""
JSON_BYTES_PER_MESSAGE = 256
"""A chat message's JSON besides its content: braces, keys, the role, whitespace."""
BODY_ALLOWANCE_BYTES = 1 << 20
"""What a request body may hold besides its prompts or messages: the other fields, stop strings,
a JSON schema or grammar, whitespace."""


def prompt_bytes_bound(max_model_len: int, max_bytes_per_token: int) -> int:
    """The most UTF-8 bytes a servable prompt can have.

    A servable prompt has at most max_model_len - 1 tokens (one output token must fit), and no
    token stands for more than max_bytes_per_token bytes of it (RouterTokenizer.max_bytes_per_token;
    special tokens a tokenizer adds stand for none). So a prompt longer than
    (max_model_len - 1) * max_bytes_per_token bytes has at least max_model_len tokens: it is
    refused by its size alone, without tokenizing it."""
    return (max_model_len - 1) * max_bytes_per_token


def utf8_length(text: str) -> int:
    """UTF-8 bytes of text (a lone surrogate, refused later, counts as 3)."""
    return len(text.encode("utf-8", "surrogatepass"))


class ChatMessageLike(Protocol):
    """A chat message as each API parses it (a proto ChatMessage, the OpenAI API's ChatMessage)."""

    role: str
    content: str


@dataclass(frozen=True)
class RequestLimits:
    """Every size a request may have, for the model being served."""

    max_model_len: int
    """Prompt tokens + output tokens of one request (the smallest of the workers'): a prompt has
    at most max_model_len - 1 tokens, and a max_tokens the client sets must fit after its prompt
    (one that is left out runs to the end of the context at most)."""
    vocab_size: int
    """Token ids a request names (prompt token ids, stop_token_ids) are below this."""
    max_prompt_bytes: int
    """UTF-8 bytes of a text prompt, of a chat's message contents together, and of the chat as the
    template renders it; checked before tokenizing. Default: prompt_bytes_bound, which refuses
    only prompts that are over max_model_len tokens anyway (router.max_prompt_bytes sets it)."""
    max_chat_messages: int = 1024
    """Messages of one chat request (bounds the chat template's work per request)."""
    max_stop_strings: int = MAX_STOP_STRINGS
    """Stop strings of one request: each is searched in every new piece of output text."""
    max_stop_string_chars: int = 1024
    """Characters of one stop string: the stream holds back this many characters minus one, and
    each search rescans as many."""
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS
    """Stop token ids of one request: the engine checks each sampled token against them."""
    max_logit_bias: int = MAX_LOGIT_BIAS
    """logit_bias entries of one request: each is added to the logits at every step."""
    max_allowed_token_ids: int = MAX_ALLOWED_TOKEN_IDS
    """allowed_token_ids of one request: each is written into a mask row at every step."""
    max_bad_words: int = MAX_BAD_WORDS
    """bad_words strings of one request, checked before they are tokenized (each gives one or two
    token sequences, MAX_BAD_WORDS of them at most, matched against the output at every step)."""
    max_bad_word_chars: int = 1024
    """Characters of one bad word (it is tokenized twice per request)."""
    max_request_id_chars: int = 256
    """Characters of a client's request id (REQUEST_ID_CHARS only); it appears in every log line
    about the request."""
    max_tools: int = 128
    """Tools (function definitions) of one chat request (OpenAI's limit): each is rendered into the
    prompt, and `tool_choice: "required"` compiles a grammar over all of them."""
    max_logprobs: int = MAX_LOGPROBS
    """Top alternatives per token a request may ask for (logprobs, top_logprobs, prompt_logprobs; a beam
    search's 2 x n), vLLM's --max-logprobs (router.max_logprobs); -1: the vocabulary's size."""
    max_tools_bytes: int = 1 << 19
    """Bytes of a chat request's tools together, as compact JSON: part of the body's allowance for
    fields besides the messages (BODY_ALLOWANCE_BYTES), and of the grammar a forced tool choice compiles."""

    def __post_init__(self) -> None:
        require(self.max_logprobs >= -1, f"max_logprobs must be >= -1, got {self.max_logprobs}")
        for name in ("max_model_len", "vocab_size", "max_prompt_bytes", "max_chat_messages", "max_stop_string_chars",
                     "max_request_id_chars", "max_tools", "max_tools_bytes", "max_bad_word_chars"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name, bound in (("max_logit_bias", MAX_LOGIT_BIAS), ("max_allowed_token_ids", MAX_ALLOWED_TOKEN_IDS),
                            ("max_bad_words", MAX_BAD_WORDS)):
            require(0 <= getattr(self, name) <= bound, f"{name} must be in [0, {bound}] (SamplingParams' own limit), "
                                                       f"got {getattr(self, name)}")
        require(0 <= self.max_stop_strings <= MAX_STOP_STRINGS,
                f"max_stop_strings must be in [0, {MAX_STOP_STRINGS}] (SamplingParams' own limit), "
                f"got {self.max_stop_strings}")
        require(0 <= self.max_stop_token_ids <= MAX_STOP_TOKEN_IDS,
                f"max_stop_token_ids must be in [0, {MAX_STOP_TOKEN_IDS}] (SamplingParams' own limit), "
                f"got {self.max_stop_token_ids}")

    @classmethod
    def for_model(cls, max_model_len: int, vocab_size: int, max_bytes_per_token: int,
                  max_prompt_bytes: int | None = None, max_logprobs: int = MAX_LOGPROBS) -> RequestLimits:
        """The limits for a served model; `max_prompt_bytes` None derives it (prompt_bytes_bound)."""
        if max_prompt_bytes is None:
            max_prompt_bytes = prompt_bytes_bound(max_model_len, max_bytes_per_token)
        return cls(max_model_len, vocab_size, max_prompt_bytes, max_logprobs=max_logprobs)

    def check_logprobs(self, params: SamplingParams, beam_search: BeamSearchParams | None = None) -> None:
        """A request's logprobs (and a beam search's width) within max_logprobs (vLLM's messages)."""
        params.check_logprobs_limit(self.max_logprobs, self.vocab_size)
        if beam_search is not None:
            beam_search.check_logprobs_limit(self.max_logprobs, self.vocab_size)

    @property
    def max_body_bytes(self) -> int:
        """The largest HTTP body a servable request can have, so a larger one is refused (413)
        before it is read: BODY_ALLOWANCE_BYTES and the largest of MAX_SEQUENCES text prompts of
        max_prompt_bytes each (escaped as JSON), MAX_SEQUENCES prompts of max_model_len - 1 token
        ids, and a chat whose contents hold max_prompt_bytes; at most MAX_BODY_BYTES."""
        text_prompts = MAX_SEQUENCES * (JSON_BYTES_PER_STRING_BYTE * self.max_prompt_bytes + 4)
        token_id_bytes = len(str(self.vocab_size - 1)) + 8  # ", " and a pretty-printer's newline and indent
        token_prompts = MAX_SEQUENCES * ((self.max_model_len - 1) * token_id_bytes + 4)
        chat = JSON_BYTES_PER_STRING_BYTE * self.max_prompt_bytes + self.max_chat_messages * JSON_BYTES_PER_MESSAGE
        return min(MAX_BODY_BYTES, BODY_ALLOWANCE_BYTES + max(text_prompts, token_prompts, chat))

    # ---- the request's identity ------------------------------------------------------------
    def check_request_id(self, request_id: str, field: str) -> None:
        """A client's id (empty: the router makes one): at most max_request_id_chars of REQUEST_ID_CHARS."""
        if len(request_id) > self.max_request_id_chars:
            raise InvalidRequestError(field, f"must be at most {self.max_request_id_chars} characters, got "
                                             f"{len(request_id)}")
        if not REQUEST_ID_CHARS.issuperset(request_id):
            raise InvalidRequestError(field, "must be printable ASCII without spaces (0x21-0x7E), got "
                                             f"{quote_for_log(request_id, QUOTED_CHARS)}")

    # ---- the prompt ------------------------------------------------------------------------
    def check_prompt_bytes(self, num_bytes: int, field: str) -> None:
        if num_bytes > self.max_prompt_bytes:
            raise ContextLengthExceededError(field, f"has {num_bytes} bytes (UTF-8); at most {self.max_prompt_bytes} "
                                                    "can be served (router.max_prompt_bytes)", self.max_model_len)

    def check_prompt_token_count(self, num_tokens: int, field: str) -> None:
        """A prompt given as token ids, before its ids are read (Orchestrator.validate_prompt checks them)."""
        check_prompt_length(num_tokens, self.max_model_len, field)

    def prompt_truncation(self, num_tokens: int | None, side: str | None, *,
                          pools: bool = False) -> PromptTruncation | None:
        """A request's truncate_prompt_tokens and truncation_side (None: unset) for this model
        (common.prompt_truncation's rules; `pools`: a pooling request's)."""
        return prompt_truncation(num_tokens, side, self.max_model_len, pools=pools)

    def check_message_count(self, num_messages: int) -> None:
        """Before the messages are read."""
        if num_messages > self.max_chat_messages:
            raise InvalidRequestError("messages", f"holds {num_messages} messages; at most {self.max_chat_messages}")

    def check_chat(self, messages: Sequence[ChatMessageLike]) -> None:
        """Count, and the contents' bytes together (a long role is bounded by the rendered chat's limit).
        Any role is served, as vLLM serves one its message model does not name (a template's own roles:
        Llama 3.1's `ipython`, GLM's `observation`): the template decides what it renders."""
        self.check_message_count(len(messages))
        self.check_prompt_bytes(sum(utf8_length(m.content) for m in messages), "messages")

    # ---- tools ---------------------------------------------------------------------------------
    def check_tools(self, num_tools: int, num_bytes: int) -> None:
        """A chat request's tools: their count, and their size as compact JSON (checked before each is read)."""
        if num_tools > self.max_tools:
            raise InvalidRequestError("tools", f"holds {num_tools} tools; at most {self.max_tools}")
        if num_bytes > self.max_tools_bytes:
            raise InvalidRequestError("tools", f"has {num_bytes} bytes as compact JSON; at most {self.max_tools_bytes}")

    # ---- sampling and output length ----------------------------------------------------------
    def check_sampling(self, params: SamplingParams, max_tokens_field: str | None) -> None:
        """The temperature's range, stop strings and ids, and a max_tokens the client set (`max_tokens_field`:
        the field that set it, None when defaulted) that no prompt could leave room for."""
        if params.temperature > MAX_TEMPERATURE:
            raise InvalidRequestError("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {params.temperature}")
        if len(params.stop) > self.max_stop_strings:
            raise InvalidRequestError("stop", f"must hold at most {self.max_stop_strings} strings, got "
                                              f"{len(params.stop)}")
        longest = max((len(stop) for stop in params.stop), default=0)
        if longest > self.max_stop_string_chars:
            raise InvalidRequestError("stop", f"each must be at most {self.max_stop_string_chars} characters, got "
                                              f"one of {longest}")
        if len(params.stop_token_ids) > self.max_stop_token_ids:
            raise InvalidRequestError("stop_token_ids", f"must hold at most {self.max_stop_token_ids} ids, got "
                                                        f"{len(params.stop_token_ids)}")
        outside = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if outside:
            raise InvalidRequestError("stop_token_ids", f"must be below the vocabulary size {self.vocab_size}, got "
                                                        f"{outside[:5]}")
        self._check_logit_controls(params)
        if max_tokens_field is not None and params.max_tokens > self.max_model_len:
            raise InvalidRequestError(max_tokens_field, f"must be at most max_model_len {self.max_model_len}, got "
                                                        f"{params.max_tokens}")

    def _check_logit_controls(self, params: SamplingParams) -> None:
        """Sizes of logit_bias, allowed_token_ids and bad_words, and the ids' vocabulary (bad words'
        ids once tokenized: TokenizerPool.tokenize_bad_words checks them again)."""
        allowed = params.allowed_token_ids or ()
        for name, count, bound in (("logit_bias", len(params.logit_bias), self.max_logit_bias),
                                   ("allowed_token_ids", len(allowed), self.max_allowed_token_ids),
                                   ("bad_words", len(params.bad_words), self.max_bad_words)):
            if count > bound:
                raise InvalidRequestError(name, f"must hold at most {bound} entries, got {count}")
        longest = max((len(word) for word in params.bad_words), default=0)
        if longest > self.max_bad_word_chars:
            raise InvalidRequestError("bad_words", f"each must be at most {self.max_bad_word_chars} characters, got "
                                                   f"one of {longest}")
        params.check_logit_control_vocabulary(self.vocab_size)

