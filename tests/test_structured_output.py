"""Structured output: the typed constraint (common/structured_output.py), its grammar text, the
bitmask, the engine's matchers (engine/structured_output/) and 200 random JSON schemas generated
through the engine with the default model, every output parsed and validated with jsonschema."""

from __future__ import annotations

import json
import logging
import pickle
import re

import jsonschema
import llguidance
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from splitserve.common.errors import InvalidRequestError
from splitserve.common.model_dir import DEFAULT_MODEL_NAME
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_output import ONE_OF_RULE, StructuredOutput, StructuredOutputKind, closed_objects
from splitserve.engine import LLM
from splitserve.engine.structured_output import GrammarState, TokenBitmask
from splitserve.engine.tiny_model import resolve_model_path
from splitserve.router.structured_output import parse_structured_output

PROMPT = "def main():\n"
REGEX = r"[a-z]{3,8}@example\.com"
def test_a_constraint_that_starts_after_a_token_waits_for_it(llm):
    """What a reasoning parser asks: the output is free until the gate token (its `</think>`), the
    grammar applies from the token after it; a request added with the gate in its output starts
    past it."""
    matchers = llm.engine.grammars
    gate, token_a, token_b = (llm.tokenizer.convert_tokens_to_ids(t) for t in ("!", "a", "b"))
    constraint = StructuredOutput(StructuredOutputKind.REGEX, "ab").after_token(gate)
    matchers.add("gated", constraint, ())
    assert ("gated" in matchers, matchers.start_bitmask(["gated"]).result()) == (False, None)
    assert [matchers.accept("gated", token) for token in (token_b, token_b)] == [GrammarState.OPEN] * 2
    assert (matchers.accept("gated", gate), "gated" in matchers) == (GrammarState.OPEN, True)
    assert matchers.accept("gated", token_b) == GrammarState.REJECTED
    matchers.add("past", constraint, (token_b, gate, token_a))
    assert matchers.accept("past", token_b) == GrammarState.COMPLETE
    for request_id in ("gated", "past"):
        matchers.remove(request_id)
        assert request_id not in matchers


CHOICES = ["yes", "no", "maybe"]
INEXACT = ("(numbers must be finite integers within +-2**53, or decimals of at most 14 significant digits and 20 "
           "after the point)")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(resolve_model_path(DEFAULT_MODEL_NAME), max_num_seqs=32)


def generate(llm: LLM, constraints: list[StructuredOutput], temperature: float = 0.0, seed: int = 0,
             max_tokens: int = 256):
    params = [SamplingParams(temperature=temperature, seed=seed + i, max_tokens=max_tokens, structured_output=c)
              for i, c in enumerate(constraints)]
    return llm.generate([PROMPT] * len(constraints), params)


# ---- the typed constraint ----------------------------------------------------------------------

ONE_OF_REFUSED = f"json_schema: unsupported keyword 'oneOf' at /: {ONE_OF_RULE}"


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "json_schema: unsupported keyword 'propertyNames' at /"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}},
     "json_schema: unsupported keyword 'uniqueItems' at /properties/a"),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, ONE_OF_REFUSED),
    ({"anyOf": [{"type": "strin"}]}, "json_schema: unsupported type 'strin' at /anyOf/0/type"),
    ({"type": "string", "format": "credit-card"},
     "json_schema: unsupported format 'credit-card' at /format"),
    ({"$ref": "http://example.com/s.json"},
     "json_schema: unsupported $ref 'http://example.com/s.json' (only references inside the schema, '#...') at "
     "/$ref"),
    ({"type": "object", "x-guidance": {"lenient": True}}, "json_schema: unsupported keyword 'x-guidance' at /"),
    ({"type": {"a": 1}}, "json_schema: unsupported type {'a': 1} at /type"),
    ({"properties": {"a": [1]}}, "json_schema: unsupported subschema of type list (must be an object or a boolean) "
                                 "at /properties/a"),
    # numbers the grammar engine would round (it wrote const 2**53 + 1 as 2**53, and 123456789.12345679
    # as 123456789.1234568), or cannot hold
    ({"const": 2 ** 53 + 1}, f"json_schema: unsupported number 9007199254740993 {INEXACT} at /const"),
    ({"type": "integer", "minimum": -(2 ** 53) - 1},
     f"json_schema: unsupported number -9007199254740993 {INEXACT} at /minimum"),
    ({"enum": ["a", {"b": [1, 123456789.12345679]}]},
     f"json_schema: unsupported number 123456789.12345679 {INEXACT} at /enum/1/b/1"),
    ({"type": "number", "exclusiveMaximum": 1.5e-21},
     f"json_schema: unsupported number 1.5e-21 {INEXACT} at /exclusiveMaximum"),
    ({"type": "number", "maximum": float("inf")}, f"json_schema: unsupported number inf {INEXACT} at /maximum"),
    # property names as JSON pointer tokens: "a/b" was written as two (/properties/a/b/type)
    ({"properties": {"a/b": {"type": "strin"}}}, "json_schema: unsupported type 'strin' at /properties/a~1b/type"),
    ({"$defs": {"~x": {"const": {"p/q": 2 ** 60}}}},
     f"json_schema: unsupported number 1152921504606846976 {INEXACT} at /$defs/~0x/const/p~1q"),
])
def test_a_schema_outside_the_subset_is_refused_naming_the_construct(schema, message):
    with pytest.raises(InvalidRequestError) as caught:
        StructuredOutput.json_schema(schema)
    assert (caught.value.field, str(caught.value)) == ("json_schema", message)


@pytest.mark.parametrize(("kind", "spec", "message"), [
    (StructuredOutputKind.CHOICE, "[]", "choice: must be a non-empty list of non-empty strings"),
    (StructuredOutputKind.CHOICE, '["a", 1]', "choice: must be a non-empty list of non-empty strings"),
    (StructuredOutputKind.JSON_SCHEMA, "{", "json_schema: is not valid JSON: Expecting property name enclosed in "
                                            "double quotes: line 1 column 2 (char 1)"),
    (StructuredOutputKind.JSON_SCHEMA, "[" * 100_000, "json_schema: is not valid JSON: maximum recursion depth "
                                                       "exceeded while decoding a JSON array from a unicode string"),
    (StructuredOutputKind.REGEX, "", "regex: must not be empty"),
    (StructuredOutputKind.JSON_OBJECT, "{}", "json_object: takes no spec"),
])
def test_malformed_specs_are_refused(kind, spec, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        StructuredOutput(kind, spec)


@pytest.mark.parametrize("regex", ["a/b", r"a\/b", r"\d+\\/x", "[/]{2}"])
def test_regex_grammar_is_llguidances_own(regex):
    ours = json.loads(StructuredOutput(StructuredOutputKind.REGEX, regex).grammar())["grammars"][0]["lark_grammar"]
    theirs = json.loads(llguidance.LLMatcher.grammar_from_regex(regex))["grammars"][0]["lark_grammar"]
    assert ours == theirs


def test_choice_grammar_is_one_terminal():
    ours = json.loads(StructuredOutput.choice(["a", 'b"c']).grammar())["grammars"][0]["lark_grammar"]
    assert ours == 'start: CHOICE\nCHOICE: "a" | "b\\"c"'


def test_objects_listing_properties_are_closed_unless_the_schema_says_otherwise():
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {"properties": {"p": point, "open": {**point, "additionalProperties": True},
                             "extra": {**point, "additionalProperties": point}},
              "$defs": {"P": point}, "items": point, "anyOf": [point, {"type": "object"}], "const": {"properties": {}}}
    closed_point = {**point, "additionalProperties": False}
    assert closed_objects(schema) == {
        "properties": {"p": closed_point, "open": {**point, "additionalProperties": True},
                       "extra": {**point, "additionalProperties": closed_point}},
        "$defs": {"P": closed_point}, "items": closed_point, "anyOf": [closed_point, {"type": "object"}],
        "const": {"properties": {}}, "additionalProperties": False}
    assert closed_objects(True) is True and schema["properties"]["p"] == point  # the client's schema untouched
    grammar = json.loads(StructuredOutput.json_schema(point).grammar())
    assert grammar["grammars"][0]["json_schema"]["additionalProperties"] is False


def test_a_schema_with_an_intersection_is_left_open():
    """Closed, {"a": 1, "b": 2} would break each part's closing: only {} would satisfy both."""
    both = {"properties": {"outer": {"allOf": [{"$ref": "#/$defs/A"}, {"properties": {"b": {"type": "integer"}}}]}},
            "$defs": {"A": {"properties": {"a": {"type": "integer"}}}}}
    assert closed_objects(both) == both
    single = {"allOf": [{"properties": {"a": {"type": "integer"}}}]}  # one part: nothing to intersect
    assert closed_objects(single) == {"allOf": [{"properties": {"a": {"type": "integer"}},
                                                 "additionalProperties": False}]}


def test_json_grammar_is_compact():
    grammar = json.loads(StructuredOutput.json_schema({"type": "integer"}).grammar())
    assert grammar == {"grammars": [{"name": "json_schema", "lark_grammar": None, "json_schema": {
        "type": "integer", "x-guidance": {"whitespace_flexible": False}}}]}


def test_sampling_params_refuse_a_loose_constraint():
    with pytest.raises(InvalidRequestError, match="structured_output: must be a StructuredOutput, got dict"):
        SamplingParams(structured_output={"type": "object"})


# ---- the router's parsing -------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "expected"), [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput(StructuredOutputKind.JSON_OBJECT)),
    ({"guided_json": '{"type": "integer"}'}, StructuredOutput.json_schema({"type": "integer"})),
    ({"structured_outputs": {"choice": ["a", "b"], "disable_any_whitespace": True}},
     StructuredOutput(StructuredOutputKind.CHOICE, '["a","b"]')),
    ({"guided_grammar": 'root ::= "a" | "b"'},
     StructuredOutput(StructuredOutputKind.GRAMMAR, '%llguidance {}\n\nstart: "a"\n     | "b"\n\n')),
    # GBNF's unicode escapes as llguidance's Lark reads them (its converter wrote \u0041 as \u41, refused)
    ({"guided_grammar": 'root ::= "\\u0041" [\\u0061-\\u0063] "\\U0001F600" "\\\\u0041"'},
     StructuredOutput(StructuredOutputKind.GRAMMAR,
                      '%llguidance {}\n\nstart: "\\x41" /[\\x61-\\x63]/ "\U0001F600" "\\\\u0041"\n')),
])
def test_router_parses_each_field(body, expected):
    assert parse_structured_output(body) == expected


@pytest.mark.parametrize(("body", "message"), [
    ({"guided_grammar": " "}, "guided_grammar: grammar: is not a valid GBNF grammar: No 'root' rule found"),
    ({"guided_json": {"type": "integer", "minimum": 3, "maximum": 1}},
     "guided_json: json_schema: Unsatisfiable schema: minimum (3) is greater than maximum (1)"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs: must set exactly one of json, regex, choice, grammar, json_object, got ['regex', 'choice']"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs: unknown key 'jsn'"),
    ({"guided_json": "[" * 100_000}, "guided_json: json_schema: is not valid JSON: maximum recursion depth exceeded "
                                     "while decoding a JSON array from a unicode string"),
    ({"response_format": {"type": "xml"}},
     'response_format: must be {"type": "text" | "json_object" | "json_schema", ...}, got {"type": "xml"}'),
])
def test_router_refuses_naming_the_field(body, message):
    with pytest.raises(InvalidRequestError) as caught:
        parse_structured_output(body)
    assert (caught.value.field, str(caught.value)) == (next(iter(body)), message)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | st.sampled_from(
        ["object", "string", "integer", "#/$defs/a", "a(", "email", "root ::= x", ""]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.sampled_from(
        ["type", "properties", "items", "required", "enum", "format", "$ref", "anyOf", "additionalProperties",
         "minimum", "maxLength", "pattern", "$defs", "json", "regex", "choice", "grammar", "x"]), children, max_size=4),
    max_leaves=12)


@settings(max_examples=500, derandomize=True, deadline=None, database=None)
@given(field=st.sampled_from(["guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                              "response_format"]), value=_JSON)
def test_router_parsing_only_ever_refuses_with_a_named_field(field, value):
    try:
        parse_structured_output({field: value})
    except InvalidRequestError as error:
        assert error.field == field


# ---- the bitmask -------------------------------------------------------------------------------

def test_bitmask_sets_disallowed_tokens_of_its_rows_to_minus_inf():
    logits = torch.arange(3 * 40, dtype=torch.float32).view(3, 40)  # [3, 40]
    # row 0 allows tokens 0, 5 and 33; row 2 allows 31 and 39 (bit 31 is the int32 sign bit)
    words = torch.tensor([[(1 << 0) | (1 << 5), 1 << 1], [-(1 << 31), 1 << 7]], dtype=torch.int32)  # [2, 2]
    masked = TokenBitmask((0, 2), words).applied_to(logits)
    assert torch.isfinite(masked).nonzero().tolist() == (
        [[0, 0], [0, 5], [0, 33]] + [[1, t] for t in range(40)] + [[2, 31], [2, 39]])
    assert masked[2, 39].item() == logits[2, 39].item() and torch.isfinite(logits).all()
    every_row = TokenBitmask((0, 1), words).applied_to(logits[:2])  # the one-pass path: no row unconstrained
    assert torch.isfinite(every_row).nonzero().tolist() == [[0, 0], [0, 5], [0, 33], [1, 31], [1, 39]]


# ---- the engine ----------------------------------------------------------------------------------

def test_choice_and_regex_outputs_greedy(llm):
    choice, regex = generate(llm, [StructuredOutput.choice(CHOICES), StructuredOutput(StructuredOutputKind.REGEX,
                                                                                       REGEX)])
    assert (choice.text, choice.token_ids, choice.finish_reason) == ("maybe", [508, 91, 1438], "stop")
    assert (regex.text, regex.finish_reason) == ("classpro@example.com", "stop")
    assert re.fullmatch(REGEX, regex.text)


def test_thousands_of_choices_sharing_a_prefix(llm):
    """3000 choices: as parser alternatives (llguidance's own choice grammar) the parser overflowed
    once the shared prefix was sampled and every request ended by "abort" after one token."""
    choices = [f"option{i}" for i in range(3000)]
    outputs = generate(llm, [StructuredOutput.choice(choices)] * 6, temperature=1.0)
    assert {o.finish_reason for o in outputs} == {"stop"}
    assert {o.text for o in outputs} <= set(choices)


def test_numbers_at_the_exactness_limits_are_written_exactly(llm):
    """enum numbers at the limits the schema check allows come out exactly (before the check,
    2**53 + 1 came out as 2**53: a value outside the enum)."""
    values = [2 ** 53, -(2 ** 53), 1234567.8901234, 1.2e-19, 1e21]
    schema = {"enum": values}
    outputs = generate(llm, [StructuredOutput.json_schema(schema)] * 10, temperature=1.0, max_tokens=400)
    assert {o.finish_reason for o in outputs} == {"stop"}
    assert {json.loads(o.text) for o in outputs} <= set(values) and len({o.text for o in outputs}) > 1


def test_sampled_choices_are_always_one_of_them(llm):
    outputs = generate(llm, [StructuredOutput.choice(CHOICES)] * 24, temperature=1.5)
    assert {o.text for o in outputs} <= set(CHOICES) and len({o.text for o in outputs}) > 1
    assert {o.finish_reason for o in outputs} == {"stop"}


def test_a_request_continues_from_tokens_generated_elsewhere(llm):
    """The decode worker's case: the matcher is advanced over the output already there."""
    constraint = StructuredOutput.json_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                                               "required": ["n"], "additionalProperties": False})
    whole = generate(llm, [constraint])[0]
    engine = llm.engine
    prompt = whole.prompt_token_ids
    engine.add_request("continued", prompt, SamplingParams(temperature=0, max_tokens=256,
                                                           structured_output=constraint),
                       output_token_ids=whole.token_ids[:2])
    tokens = list(whole.token_ids[:2])
    while engine.has_unfinished_requests():
        tokens += [t for delta in engine.step() for t in delta.new_token_ids]
    assert tokens == whole.token_ids and json.loads(whole.text) == {"n": json.loads(whole.text)["n"]}
    assert "continued" not in engine.grammars


def test_a_grammar_complete_after_the_first_token_ends_on_the_prefill_worker(llm):
    """Producer role: the first token completes the choice, so the request stops there and no KV is held."""
    engine = llm.engine
    params = SamplingParams(temperature=0, structured_output=StructuredOutput.choice(["a", "b"]))
    engine.add_request("producer", [5, 6, 7], params, hold_kv_after_prefill=True)
    deltas = engine.step()
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("producer", "stop")]
    assert engine.take_held_kv("producer") is None and "producer" not in engine.grammars


def test_constrained_params_cross_processes_by_pickle():
    params = SamplingParams(max_tokens=9, structured_output=StructuredOutput.json_schema({"type": "integer"}))
    assert pickle.loads(pickle.dumps(params)) == params


def test_tokens_the_grammar_refuses_are_an_invalid_request(llm):
    constraint = StructuredOutput.choice(CHOICES)
    with pytest.raises(InvalidRequestError, match="output_token_ids: do not match the choice grammar"):
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(structured_output=constraint),
                               output_token_ids=[0, 0])
    assert "bad" not in llm.engine.scheduler.requests and "bad" not in llm.engine.grammars


def test_an_invalid_grammar_is_refused_by_the_engine(llm):
    constraint = StructuredOutput(StructuredOutputKind.REGEX, "a(")
    with pytest.raises(InvalidRequestError, match="regex: .*unclosed group"):
        llm.engine.validate("r", [1, 2], SamplingParams(structured_output=constraint))


def test_a_grammar_the_parser_outgrows_is_logged_in_one_bounded_line(llm, caplog):
    """600 optional properties: after "{" the parser's row holds 2399 items, past llguidance's 2000,
    and the request's matcher fails. The warning quotes llguidance's error without the parser state
    and the whole grammar (the client's schema: 18,000 characters here), and bounded."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)},
              "additionalProperties": False}
    brace = llm.engine.tokenizer.encode("{", add_special_tokens=False).ids
    llm.engine.grammars.add("wide", StructuredOutput.json_schema(schema), [])
    with caplog.at_level(logging.WARNING, logger="splitserve.engine.structured_output.matchers"):
        assert llm.engine.grammars.accept("wide", brace[0]) == GrammarState.REJECTED
    llm.engine.grammars.remove("wide")
    assert [record.getMessage() for record in caplog.records] == [
        f'[wide] token {brace[0]} rejected by its grammar: "Parser Error: Current row has 2399 items; max is 2000; '
        "consider making your grammar left-recursive if it's right-recursive\\n<non-verbose/>\""]


def test_compiled_grammars_are_cached_and_matchers_roll_back(llm):
    matchers = llm.engine.grammars
    constraint = StructuredOutput(StructuredOutputKind.REGEX, "ab[0-9]+")
    matchers.check(constraint)
    cached = matchers.num_cached_grammars
    matchers.add("a", constraint, ())
    matchers.add("b", constraint, ())
    assert matchers.num_cached_grammars == cached
    start = matchers.start_bitmask(["x", "a"]).result()
    assert start.rows == (1,)
    token_a = llm.tokenizer.convert_tokens_to_ids("a")
    assert matchers.accept("a", token_a) == GrammarState.OPEN
    assert not torch.equal(matchers.start_bitmask(["a"]).result().words, start.words)
    matchers.rollback("a", 1)
    assert torch.equal(matchers.start_bitmask(["a"]).result().words, start.words)
    assert matchers.accept("b", llm.tokenizer.convert_tokens_to_ids("b")) == GrammarState.REJECTED
    matchers.remove("a")
    matchers.remove("b")


# ---- 200 random schemas from the supported subset -------------------------------------------------

NAMES = st.sampled_from(["a", "b", "id", "name", "value", "items", "x_1", "ok"])


def _leaf_schemas() -> st.SearchStrategy[dict]:
    integer = st.tuples(st.integers(-1000, 0), st.integers(0, 1000)).map(
        lambda r: {"type": "integer", "minimum": r[0], "maximum": r[1]})
    return st.one_of(
        st.integers(0, 12).flatmap(lambda n: st.integers(n, 12).map(
            lambda m: {"type": "string", "minLength": n, "maxLength": m})),
        integer,
        # multipleOf bounds a number's decimals (without it a model may write digits until max_tokens);
        # binary fractions, so that jsonschema's float division checks them exactly
        st.sampled_from([0.5, 0.25, 0.125]).map(lambda step: {"type": "number", "minimum": -100, "maximum": 100,
                                                            "multipleOf": step}),
        st.just({"type": "boolean"}),
        st.lists(st.sampled_from(["red", "green", "blue", 1, 2, True, None]), min_size=1, max_size=4,
                 unique=True).map(lambda values: {"enum": values}),
    )


def _compound(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    array = st.tuples(children, st.integers(0, 3)).map(
        lambda a: {"type": "array", "items": a[0], "maxItems": a[1]})
    obj = st.dictionaries(NAMES, children, min_size=0, max_size=4).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {"type": "object", "properties": props, "required": required,
                              "additionalProperties": False}) if props else st.just(
            {"type": "object", "properties": {}, "additionalProperties": False}))
    return st.one_of(array, obj)


JSON_SCHEMAS = st.recursive(_leaf_schemas(), _compound, max_leaves=8)
"""The supported subset: object / properties / required, string, integer, number, boolean, enum,
array with items, nested; sizes bounded so an output fits in its max_tokens."""


def _check(output, schema) -> None:
    assert output.finish_reason == "stop", (schema, output.text)
    jsonschema.validate(json.loads(output.text), schema)


NUM_SCHEMAS = 200
BATCH = 20
"""The 200 schemas run BATCH at a time (one engine batch each, beside two unconstrained rows)."""
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
"""A failing batch is reported as drawn: shrinking re-runs the engine for minutes."""


@settings(max_examples=NUM_SCHEMAS // BATCH, derandomize=True, deadline=None, database=None, phases=NO_SHRINK,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(schemas=st.lists(JSON_SCHEMAS, min_size=BATCH, max_size=BATCH), seed=st.integers(0, 1000))
def test_200_random_schemas_every_output_validates(llm, schemas, seed):
    """Every output parses and validates against its schema, greedy (even rows) and sampled (odd
    rows), in batches where rows of different grammars run beside unconstrained ones."""
    constraints = [StructuredOutput.json_schema(schema) for schema in schemas]
    params = [SamplingParams(temperature=0.8 * (i % 2), seed=seed + i, max_tokens=256, structured_output=c)
              for i, c in enumerate(constraints)]
    outputs = llm.generate([PROMPT] * (BATCH + 2), params + [SamplingParams(temperature=0, max_tokens=8)] * 2)
    for output, schema in zip(outputs, schemas):
        _check(output, schema)
    assert outputs[-1].token_ids == generate(llm, [None], max_tokens=8)[0].token_ids


def test_objects_that_list_their_properties_get_no_other_keys(llm):
    """As vLLM's default grammar backend (xgrammar, strict mode) and its guidance backend with
    disable_additional_properties: a schema that lists `properties` and says nothing of
    `additionalProperties` gets only those keys. Sampled at temperature 1.5, a random model took the
    open object's way out and wrote keys of its own."""
    schema = {"type": "object", "properties": {
        "digit": {"type": "integer", "minimum": 0, "maximum": 9},
        "point": {"type": "object", "properties": {"x": {"type": "boolean"}}}}}
    outputs = generate(llm, [StructuredOutput.json_schema(schema)] * 12, temperature=1.5)
    values = [json.loads(output.text) for output in outputs]
    assert {output.finish_reason for output in outputs} == {"stop"}
    assert all(set(value) <= {"digit", "point"} and set(value.get("point", {})) <= {"x"} for value in values)
    assert any(values), values  # not only {}
