"""Sampler: exact penalty arithmetic, filters, seeded draws and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from factories import make_sampling_row
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.sampler import Sampler, apply_penalties, filtered_probs, sample_from


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 4.0])
    row = make_sampling_row(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[1, 4])
    assert apply_penalties(logits, row).tolist() == [1.0, -4.0, 1.0, -1.0, 2.0]
    assert logits.tolist() == [2.0, -2.0, 1.0, -1.0, 4.0]  # the input is not modified


def test_frequency_and_presence_penalties_use_output_counts_only():
    logits = torch.zeros(4)
    row = make_sampling_row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=[3, 3, 3],
                            output=[1, 1, 1, 2])
    assert apply_penalties(logits, row).tolist() == [0.0, -1.75, -0.75, 0.0]


def test_greedy_takes_argmax_of_penalized_logits():
    logits = torch.tensor([[1.0, 3.0, 2.9]])
    plain = Sampler()(logits, [make_sampling_row(SamplingParams(temperature=0.0))])
    penalized = Sampler()(logits, [make_sampling_row(SamplingParams(temperature=0.0, repetition_penalty=1.5),
                                                     prompt=[1])])
    assert (plain.token_ids, penalized.token_ids) == ([1], [2])


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert (probs > 0).tolist() == [True, True, False, False]
    assert probs.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    assert (filtered_probs(logits, SamplingParams(top_p=0.81)) > 0).tolist() == [True, True, True, False]


def test_top_k_and_min_p_masks():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    assert (filtered_probs(logits, SamplingParams(top_k=2)) > 0).tolist() == [True, True, False, False]
    # min_p 0.45 x max 0.4 = 0.18: keeps 0.4, 0.3, 0.2
    assert (filtered_probs(logits, SamplingParams(min_p=0.45)) > 0).tolist() == [True, True, True, False]


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([2.0, 1.0, 0.0])
    cold = filtered_probs(logits, SamplingParams(temperature=0.5))
    hot = filtered_probs(logits, SamplingParams(temperature=2.0))
    assert cold.tolist() == pytest.approx(torch.softmax(logits / 0.5, -1).tolist())
    assert cold[0] > torch.softmax(logits, -1)[0] > hot[0]


@pytest.mark.parametrize("seed", range(20))
def test_top_k_one_equals_greedy(seed):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(seed))
    rows = [make_sampling_row(SamplingParams(temperature=1.3, top_k=1), seed=seed + i) for i in range(3)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_seeded_row_ignores_batch_mates_and_position():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=42)

    def draw(batch: list[int], position: int) -> list[int]:
        rows = [make_sampling_row(SamplingParams(temperature=0.7), seed=100 + i) for i in range(len(batch))]
        rows[position] = make_sampling_row(params)
        tokens = []
        for _ in range(20):  # 20 consecutive steps, same generators
            result = Sampler()(logits[batch], rows)
            tokens.append(result.token_ids[position])
        return tokens

    alone = draw([0], 0)
    assert draw([1, 0, 2], 1) == alone
    assert draw([3, 2, 1, 0], 3) == alone
    other_seed_rows = [make_sampling_row(SamplingParams(temperature=1.0, seed=43))]
    assert [Sampler()(logits[[0]], other_seed_rows).token_ids[0] for _ in range(20)] != alone


def test_draw_frequencies_follow_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    generator = torch.Generator().manual_seed(7)
    counts = torch.bincount(torch.tensor([sample_from(probs, generator) for _ in range(20000)]), minlength=4)
    chi_square = float((((counts - 20000 * probs) ** 2) / (20000 * probs)).sum())
    assert chi_square < 16.3  # p = 0.001 for 3 degrees of freedom


def test_logprobs_are_of_the_raw_distribution_with_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    row = make_sampling_row(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=10.0), prompt=[1])
    result = Sampler()(logits, [row])
    entry = result.logprobs[0]
    raw = torch.log_softmax(logits[0], -1)
    assert entry.token_id == 2 == result.token_ids[0]  # penalty moved the choice off token 1
    assert entry.rank == 2
    assert math.isclose(entry.logprob, float(raw[2]), rel_tol=1e-6)
    assert [t for t, _ in entry.top] == [1, 2]
    assert [v for _, v in entry.top] == pytest.approx([float(raw[1]), float(raw[2])])
    assert Sampler()(logits, [make_sampling_row(SamplingParams(temperature=0.0))]).logprobs == [None]
