"""LLM.beam_search (the offline API, vLLM's) on the tiny model: the beams equal the transformers-logits
reference token for token, in vLLM's offline form (the prompt's tokens first, the EOS kept, the whole
sequence decoded as text)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine import (LLM, BeamSearchOutput, BeamSearchParams, BeamSearchSequence, InvalidRequestError,
                               SamplingParams)
from tests.factories import eos_model, hf_logits, reference_beam_search

PROMPT = [481, 71, 223, 259, 367, 407, 87, 80, 85]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir)


def _beams(output: BeamSearchOutput, prompt: list[int], eos: int) -> list[tuple[list[int], str]]:
    """(output tokens without the prompt or a final EOS, finish reason) of each sequence."""
    beams = []
    for sequence in output.sequences:
        assert sequence.tokens[:len(prompt)] == prompt
        output_ids = sequence.tokens[len(prompt):]
        assert (output_ids[-1:] == [eos]) == (sequence.finish_reason == "stop")
        beams.append((output_ids[:-1] if sequence.finish_reason == "stop" else output_ids, sequence.finish_reason))
    return beams


def test_beam_width_one_is_greedy(llm):
    (greedy,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    greedy = greedy.outputs[0].token_ids
    (output,) = llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(1, 6, ignore_eos=True))
    assert output.sequences[0].tokens == PROMPT + greedy


@pytest.mark.parametrize("beam_width", [2, 4])
def test_beams_equal_the_reference_for_every_prompt(llm, tiny_llama_dir, beam_width):
    other = [5, 77, 300]
    outputs = llm.beam_search([PROMPT, other], BeamSearchParams(beam_width, 4))
    assert [_beams(output, prompt, 0) for output, prompt in zip(outputs, (PROMPT, other))] == [
        reference_beam_search(tiny_llama_dir, prompt, beam_width, 4, eos=0) for prompt in (PROMPT, other)]
    sequence = outputs[0].sequences[0]
    assert sequence.text == llm.tokenizer.decode(sequence.tokens)
    assert isinstance(sequence, BeamSearchSequence) and sequence.stop_reason is None


@pytest.mark.parametrize("length_penalty", [0.5, 2.0])
def test_eos_completes_beams_and_keeps_its_token(tiny_llama_dir, tmp_path, length_penalty):
    eos = int(torch.log_softmax(hf_logits(tiny_llama_dir, PROMPT)[-1], dim=-1).topk(2).indices[1])
    model_dir = eos_model(tiny_llama_dir, tmp_path / "model", eos)
    (output,) = LLM(model_dir).beam_search([PROMPT], BeamSearchParams(3, 5, length_penalty=length_penalty))
    expected = reference_beam_search(model_dir, PROMPT, 3, 5, eos, length_penalty)
    assert _beams(output, PROMPT, eos) == expected
    assert "stop" in {reason for _, reason in expected}
    assert {s.stop_reason for s in output.sequences if s.finish_reason == "stop"} == {eos}


def test_params_must_be_beam_search_params(llm):
    with pytest.raises(InvalidRequestError, match="params: must be a BeamSearchParams, got dict"):
        llm.beam_search([PROMPT], {"beam_width": 2})

