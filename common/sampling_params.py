"""Per-request sampling parameters (torch-free; shared by router and engine)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from splitserve.common.errors import InvalidRequestError
from splitserve.common.structured_output import StructuredOutput

MAX_LOGPROBS = 20
"""Largest number of top alternatives a request may ask for per token."""
MAX_STOP_STRINGS = 64
"""Most stop strings per request: the router looks for each one in every new piece of output text,
on its event loop (a million of them, which fit in one 16 MiB request, took 0.4 s per token)."""
MAX_STOP_TOKEN_IDS = 1024
"""Most stop token ids per request: the engine checks every sampled token against them."""


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, message)


def _as_tuple(value: object, field_name: str) -> tuple:
    try:
        return tuple(value)
    except TypeError:
        raise InvalidRequestError(field_name, f"must be a list, got {value!r}") from None


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
    max_tokens: int = 16
    """Maximum number of generated tokens, >= 1."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS token(s)."""
    logprobs: int | None = None
    """If set, return the sampled token's logprob plus this many top alternatives (0..20)."""
    prompt_logprobs: int | None = None
    """If set, also return each prompt token's logprob given the tokens before it plus this many top
    alternatives (0..20; the first prompt token has none), with the request's first output (vLLM's
    prompt_logprobs). Such a request never reads the prefix cache: every prompt position is computed."""
    skip_special_tokens: bool = field(default=True)
    """Leave special tokens out of the detokenized text."""
    min_tokens: int = 0
    """Generate at least this many tokens (<= max_tokens) before EOS, a stop token or a stop
    string may end the request: until then EOS and stop_token_ids cannot be sampled and stop
    strings are not looked for (vLLM's min_tokens)."""
    structured_output: StructuredOutput | None = None
    """Constrain the output to a grammar (JSON schema, regex, choice, Lark): the engine masks every
    token the grammar cannot take and ends the request when the grammar is complete."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else _as_tuple(self.stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        self._validate_sampling()
        self._validate_stopping()

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
        _require(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**64), "seed",
                 f"must be an integer in [-2**63, 2**64), got {self.seed!r}")
        _require(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
                 "logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _require(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                                  and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
                 "prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        _require(self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
                 "structured_output", f"must be a StructuredOutput, got {type(self.structured_output).__name__}")

    def _validate_stopping(self) -> None:
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
                 f"must be an integer >= 1, got {self.max_tokens!r}")
        _require(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
                 f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _require(len(self.stop) <= MAX_STOP_STRINGS, "stop",
                 f"must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        _require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 "must be non-negative integers")
        _require(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
                 f"must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")

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
