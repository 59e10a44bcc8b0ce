"""use_beam_search and length_penalty on the OpenAI API (vLLM's extension fields): the request's beam
search parameters, and a 400 for fields a beam search cannot honour.

As in vLLM the search takes only n (its beam width), max_tokens, ignore_eos, temperature, length_penalty
and include_stop_str_in_output from the request (CompletionRequest.to_beam_search_params). vLLM silently
drops the rest; here a field that would change a sampled request's output (stop conditions, logit
controls, penalties, structured output, logprobs, echo, best_of above n) is a 400 naming it instead.
top_p, top_k, min_p and seed are accepted and, as in vLLM, have no effect: only temperature reaches
each step's request, where it picks the sampled token that joins the beam's candidates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from splitserve.common.beam_search import BeamSearchParams
from splitserve.common.errors import InvalidRequestError, json_excerpt
from splitserve.common.sampling_params import SamplingParams
from splitserve.router.openai_fields import asks_for_nothing

_UNSET = (None,)
_NO_PENALTY = (0, 0.0)
_COMMON_UNHONOURED = {
    "stop": (None, "", []), "stop_token_ids": (None, []), "min_tokens": (None, 0), "logit_bias": (None, {}),
    "allowed_token_ids": _UNSET, "bad_words": (None, []), "presence_penalty": (None, *_NO_PENALTY),
    "frequency_penalty": (None, *_NO_PENALTY), "repetition_penalty": (None, 1, 1.0), "prompt_logprobs": _UNSET,
    "response_format": (None, {"type": "text"}), "structured_outputs": _UNSET, "guided_json": _UNSET,
    "guided_regex": _UNSET, "guided_choice": _UNSET, "guided_grammar": _UNSET,
}
"""Fields a beam search cannot honour, and the values that ask for nothing (openai_fields.asks_for_nothing)."""
COMPLETION_UNHONOURED = {**_COMMON_UNHONOURED, "logprobs": _UNSET, "echo": (None, False)}
CHAT_UNHONOURED = {**_COMMON_UNHONOURED, "logprobs": (None, False), "top_logprobs": _UNSET,
                   "tool_choice": (None, "none", "auto")}


def parse_beam_search(body: Mapping[str, Any], n: int, sampling: SamplingParams,
                      unhonoured: Mapping[str, tuple[Any, ...]]) -> BeamSearchParams | None:
    """The request's beam search (None: use_beam_search is false); a 400 naming the first field the search
    cannot honour. `sampling`: the request's parsed sampling parameters (max_tokens, temperature, ...)."""
    use_beam_search = body.get("use_beam_search", False)
    if "use_beam_search" in body and not isinstance(use_beam_search, bool):
        raise InvalidRequestError("use_beam_search", f"must be a boolean, got {json_excerpt(use_beam_search)}")
    length_penalty = _length_penalty(body)
    if not use_beam_search:
        if length_penalty != 1.0:
            raise InvalidRequestError("length_penalty", "only applies to beam search: set use_beam_search to true")
        return None
    for name, accepted in unhonoured.items():
        value = body.get(name)
        if not asks_for_nothing(value, accepted):
            raise InvalidRequestError(name, f"cannot be combined with use_beam_search: the search ranks beams by the "
                                            f"raw model logprobs alone (got {json_excerpt(value)})")
    return BeamSearchParams(n, sampling.max_tokens, sampling.ignore_eos, sampling.temperature, length_penalty,
                            sampling.include_stop_str_in_output)


def _length_penalty(body: Mapping[str, Any]) -> float:
    """length_penalty: a number, 1.0 when absent; null is a 400 (vLLM declares it a float without null). Kept as
    sent: an integer too large for a float is BeamSearchParams' to refuse, not float()'s to raise on."""
    if "length_penalty" not in body:
        return 1.0
    value = body["length_penalty"]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidRequestError("length_penalty", f"must be a number, got {json_excerpt(value)}")
    return value
