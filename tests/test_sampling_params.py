"""SamplingParams validation: every bad value names its field."""

from __future__ import annotations

import dataclasses
import math

import pytest

from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import SamplingParams

INVALID = [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 1.5), ("min_p", -0.1), ("min_p", 1.1),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("frequency_penalty", 2.5),
    ("presence_penalty", -3.0), ("max_tokens", 0), ("max_tokens", True), ("max_tokens", 2.0),
    ("logprobs", 21), ("logprobs", -1), ("seed", 1.5), ("stop", [""]), ("stop", [3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
]


@pytest.mark.parametrize("field, value", INVALID)
def test_invalid_value_names_the_field(field, value):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**{field: value})
    assert isinstance(error.value, ValueError)
    assert error.value.field == field
    assert str(error.value).startswith(f"{field}:")


def test_edge_values_are_accepted_and_normalized():
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=1.0, frequency_penalty=-2.0,
                            presence_penalty=2.0, logprobs=20, max_tokens=1, stop="###", stop_token_ids=[5, 6])
    assert params.stop == ("###",) and params.stop_token_ids == (5, 6)
    assert params.is_greedy and params.effective_top_k == 0
    assert SamplingParams(top_k=-1).effective_top_k == 0
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5
