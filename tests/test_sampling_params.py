"""SamplingParams validation: every bad value raises InvalidRequestError naming its field."""

from __future__ import annotations

import dataclasses
import math

import pytest

from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from splitserve.common.structured_output import (GuidedDecodingParams, StructuredOutput, StructuredOutputKind,
                                                 StructuredOutputsParams)

INVALID = [
    ("temperature", -0.1), ("temperature", -1e-9), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "1"), ("temperature", None), ("temperature", True),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", 1.0000001), ("top_p", -0.5), ("top_p", math.nan), ("top_p", False),
    ("top_k", -2), ("top_k", 1.5), ("top_k", 2.0), ("top_k", True),
    ("min_p", -0.1), ("min_p", 1.1), ("min_p", math.nan),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("frequency_penalty", 3.0), ("frequency_penalty", -3), ("frequency_penalty", 2.0001),
    ("frequency_penalty", math.nan),
    ("presence_penalty", 3.0), ("presence_penalty", -3.0), ("presence_penalty", math.inf),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", True), ("max_tokens", 2.0),
    ("logprobs", -1), ("prompt_logprobs", -1), ("logprobs", True), ("logprobs", 1.0),
    ("seed", 1.5), ("seed", True), ("seed", "7"), ("seed", 2**64), ("seed", -2**63 - 1),
    ("stop", [""]), ("stop", ""), ("stop", ["ok", ""]), ("stop", [3]), ("stop", 3),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1, -1]), ("stop_token_ids", ["a"]), ("stop_token_ids", [True]),
    ("stop_token_ids", [1.0]), ("stop_token_ids", 5),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", True), ("min_tokens", 1.0), ("min_tokens", None),
    # ints beyond a float's range (a JSON body may carry any integer): rejected, not an OverflowError
    ("temperature", 10**400), ("top_p", 10**309), ("min_p", -10**400), ("repetition_penalty", 10**309),
    ("frequency_penalty", 10**400), ("presence_penalty", -10**309),
    ("logit_bias", {"a": 1.0}), ("logit_bias", {"1.5": 1.0}), ("logit_bias", {1.0: 1.0}), ("logit_bias", {True: 1}),
    ("logit_bias", {1: 100.01}), ("logit_bias", {1: -101}), ("logit_bias", {1: math.nan}), ("logit_bias", {1: "1"}),
    ("logit_bias", [1, 2]), ("logit_bias", 5), ("logit_bias", dict.fromkeys(range(1025), 1.0)),
    # keys whose sign or length int() refuses: a 400, not a ValueError escaping as a 500
    ("logit_bias", {"+-5": 1.0}), ("logit_bias", {"--5": 1.0}), ("logit_bias", {"1" * 5000: 1.0}),
    ("allowed_token_ids", []), ("allowed_token_ids", ["1"]), ("allowed_token_ids", [1.0]), ("allowed_token_ids", 3),
    ("bad_words", [""]), ("bad_words", [["a"]]), ("bad_words", [3]),
    ("n", 0), ("n", -1), ("n", True), ("n", 2.0), ("n", None),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2), ("truncate_prompt_tokens", True),
    ("truncate_prompt_tokens", 1.0), ("detokenize", 0), ("detokenize", None),
    ("spaces_between_special_tokens", False), ("spaces_between_special_tokens", None),
]


@pytest.mark.parametrize("field, value", INVALID)
def test_invalid_value_raises_invalid_request_error_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**{field: value})
    assert isinstance(error.value, ValueError)
    assert error.value.field == field
    assert str(error.value).startswith(f"{field}: ")


def test_message_shows_the_rejected_value():
    with pytest.raises(InvalidRequestError, match=r"^max_tokens: must be an integer >= 1, got True$"):
        SamplingParams(max_tokens=True)
    with pytest.raises(InvalidRequestError, match=r"^top_p: must be in \(0, 1\], got 1.5$"):
        SamplingParams(top_p=1.5)


def test_stop_lists_are_bounded():
    """The router scans every stop string for each token on its event loop: the count is capped."""
    assert len(SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]).stop) == MAX_STOP_STRINGS
    with pytest.raises(InvalidRequestError, match=rf"^stop: must hold at most {MAX_STOP_STRINGS} strings, got "
                                                  rf"{MAX_STOP_STRINGS + 1}$"):
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    assert len(SamplingParams(stop_token_ids=[7] * MAX_STOP_TOKEN_IDS).stop_token_ids) == MAX_STOP_TOKEN_IDS
    with pytest.raises(InvalidRequestError, match=rf"^stop_token_ids: must hold at most {MAX_STOP_TOKEN_IDS} ids, "
                                                  rf"got {MAX_STOP_TOKEN_IDS + 1}$"):
        SamplingParams(stop_token_ids=[7] * (MAX_STOP_TOKEN_IDS + 1))


def test_first_invalid_field_in_check_order_is_reported():
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(temperature=-1.0, max_tokens=0)
    assert error.value.field == "temperature"


VALID_EDGES = [
    ("temperature", 0.0), ("temperature", 0), ("temperature", 1e-300), ("temperature", 1e6),
    ("top_p", 1.0), ("top_p", 1), ("top_p", 1e-9),
    ("top_k", -1), ("top_k", 0), ("top_k", 1), ("top_k", 10**9),
    ("min_p", 0.0), ("min_p", 1.0),
    ("repetition_penalty", 1e-9), ("repetition_penalty", 100.0),
    ("frequency_penalty", -2.0), ("frequency_penalty", 2), ("presence_penalty", -2), ("presence_penalty", 2.0),
    ("max_tokens", 1), ("max_tokens", 10**9),
    ("logprobs", None), ("logprobs", 0), ("logprobs", MAX_LOGPROBS),
    ("seed", None), ("seed", 0), ("seed", -1), ("seed", -2**63), ("seed", 2**64 - 1),
    ("stop_token_ids", (0,)),
    ("min_tokens", 0), ("min_tokens", 16),
    ("n", 1), ("n", 64),
    ("max_tokens", None), ("truncate_prompt_tokens", None), ("truncate_prompt_tokens", -1),
    ("truncate_prompt_tokens", 1), ("detokenize", False),
]


@pytest.mark.parametrize("field", ["stop", "stop_token_ids", "bad_words", "logit_bias"])
def test_none_is_vllm_s_default_for_the_list_fields(field):
    # vLLM's SamplingParams defaults these to None: a script passing stop=None (e.g. from a config) asks for none.
    assert SamplingParams(**{field: None}) == SamplingParams()


@pytest.mark.parametrize("field, value", VALID_EDGES)
def test_edge_values_are_accepted_unchanged(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_defaults():
    params = SamplingParams()
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (1.0, -1, 1.0, 0.0)
    assert (params.repetition_penalty, params.frequency_penalty, params.presence_penalty) == (1.0, 0.0, 0.0)
    assert (params.seed, params.stop, params.stop_token_ids, params.max_tokens) == (None, (), (), 16)
    assert (params.ignore_eos, params.logprobs, params.skip_special_tokens, params.min_tokens) == (False, None, True, 0)
    assert not params.is_greedy and params.effective_top_k == 0


def test_stop_string_normalizes_to_a_one_element_tuple():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop="###").stop == ("###",)  # not split into characters


def test_lists_normalize_to_tuples():
    params = SamplingParams(stop=["a", "bc"], stop_token_ids=[5, 6, 5])
    assert params.stop == ("a", "bc") and type(params.stop) is tuple
    assert params.stop_token_ids == (5, 6, 5) and type(params.stop_token_ids) is tuple
    assert SamplingParams(stop=(s for s in ["x", "y"])).stop == ("x", "y")
    assert SamplingParams(stop=["x"]) == SamplingParams(stop="x") == SamplingParams(stop=("x",))
    assert hash(SamplingParams(stop=["x"], stop_token_ids=[1])) == hash(SamplingParams(stop="x", stop_token_ids=(1,)))


def test_caller_list_is_copied():
    stop = ["a"]
    params = SamplingParams(stop=stop)
    stop.append("b")
    assert params.stop == ("a",)


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (0, True), (1e-300, False), (1.0, False)])
def test_is_greedy_only_at_temperature_zero(temperature, greedy):
    assert SamplingParams(temperature=temperature).is_greedy is greedy


@pytest.mark.parametrize("top_k, effective", [(-1, 0), (0, 0), (1, 1), (40, 40)])
def test_effective_top_k_normalizes_both_disabled_spellings(top_k, effective):
    assert SamplingParams(top_k=top_k).effective_top_k == effective


@pytest.mark.parametrize("field, value", [("temperature", 0.5), ("stop", ("y",)), ("max_tokens", 3), ("seed", 1)])
def test_is_frozen(field, value):
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(params, field, value)
    assert getattr(params, field) == getattr(SamplingParams(), field)


def test_replace_revalidates():
    params = SamplingParams(temperature=0.5)
    assert dataclasses.replace(params, max_tokens=3).max_tokens == 3
    with pytest.raises(InvalidRequestError) as error:
        dataclasses.replace(params, top_p=0.0)
    assert error.value.field == "top_p"


def test_logit_bias_normalizes_to_sorted_integer_pairs():
    """JSON's string keys (vLLM converts them with int(): a sign and surrounding spaces are fine)."""
    params = SamplingParams(logit_bias={"7": 1.5, 3: -100, " +12 ": 100.0})
    assert params.logit_bias == ((3, -100), (7, 1.5), (12, 100.0))
    assert SamplingParams(logit_bias=params.logit_bias) == params  # pairs, as dataclasses.replace passes them
    assert dataclasses.replace(params, seed=1).logit_bias == params.logit_bias


def test_logit_control_ids_are_checked_against_the_vocabulary_with_vllms_message():
    SamplingParams(logit_bias={511: 1}, allowed_token_ids=[0, 511]).check_logit_control_vocabulary(512)
    for params, field, ids in ((SamplingParams(logit_bias={-1: 1, 512: 2}), "logit_bias", [-1, 512]),
                               (SamplingParams(allowed_token_ids=[5, 600]), "allowed_token_ids", [600]),
                               (SamplingParams(bad_words_token_ids=[(3, 512)]), "bad_words", [512])):
        with pytest.raises(InvalidRequestError) as error:
            params.check_logit_control_vocabulary(512)
        assert (error.value.field, error.value.message) == (
            field, f"token_id(s) {ids} in {field} contain out-of-vocab token ids. Vocabulary size: 512")


@pytest.mark.parametrize("value", [[()], [("a",)], [(1,)] * 129])
def test_bad_token_sequences_are_refused_naming_bad_words(value):
    """bad_words_token_ids come from bad_words: an error names the field the client sent."""
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(bad_words_token_ids=value)
    assert error.value.field == "bad_words"


def test_bad_words_are_tokenized_bare_and_after_a_space_as_vllm_does():
    """vLLM's update_from_tokenizer: each word left-stripped, and with a leading space when that is
    another sequence of the same length; repeated words once."""
    vocab = {"mill": [10], " mill": [11], "old mill": [20, 10], " old mill": [21, 11], "a b": [1, 2, 3],
             " a b": [4, 5]}
    params = SamplingParams(bad_words=["mill", " old mill", "a b", "mill"]).with_bad_words_tokenized(vocab.__getitem__)
    assert params.bad_words == ("mill", " old mill", "a b")
    assert params.bad_words_token_ids == ((10,), (11,), (20, 10), (21, 11), (1, 2, 3))
    with pytest.raises(InvalidRequestError, match="^bad_words: entries must tokenize to at least one token, got 'x'"):
        SamplingParams(bad_words=["x"]).with_bad_words_tokenized(lambda text: [])
    many = SamplingParams(bad_words=[f"w{i}" for i in range(65)])
    with pytest.raises(InvalidRequestError, match="^bad_words: tokenize to 130 token sequences; at most 128$"):
        many.with_bad_words_tokenized(lambda text: [len(text), 1])


@pytest.mark.parametrize(("fields", "max_logprobs", "message"), [
    ({"logprobs": MAX_LOGPROBS + 1}, MAX_LOGPROBS,
     "logprobs: Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ({"prompt_logprobs": 6}, 5, "prompt_logprobs: Requested prompt logprobs of 6, which is greater than max allowed: 5"),
    ({"logprobs": 101}, -1, "logprobs: Requested sample logprobs of 101, which is greater than max allowed: 100"),
    ({"logprobs": 101}, 500, "logprobs: Requested sample logprobs of 101, which is greater than max allowed: 100"),
])
def test_logprobs_beyond_the_servers_limit_are_refused_naming_it(fields, max_logprobs, message):
    """--max-logprobs (-1: the vocabulary, here 100, which also bounds any larger limit)."""
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**fields).check_logprobs_limit(max_logprobs, 100)
    assert str(caught.value) == message


def test_logprobs_within_the_limit_pass():
    for fields, max_logprobs in (({"logprobs": 20, "prompt_logprobs": 20}, 20), ({"logprobs": 50}, 50),
                                 ({"logprobs": 100}, -1), ({"logprobs": 0}, 0), ({}, 0)):
        SamplingParams(**fields).check_logprobs_limit(max_logprobs, 100)


# ---- vLLM's structured_outputs / guided_decoding spellings ------------------------------------------

@pytest.mark.parametrize(("vllm_params", "expected"), [
    (StructuredOutputsParams(json={"type": "integer"}), StructuredOutput.json_schema({"type": "integer"})),
    (StructuredOutputsParams(json='{"type": "integer"}'), StructuredOutput.json_schema({"type": "integer"})),
    (StructuredOutputsParams(regex="[ab]+"), StructuredOutput(StructuredOutputKind.REGEX, "[ab]+")),
    (StructuredOutputsParams(choice=["yes", "no"], disable_any_whitespace=True),
     StructuredOutput(StructuredOutputKind.CHOICE, '["yes","no"]')),
    (StructuredOutputsParams(grammar='start: "a"'), StructuredOutput(StructuredOutputKind.GRAMMAR, 'start: "a"')),
    (StructuredOutputsParams(json_object=True), StructuredOutput(StructuredOutputKind.JSON_OBJECT)),
])
def test_vllm_structured_outputs_become_the_structured_output(vllm_params, expected):
    params = SamplingParams(max_tokens=5, structured_outputs=vllm_params)
    assert params == SamplingParams(max_tokens=5, structured_output=expected)
    assert params.for_sequence(1) == params  # replace() keeps the constraint and does not re-read the spelling


def test_vllm_guided_decoding_is_the_older_spelling():
    params = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["a", "b"], backend="xgrammar"))
    assert params.structured_output == StructuredOutput(StructuredOutputKind.CHOICE, '["a","b"]')


@pytest.mark.parametrize(("make", "message"), [
    (lambda: StructuredOutputsParams(json={"type": "integer"}, regex="a"),
     "structured_outputs: must set exactly one of json, regex, choice, grammar, json_object, got ['json', 'regex']"),
    (lambda: StructuredOutputsParams(),
     "structured_outputs: must set exactly one of json, regex, choice, grammar, json_object, got none"),
    (lambda: StructuredOutputsParams(json="{not json"), "structured_outputs.json: is not valid JSON"),
    (lambda: StructuredOutputsParams(choice="ab"), "structured_outputs.choice: must be a list of strings, got 'ab'"),
    (lambda: StructuredOutputsParams(json_object=False), "structured_outputs.json_object: must be True, got False"),
    (lambda: StructuredOutputsParams(regex="a", whitespace_pattern=" "),
     "structured_outputs.whitespace_pattern: is not supported"),
    (lambda: SamplingParams(structured_outputs={"json": {}}),
     "structured_outputs: must be a StructuredOutputsParams, got dict"),
    (lambda: SamplingParams(structured_output=StructuredOutput.choice(["a"]),
                            structured_outputs=StructuredOutputsParams(regex="a")),
     "structured_outputs: only one of structured_output, structured_outputs and guided_decoding may be set, got "
     "structured_output, structured_outputs"),
])
def test_bad_vllm_structured_outputs_are_refused_by_name(make, message):
    with pytest.raises(InvalidRequestError) as error:
        make()
    assert str(error.value).startswith(message)


def test_vllm_s_offline_only_fields_read_as_its_messages():
    with pytest.raises(InvalidRequestError, match=r"^truncate_prompt_tokens: must be an integer >= 1 or -1, got 0$"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(InvalidRequestError, match=r"^stop: stop strings are only supported when detokenize is True. "
                                                  r"Set detokenize=True to use stop.$"):
        SamplingParams(detokenize=False, stop=["x"])
    with pytest.raises(InvalidRequestError, match=r"^spaces_between_special_tokens: only True is supported "
                                                  r"\(splitserve decodes with fast tokenizers, which have no such "
                                                  r"option\), got False$"):
        SamplingParams(spaces_between_special_tokens=False)
    assert SamplingParams(spaces_between_special_tokens=True) == SamplingParams()


def test_max_tokens_none_bounds_min_tokens_by_nothing_and_resolves_to_the_room_given():
    params = SamplingParams(max_tokens=None, min_tokens=10**6)
    assert (params.resolved_max_tokens(10**7).max_tokens, params.resolved_max_tokens(5).max_tokens) == (10**7, 10**6)
    assert SamplingParams(max_tokens=7).resolved_max_tokens(100).max_tokens == 7
