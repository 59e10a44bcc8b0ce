"""Per-request sampling parameters (torch-free; shared by router and engine)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, field, replace

from splitserve.common.errors import InvalidRequestError
from splitserve.common.structured_output import GuidedDecodingParams, StructuredOutput, StructuredOutputsParams

SEED_LOW = -2**63
SEED_SPAN = 2**64 + 2**63
"""SamplingParams.seed's range is [SEED_LOW, SEED_LOW + SEED_SPAN)."""
MAX_LOGPROBS = 20
"""vLLM's default --max-logprobs: the most top alternatives per token (logprobs, top_logprobs,
prompt_logprobs) a request may ask for, unless the server sets another limit (router.max_logprobs;
check_logprobs_limit). The offline LLM applies it."""
MAX_STOP_STRINGS = 64
"""Most stop strings per request: the router looks for each one in every new piece of output text,
on its event loop (a million of them, which fit in one 16 MiB request, took 0.4 s per token)."""
MAX_STOP_TOKEN_IDS = 1024
"""Most stop token ids per request: the engine checks every sampled token against them."""
MAX_LOGIT_BIAS = 1024
"""Most logit_bias entries per request: the sampler adds each one to the logits at every step."""
LOGIT_BIAS_RANGE = 100.0
"""A logit bias is in [-LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE] (OpenAI's range)."""
MAX_ALLOWED_TOKEN_IDS = 1 << 18
"""Most allowed_token_ids per request (above any served vocabulary): the sampler writes each into a
mask row at every step."""
MAX_BAD_WORDS = 128
"""Most token sequences bad_words may tokenize to (vLLM's VLLM_MAX_NUM_BAD_WORDS default): each is
matched against the tail of the output at every step."""
_NONE_IS_EMPTY = ("stop", "stop_token_ids", "bad_words", "logit_bias")
"""Fields whose None (vLLM's default for each) means none: a vLLM script's stop=None asks for no stop strings."""


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, message)


def _as_tuple(value: object, field_name: str) -> tuple:
    try:
        return tuple(value)
    except TypeError:
        raise InvalidRequestError(field_name, f"must be a list, got {value!r}") from None


def _logit_bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, bias) pairs ascending by id, from a mapping (keys: ints, or strings
    of ints as JSON sends them) or (id, bias) pairs; InvalidRequestError naming the keys that are no
    integers (vLLM's message)."""
    try:
        items = [(key, bias) for key, bias in (value.items() if isinstance(value, Mapping) else value)]
    except (TypeError, ValueError):
        raise InvalidRequestError("logit_bias", f"must map token ids to biases, got {value!r}") from None
    invalid = [key for key, _ in items if _token_id_key(key) is None]
    _require(not invalid, "logit_bias", f"contains key(s) that cannot be converted to integer token IDs: "
                                        f"{invalid[:5]!r}")
    return tuple(sorted({_token_id_key(key): bias for key, bias in items}.items()))


def _distinct_strings(values: tuple) -> tuple:
    """values without repeats (first kept, as vLLM dedups bad_words) when all are strings; else as
    they are, for validation to refuse."""
    return tuple(dict.fromkeys(values)) if all(isinstance(v, str) for v in values) else values


def _token_id_key(key: object) -> int | None:
    """A logit_bias key as a token id: an int, or a string int() reads ("42", as JSON keys are; as
    vLLM converts them). A string int() refuses ("+-5", more digits than Python converts) is none."""
    if _is_int(key):
        return key
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            return None
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """A finite number (not a bool); an int too large for a float (JSON allows any) is not one."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. Validated on construction."""

    temperature: float = 1.0
    """0 means greedy (argmax); otherwise logits are divided by it. Must be finite and >= 0."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 or 0 disables."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability mass reaches top_p; in (0, 1]."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's; in [0, 1]."""
    repetition_penalty: float = 1.0
    """> 0; tokens already in prompt or output get positive logits divided, negative multiplied."""
    frequency_penalty: float = 0.0
    """In [-2, 2]; subtracted from a token's logit once per occurrence in the output."""
    presence_penalty: float = 0.0
    """In [-2, 2]; subtracted from a token's logit if it occurs in the output at all."""
    seed: int | None = None
    """Per-request RNG seed: same seed, same output, whatever else is in the batch. In [-2**63, 2**64)."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; the output text is cut before the first match. At most
    MAX_STOP_STRINGS."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (in addition to EOS unless ignore_eos). At most MAX_STOP_TOKEN_IDS."""
    max_tokens: int | None = 16
    """Maximum number of generated tokens, >= 1. None (vLLM's): up to the end of the context, which only the
    offline LLM knows per prompt: it replaces None with max_model_len - prompt length before the request is
    queued (resolved_max_tokens), so the engine, the wire and the router never see None (EngineCore.validate
    refuses it)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS token(s)."""
    logprobs: int | None = None
    """If set, return the sampled token's logprob plus this many top alternatives (0..20)."""
    skip_special_tokens: bool = field(default=True)
    """Leave special tokens out of the detokenized text."""
    min_tokens: int = 0
    """Generate at least this many tokens (<= max_tokens) before EOS, a stop token or a stop
    string may end the request: until then EOS and stop_token_ids cannot be sampled and stop
    strings are not looked for (vLLM's min_tokens)."""
    structured_output: StructuredOutput | None = None
    """Constrain the output to a grammar (JSON schema, regex, choice, Lark): the engine masks every
    token the grammar cannot take and ends the request when the grammar is complete."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs, ascending by id: each bias (in [-100, 100]) is added to its token's
    logit before penalties and sampling (OpenAI's logit_bias). A mapping (JSON's string keys
    included) is accepted and normalized; at most MAX_LOGIT_BIAS entries."""
    allowed_token_ids: tuple[int, ...] | None = None
    """If set (non-empty), only these token ids may be sampled (vLLM's allowed_token_ids)."""
    bad_words: tuple[str, ...] = ()
    """Words that may not be generated (vLLM's bad_words): see bad_words_token_ids."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """bad_words tokenized (with_bad_words_tokenized, by whoever holds the tokenizer: the router, the
    offline LLM): the last token of each sequence is banned whenever the output ends with the
    sequence's other tokens. The engine reads only this."""
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended the output in its text (vLLM's include_stop_str_in_output)."""
    prompt_logprobs: int | None = None
    """If set, also return each prompt token's logprob given the tokens before it plus this many top
    alternatives (0..20; the first prompt token has none), with the request's first output (vLLM's
    prompt_logprobs). Such a request never reads the prefix cache: every prompt position is computed."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: keep only the prompt's last k tokens (k >= 1; -1: as many as the context can hold), cut by the
    offline LLM after tokenizing, before the request is queued (common.prompt_truncation's rule, the router's
    too); None: no truncation. Never read by the engine."""
    detokenize: bool = True
    """vLLM's: False leaves the offline LLM's output text empty (token ids only); stop strings need text,
    so they are refused with it, as vLLM refuses them. The engine and the servers always produce text."""
    n: int = 1
    """Output sequences per prompt (vLLM's n), >= 1. The engine runs one sequence per request, so n fans
    out above it: the offline LLM runs sequence i as a request of its own with for_sequence(i) and returns
    the n as one RequestOutput's outputs (the OpenAI API reads its own `n`: router/fanout.py)."""
    structured_outputs: InitVar[StructuredOutputsParams | None] = None
    """vLLM's spelling of structured_output (a StructuredOutputsParams), for vLLM scripts: turned into
    structured_output on construction (so it reads None afterwards and is no field of the wire)."""
    guided_decoding: InitVar[GuidedDecodingParams | None] = None
    """vLLM's spelling before 0.10 (a GuidedDecodingParams), as structured_outputs."""
    spaces_between_special_tokens: InitVar[bool] = True
    """vLLM's: True only (its default), as the HTTP API accepts it: the fast tokenizers splitserve decodes with
    have no such option; False is refused rather than ignored."""

    def __post_init__(self, structured_outputs: StructuredOutputsParams | None = None,
                      guided_decoding: GuidedDecodingParams | None = None,
                      spaces_between_special_tokens: bool = True) -> None:
        _require(spaces_between_special_tokens is True, "spaces_between_special_tokens",
                 f"only True is supported (splitserve decodes with fast tokenizers, which have no such option), "
                 f"got {spaces_between_special_tokens!r}")
        self._take_vllm_structured_outputs(structured_outputs, guided_decoding)
        for name in _NONE_IS_EMPTY:
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else _as_tuple(self.stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _as_tuple(self.allowed_token_ids, "allowed_token_ids"))
        object.__setattr__(self, "bad_words", _distinct_strings(_as_tuple(self.bad_words, "bad_words")))
        object.__setattr__(self, "bad_words_token_ids", tuple(
            _as_tuple(ids, "bad_words") for ids in _as_tuple(self.bad_words_token_ids, "bad_words")))
        self._validate_sampling()
        self._validate_logit_controls()
        self._validate_stopping()

    def _take_vllm_structured_outputs(self, structured_outputs: object, guided_decoding: object) -> None:
        """structured_output from vLLM's structured_outputs or guided_decoding, at most one of the three given."""
        given = {name: value for name, value in (("structured_output", self.structured_output),
                                                 ("structured_outputs", structured_outputs),
                                                 ("guided_decoding", guided_decoding)) if value is not None}
        if len(given) > 1:
            raise InvalidRequestError(list(given)[-1], f"only one of structured_output, structured_outputs and "
                                                       f"guided_decoding may be set, got {', '.join(given)}")
        for name, value in given.items():
            if name != "structured_output":
                _require(isinstance(value, StructuredOutputsParams), name,
                         f"must be a StructuredOutputsParams, got {type(value).__name__}")
                object.__setattr__(self, "structured_output", value.constraint())

    def _validate_sampling(self) -> None:
        _require(_is_real(self.temperature) and self.temperature >= 0, "temperature",
                 f"must be a finite number >= 0, got {self.temperature!r}")
        _require(_is_int(self.top_k) and self.top_k >= -1, "top_k", f"must be -1, 0 or >= 1, got {self.top_k!r}")
        _require(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _require(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _require(_is_real(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
                 f"must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _require(_is_real(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        _require(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _require(self.seed is None or (_is_int(self.seed) and SEED_LOW <= self.seed < SEED_LOW + SEED_SPAN), "seed",
                 f"must be an integer in [-2**63, 2**64), got {self.seed!r}")
        # How many is the server's limit (check_logprobs_limit), not the parameters' own.
        _require(self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
                 "logprobs", f"must be an integer >= 0, got {self.logprobs!r}")
        _require(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
                 "prompt_logprobs", f"must be an integer >= 0, got {self.prompt_logprobs!r}")
        _require(self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
                 "structured_output", f"must be a StructuredOutput, got {type(self.structured_output).__name__}")

    def _validate_logit_controls(self) -> None:
        _require(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
                 f"must hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        bad = [bias for _, bias in self.logit_bias if not (_is_real(bias) and abs(bias) <= LOGIT_BIAS_RANGE)]
        _require(not bad, "logit_bias", f"biases must be numbers in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], "
                                        f"got {bad[:5]!r}")
        allowed = self.allowed_token_ids
        _require(allowed is None or len(allowed) > 0, "allowed_token_ids", "must not be empty (leave it out to allow "
                                                                           "every token)")
        _require(allowed is None or len(allowed) <= MAX_ALLOWED_TOKEN_IDS, "allowed_token_ids",
                 f"must hold at most {MAX_ALLOWED_TOKEN_IDS} ids, got {len(allowed or ())}")
        _require(allowed is None or all(_is_int(t) for t in allowed), "allowed_token_ids", "must be integers")
        _require(all(isinstance(w, str) and w for w in self.bad_words), "bad_words", "must be non-empty strings")
        _require(len(self.bad_words_token_ids) <= MAX_BAD_WORDS, "bad_words",
                 f"tokenize to {len(self.bad_words_token_ids)} token sequences; at most {MAX_BAD_WORDS}")
        _require(all(ids and all(_is_int(t) for t in ids) for ids in self.bad_words_token_ids), "bad_words",
                 "token sequences must be non-empty lists of integers")

    def check_logprobs_limit(self, max_logprobs: int, vocab_size: int) -> None:
        """InvalidRequestError (vLLM's message) when logprobs or prompt_logprobs ask for more top
        alternatives than `max_logprobs` (--max-logprobs; -1: the vocabulary's size, which bounds
        every engine's). The router checks the server's limit, the engine the vocabulary."""
        limit = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
        for name, kind, wanted in (("logprobs", "sample", self.logprobs), ("prompt_logprobs", "prompt",
                                                                            self.prompt_logprobs)):
            _require(not wanted or wanted <= limit, name,
                     f"Requested {kind} logprobs of {wanted}, which is greater than max allowed: {limit}")

    def check_logit_control_vocabulary(self, vocab_size: int) -> None:
        """InvalidRequestError (vLLM's message) for a logit_bias, allowed_token_ids or bad-word token id
        outside [0, vocab_size): the router and the engine both check, so every API refuses the
        same requests."""
        named = {"logit_bias": [t for t, _ in self.logit_bias], "allowed_token_ids": self.allowed_token_ids or (),
                 "bad_words": [t for ids in self.bad_words_token_ids for t in ids]}
        for name, token_ids in named.items():
            outside = [t for t in token_ids if not 0 <= t < vocab_size]
            _require(not outside, name, f"token_id(s) {outside[:5]} in {name} contain out-of-vocab token ids. "
                                        f"Vocabulary size: {vocab_size}")

    @property
    def has_logit_controls(self) -> bool:
        """Whether the sampler changes this request's logits beyond penalties and filters."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    def for_sequence(self, index: int) -> SamplingParams:
        """Sequence `index` of a prompt sampled several times, as one sequence (n=1): seeded with seed + index
        (wrapped into the seed's range) when these params are seeded, as vLLM's parallel sampling; unseeded
        sequences draw independently."""
        if self.seed is None or index == 0:
            return self if self.n == 1 else replace(self, n=1)
        return replace(self, n=1, seed=(self.seed + index - SEED_LOW) % SEED_SPAN + SEED_LOW)

    def with_bad_words_tokenized(self, encode: Callable[[str], list[int]]) -> SamplingParams:
        """These params with bad_words_token_ids filled from bad_words by `encode` (text -> token ids,
        no special tokens), as vLLM does: each word as is (left-stripped) and after a space (a word
        in mid-text), the spaced form kept only when it is another token sequence of the same length."""
        sequences: list[tuple[int, ...]] = []
        for word in self.bad_words:
            bare = tuple(encode(word.lstrip()))
            _require(bool(bare), "bad_words", f"entries must tokenize to at least one token, got {word!r}")
            sequences.append(bare)
            spaced = tuple(encode(" " + word.lstrip()))
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        return replace(self, bad_words_token_ids=tuple(sequences))

    def _validate_stopping(self) -> None:
        _require(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
                 f"must be an integer >= 1, got {self.max_tokens!r}")
        most = math.inf if self.max_tokens is None else self.max_tokens
        _require(_is_int(self.min_tokens) and 0 <= self.min_tokens <= most, "min_tokens",
                 f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _require(self.truncate_prompt_tokens is None or (_is_int(self.truncate_prompt_tokens) and (
            self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)), "truncate_prompt_tokens",
                 f"must be an integer >= 1 or -1, got {self.truncate_prompt_tokens!r}")
        _require(isinstance(self.detokenize, bool), "detokenize", f"must be a boolean, got {self.detokenize!r}")
        _require(self.detokenize or not self.stop, "stop",
                 "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _require(len(self.stop) <= MAX_STOP_STRINGS, "stop",
                 f"must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        _require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 "must be non-negative integers")
        _require(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
                 f"must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")

    def resolved_max_tokens(self, room: int) -> SamplingParams:
        """These params with max_tokens None (to the end of the context) as `room`, the output tokens the
        context leaves the prompt (at least min_tokens, which the context's end overrides in the engine as it
        overrides any max_tokens); as they are otherwise."""
        return self if self.max_tokens is not None else replace(self, max_tokens=max(room, self.min_tokens))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def may_stop(self, num_output_tokens: int) -> bool:
        """Whether EOS, a stop token or a stop string may end the output once it has this many tokens."""
        return num_output_tokens >= self.min_tokens

    @property
    def effective_top_k(self) -> int:
        """top_k with both disabled spellings normalized to 0."""
        return max(self.top_k, 0)
