"""Incremental detokenization: exact text, split multi-byte characters, exact stop-string cuts."""

from __future__ import annotations

import pytest

from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.tiny_model import build_tokenizer

TEXTS = ["Hello world, the river runs by the old mill.", "naïve café 😀 日本語のテキスト 🚀🚀", "a  b\n\n c\t"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(vocab_size=512, seed=0)


def stream(tokenizer, text: str, stop=(), prompt=(1, 2, 3)):
    detokenizer = IncrementalDetokenizer(tokenizer.backend_tokenizer, list(prompt), tuple(stop), True)
    deltas, matched = [], None
    for token_id in tokenizer.encode(text):
        matched = detokenizer.append(token_id)
        deltas.append(detokenizer.take_delta(finished=matched is not None))
        if matched:
            break
    deltas.append(detokenizer.take_delta(finished=True))
    return detokenizer, deltas, matched


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tokenizer, text):
    detokenizer, deltas, _ = stream(tokenizer, text)
    assert detokenizer.output_text == text == tokenizer.decode(tokenizer.encode(text))
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)


def test_multibyte_characters_span_several_tokens(tokenizer):
    assert len(tokenizer.encode("😀")) > 1  # byte-level pieces: the case the offsets exist for


def test_stop_string_spanning_tokens_cuts_exactly(tokenizer):
    text = "the river runs by the old mill and the river again"
    stop = "old mi"
    assert len(tokenizer.encode(stop)) > 1
    detokenizer, deltas, matched = stream(tokenizer, text, stop=[stop])
    assert matched == stop
    assert detokenizer.output_text == "the river runs by the "
    assert "".join(deltas) == "the river runs by the "


def test_earliest_stop_string_wins(tokenizer):
    detokenizer, _, matched = stream(tokenizer, "alpha beta gamma delta", stop=["delta", "beta"])
    assert matched == "beta" and detokenizer.output_text == "alpha "


def test_streaming_holds_back_a_possible_stop_prefix(tokenizer):
    text = "the river runs by the old mill"
    _, deltas, matched = stream(tokenizer, text, stop=["old mx"])
    assert matched is None
    assert "".join(deltas) == text
    streamed_before_finish = "".join(deltas[:-1])
    assert len(text) - len(streamed_before_finish) <= len("old mx") - 1


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("hi") + [tokenizer.convert_tokens_to_ids("<|im_end|>")] + tokenizer.encode(" there")
    detokenizer = IncrementalDetokenizer(tokenizer.backend_tokenizer, [5], (), True)
    for token_id in ids:
        detokenizer.append(token_id)
    assert detokenizer.output_text == "hi there"
