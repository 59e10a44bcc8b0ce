"""Grammar matchers of the requests in an engine: compiled grammars cached by grammar text, one
matcher per constrained request, advanced by every token the request accepts.

The grammar engine is llguidance (torch-free, CPU): a matcher computes the set of tokens its
grammar allows next as a bitmask, and consumes the token sampled from it. Invariant: a request's
matcher has consumed exactly its output tokens so far (those generated elsewhere, by a prefill
worker or a lost worker, are consumed when the request is added), so its next mask is the one for
the next output token. A constraint that starts after a token (StructuredOutput.starts_after_token:
a reasoning parser's end tag) has no matcher until that token is accepted; its output is free till
then, and its matcher then consumes only what follows the token.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from splitserve.common.errors import InvalidRequestError
from splitserve.common.log_escape import quote_for_log
from splitserve.common.structured_output import StructuredOutput
from splitserve.engine.structured_output.bitmask import TokenBitmask, num_words

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
"""Compiled grammars kept for reuse (least recently used dropped first)."""
PARSER_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
"""llguidance's default limits, with errors that say what failed without the parser state and the
whole grammar (the client's schema, thousands of characters) appended."""
MIN_ROWS_FOR_THREAD = 8
"""Fewer constrained rows than this are filled inline: their fill (about 10 us a row) is shorter
than handing it to another thread."""


class GrammarState(enum.Enum):
    OPEN = "open"
    """More output may follow (the grammar is not complete, or may go on)."""
    COMPLETE = "complete"
    """The grammar can take nothing more: the request is finished."""
    REJECTED = "rejected"
    """The token is not one the grammar allows (it was not sampled from the mask)."""


class GrammarCache:
    """Compiled grammars by grammar text: a new request gets a copy of the compiled matcher."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, capacity: int = MAX_CACHED_GRAMMARS) -> None:
        self._tokenizer = tokenizer
        self._capacity = capacity
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def matcher(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher (at the grammar's start) for the constraint; InvalidRequestError naming
        the constraint's kind if its grammar does not compile."""
        return self.compiled(constraint).deep_copy()

    def compiled(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """The constraint's compiled matcher (never advanced: copy it), compiled on a miss."""
        grammar = constraint.grammar()
        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
            if compiled.is_error():
                raise InvalidRequestError(constraint.kind.value, " ".join(compiled.get_error().split()))  # one line
            self._compiled[grammar] = compiled
            while len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar)
        return compiled

    def __len__(self) -> int:
        return len(self._compiled)


class GrammarMatchers:
    """One matcher per constrained request of one engine. The tokenizer is loaded on first use,
    so an engine that never sees a constrained request never pays for it."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        """tokenizer_json: the model's tokenizer.json text (raises InvalidRequestError when absent)."""
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._cache: GrammarCache | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._filler: ThreadPoolExecutor | None = None
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._waiting: dict[str, StructuredOutput] = {}
        """Constraints whose starts_after_token has not been generated yet, by request."""

    def _grammars(self) -> GrammarCache:
        if self._cache is None:
            tokenizer = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self._vocab_size,
                                               eos_token=self._eos_token_ids or None)
            self._cache = GrammarCache(tokenizer)
            self._executor = llguidance.LLExecutor()
            self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        return self._cache

    @property
    def num_cached_grammars(self) -> int:
        return 0 if self._cache is None else len(self._cache)

    def check(self, constraint: StructuredOutput) -> None:
        """Compile the constraint's grammar (kept in the cache): InvalidRequestError if it cannot be."""
        self._grammars().compiled(constraint)

    def add(self, request_id: str, constraint: StructuredOutput, output_token_ids: Sequence[int]) -> None:
        """Start the request's matcher, advanced over the output it already has (InvalidRequestError
        if that output is not one the grammar allows). A constraint that starts after a token the
        output does not have yet waits for it."""
        gate = constraint.starts_after_token
        if gate is not None:
            if gate not in output_token_ids:
                self._grammars().compiled(constraint)  # a grammar that cannot compile fails here, not at the gate
                self._waiting[request_id] = constraint
                return
            output_token_ids = output_token_ids[list(output_token_ids).index(gate) + 1:]
        matcher = self._grammars().matcher(constraint)
        if output_token_ids and not matcher.consume_tokens(list(output_token_ids)):
            raise InvalidRequestError("output_token_ids", f"do not match the {constraint.kind.value} grammar: "
                                                          f"{matcher.get_error()}")
        self._matchers[request_id] = matcher

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._waiting.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def start_bitmask(self, request_ids: Sequence[str]) -> Future[TokenBitmask | None]:
        """The allowed tokens of the constrained ones among a batch's rows (request_ids[i] samples
        logits row i), filled for all of them in one parallel llguidance call; from
        MIN_ROWS_FOR_THREAD rows on, on a thread of its own, so that it runs while the model computes
        the logits. None if no row is constrained. No matcher may change until the future is done."""
        rows = tuple(i for i, request_id in enumerate(request_ids) if request_id in self._matchers)
        matchers = [(self._matchers[request_ids[row]], index) for index, row in enumerate(rows)]
        if len(rows) >= MIN_ROWS_FOR_THREAD:
            return self._filler.submit(self._fill, rows, matchers)
        done: Future[TokenBitmask | None] = Future()
        done.set_result(self._fill(rows, matchers) if rows else None)
        return done

    def _fill(self, rows: tuple[int, ...], matchers: list[tuple[llguidance.LLMatcher, int]]) -> TokenBitmask:
        words = torch.empty(len(rows), num_words(self._vocab_size), dtype=torch.int32)  # [m, W], filled below
        self._executor.unsafe_compute_mask_ptr(matchers, words.data_ptr(), words.shape[1] * words.element_size(),
                                               len(rows))
        return TokenBitmask(rows, words)

    def accept(self, request_id: str, token_id: int) -> GrammarState:
        """Advance the request's matcher by its newly sampled token (OPEN for an unconstrained request)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            waiting = self._waiting.get(request_id)
            if waiting is not None and token_id == waiting.starts_after_token:
                del self._waiting[request_id]
                self._matchers[request_id] = self._grammars().matcher(waiting)
            return GrammarState.OPEN
        if not matcher.consume_token(token_id):
            # The error may quote the client's grammar: bounded.
            logger.warning("[%s] token %d rejected by its grammar: %s", request_id, token_id,
                           quote_for_log(matcher.get_error()))
            return GrammarState.REJECTED
        return GrammarState.COMPLETE if matcher.is_stopped() else GrammarState.OPEN

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Take back the request's last num_tokens accepted tokens (rejected draft tokens)."""
        matcher = self._matchers.get(request_id)
        if matcher is not None and not matcher.rollback(num_tokens):
            raise ValueError(f"[{request_id}] cannot roll back {num_tokens} tokens: {matcher.get_error()}")
