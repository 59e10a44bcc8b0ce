"""The batched sampler on CUDA. tests/test_sampler.py holds it to the per-row reference bit for bit on CPU; on
CUDA the same steps run on the device's kernels (no CPU chunking, device generators), so here: greedy rows with
every logit control and penalty take exactly the CPU sampler's tokens, logprobs agree with the CPU's within
float32 reduction order, filtered distributions keep the CPU's support, and a seeded row's draws do not depend
on its batch mates."""

from __future__ import annotations

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.sampler import Sampler, filtered_probs
from tests.factories import make_sampling_row, requires_cuda

pytestmark = requires_cuda

CUDA = "cuda"
VOCAB = 300
PROMPT, OUTPUT = [3, 7, 7, 11], [7, 20, 3]
GREEDY_ROWS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, logprobs=5),
    SamplingParams(temperature=0.0, repetition_penalty=1.7),
    SamplingParams(temperature=0.0, repetition_penalty=0.4, logprobs=2),
    SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=-0.5),
    SamplingParams(temperature=0.0, logit_bias={5: 100.0, 6: -100.0}),
    SamplingParams(temperature=0.0, allowed_token_ids=[0, 9, 40, 77, 299]),
    SamplingParams(temperature=0.0, bad_words_token_ids=[(20, 3, 1), (7, 50)]),
    SamplingParams(temperature=1e-40),
    SamplingParams(top_k=1, seed=3),
]


def step_logits(batch: int, seed: int) -> torch.Tensor:
    """[batch, VOCAB] float32 on the CPU, widely spread (no ties)."""
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


def rows_on(device: str, params: list[SamplingParams]):
    return [make_sampling_row(p, prompt=PROMPT, output=OUTPUT, seed=i, device=device) for i, p in enumerate(params)]


@pytest.mark.parametrize("seed", range(4))
def test_greedy_rows_with_controls_and_penalties_take_the_cpu_tokens(seed):
    logits = step_logits(len(GREEDY_ROWS), seed)
    cpu = Sampler()(logits, rows_on("cpu", GREEDY_ROWS))
    cuda = Sampler()(logits.to(CUDA), rows_on(CUDA, GREEDY_ROWS))
    assert cuda.token_ids == cpu.token_ids
    for got, expected in zip(cuda.logprobs, cpu.logprobs):
        assert (got is None) == (expected is None)
        if got is not None:
            assert (got.token_id, got.rank) == (expected.token_id, expected.rank)
            assert [token for token, _ in got.top] == [token for token, _ in expected.top]
            assert got.logprob == pytest.approx(expected.logprob, abs=1e-5)
            assert [value for _, value in got.top] == pytest.approx([value for _, value in expected.top], abs=1e-5)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=40),
                                    SamplingParams(top_p=0.8), SamplingParams(temperature=0.5, min_p=0.05),
                                    SamplingParams(temperature=0.9, top_k=100, top_p=0.6, min_p=0.01)],
                         ids=["temperature", "top-k", "top-p", "min-p", "all"])
def test_filtered_distributions_keep_the_cpu_support(params):
    logits = step_logits(8, 11)
    cpu = filtered_probs(logits, [params] * 8)
    cuda = filtered_probs(logits.to(CUDA), [params] * 8).cpu()
    assert torch.equal(cuda > 0, cpu > 0)
    torch.testing.assert_close(cuda, cpu, rtol=1e-5, atol=1e-7)


def draw_sequence(steps: torch.Tensor, mates: list[SamplingParams], position: int, params: SamplingParams) -> list[int]:
    """Tokens of a row sampled on CUDA at `position` among `mates`, one per step's logits (steps [n, VOCAB])."""
    rows = [make_sampling_row(p, seed=100 + i, device=CUDA) for i, p in enumerate(mates)]
    rows.insert(position, make_sampling_row(params, device=CUDA))
    sampler, tokens = Sampler(), []
    for index, logits in enumerate(steps):
        batch = step_logits(len(rows), 1000 + index)
        batch[position] = logits
        tokens.append(sampler(batch.to(CUDA), rows).token_ids[position])
    return tokens


def test_a_seeded_row_draws_the_same_tokens_alone_and_in_any_batch_position():
    steps = step_logits(40, 0) / 4
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    alone = draw_sequence(steps, [], 0, params)
    mates = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0), SamplingParams(seed=7, top_k=5),
             SamplingParams(repetition_penalty=1.2, top_p=0.9, logprobs=3)]
    assert draw_sequence(steps, mates[:1], 1, params) == alone
    assert draw_sequence(steps, mates, 2, params) == alone
    assert draw_sequence(steps, mates[::-1], 4, params) == alone
    assert len(set(alone)) > 10  # real draws, not a constant
