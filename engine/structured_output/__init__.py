"""Structured output in the engine: compiled grammars (cached), one matcher per request, and the
token bitmask the sampler applies (see docs/structured_output.md)."""

from splitserve.engine.structured_output.bitmask import TokenBitmask
from splitserve.engine.structured_output.matchers import GrammarMatchers, GrammarState

__all__ = ["GrammarMatchers", "GrammarState", "TokenBitmask"]
