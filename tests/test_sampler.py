"""Sampler: exact penalty arithmetic, filters, seeded draws and logprobs (pure tensors, no model)."""

from __future__ import annotations

import pytest
import torch

from factories import make_sampling_row
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.sampler import Sampler, apply_penalties, filtered_probs, sample_from


def kept(probs: torch.Tensor) -> list[int]:
    """Token ids with nonzero probability, ascending."""
    return torch.nonzero(probs).flatten().tolist()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


# ---- penalties ---------------------------------------------------------------------------------

def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 4.0, 0.0, -3.0])
    row = make_sampling_row(SamplingParams(repetition_penalty=2.0), prompt=[0, 1, 5], output=[1, 4, 6])
    # seen = {0, 1, 4, 5, 6}: 2 -> 1, -2 -> -4, 4 -> 2, 0 stays 0, -3 -> -6; tokens 2 and 3 untouched
    assert torch.equal(apply_penalties(logits, row), torch.tensor([1.0, -4.0, 1.0, -1.0, 2.0, 0.0, -6.0]))
    assert torch.equal(logits, torch.tensor([2.0, -2.0, 1.0, -1.0, 4.0, 0.0, -3.0]))  # input not modified


def test_repetition_penalty_below_one_encourages_seen_tokens():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0])
    row = make_sampling_row(SamplingParams(repetition_penalty=0.5), prompt=[0], output=[1])
    assert torch.equal(apply_penalties(logits, row), torch.tensor([4.0, -1.0, 1.0, -1.0]))


@pytest.mark.parametrize("frequency, presence, expected", [
    # output counts [0, 3, 1, 0, 1]; prompt tokens (3, 4) count nothing
    (0.5, 0.25, [1.0, 0.25, 2.25, 4.0, 4.25]),
    (0.5, 0.0, [1.0, 0.5, 2.5, 4.0, 4.5]),
    (0.0, 0.25, [1.0, 1.75, 2.75, 4.0, 4.75]),
    (-1.0, -0.5, [1.0, 5.5, 4.5, 4.0, 6.5]),
])
def test_frequency_and_presence_penalties_subtract_count_times_frequency_plus_presence(frequency, presence,
                                                                                        expected):
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    params = SamplingParams(frequency_penalty=frequency, presence_penalty=presence)
    row = make_sampling_row(params, prompt=[3, 3, 3, 4], output=[1, 1, 1, 2, 4])
    assert torch.equal(apply_penalties(logits, row), torch.tensor(expected))


def test_frequency_and_presence_penalties_need_output_tokens():
    logits = torch.tensor([1.0, 2.0, 3.0])
    row = make_sampling_row(SamplingParams(frequency_penalty=2.0, presence_penalty=2.0), prompt=[0, 1, 2])
    assert torch.equal(apply_penalties(logits, row), logits)


def test_repetition_penalty_applies_before_frequency_and_presence():
    logits = torch.tensor([4.0, -2.0, 1.0])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0)
    row = make_sampling_row(params, output=[0, 1, 0])
    # repetition: [2, -4, 1]; then counts [2, 1, 0] subtract [2.0, 1.5, 0] (the other order gives [1, -7, 1])
    assert torch.equal(apply_penalties(logits, row), torch.tensor([0.0, -5.5, 1.0]))


# ---- greedy ------------------------------------------------------------------------------------

def test_greedy_takes_argmax_of_penalized_logits():
    logits = torch.tensor([[1.0, 3.0, 2.9, 2.0]]).repeat(4, 1)
    rows = [
        make_sampling_row(SamplingParams(temperature=0.0)),
        make_sampling_row(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=[1]),  # 3 -> 2
        make_sampling_row(SamplingParams(temperature=0.0, frequency_penalty=0.2), output=[1]),  # 3 -> 2.8
        make_sampling_row(SamplingParams(temperature=0.0, presence_penalty=-1.5), output=[3]),  # 2 -> 3.5
    ]
    assert Sampler()(logits, rows).token_ids == [1, 2, 2, 3]


@pytest.mark.parametrize("seed", range(10))
def test_greedy_equals_argmax_of_apply_penalties_on_random_rows(seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 100, generator=generator)
    history = torch.randint(0, 100, (4, 30), generator=generator).tolist()
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3)
    plain = logits.argmax(-1).tolist()
    # Each row has already produced its plain argmax 5 times: the penalties must move the choice.
    rows = [make_sampling_row(params, prompt=h[:10], output=h[10:] + [plain[i]] * 5) for i, h in enumerate(history)]
    expected = [int(torch.argmax(apply_penalties(logits[i], rows[i]))) for i in range(4)]
    assert Sampler()(logits, rows).token_ids == expected
    assert all(e != p for e, p in zip(expected, plain))


@pytest.mark.parametrize("seed", range(40))
def test_top_k_one_equals_greedy(seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 1000, generator=generator) * 3
    temperatures = (0.3, 1.0, 1.7, 5.0)
    rows = [make_sampling_row(SamplingParams(temperature=t, top_k=1), seed=seed * 10 + i)
            for i, t in enumerate(temperatures)]
    greedy = [make_sampling_row(SamplingParams(temperature=0.0)) for _ in temperatures]
    assert Sampler()(logits, rows).token_ids == Sampler()(logits, greedy).token_ids == logits.argmax(-1).tolist()


# ---- temperature, top-k, top-p, min-p ----------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.25, 0.5, 1.0, 2.0, 4.0])
def test_temperature_divides_logits(temperature):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.5])
    probs = filtered_probs(logits, SamplingParams(temperature=temperature))
    assert probs.tolist() == pytest.approx(torch.softmax(logits / temperature, -1).tolist(), abs=1e-7)


def test_temperature_sharpens_below_one_and_flattens_above():
    logits = torch.tensor([2.0, 1.0, 0.0])
    top = [float(filtered_probs(logits, SamplingParams(temperature=t))[0]) for t in (0.5, 1.0, 2.0)]
    assert top[0] > top[1] > top[2] > 1 / 3


@pytest.mark.parametrize("temperature", [1e-40, 1e-46, 1e-300])
def test_tiny_temperature_is_the_argmax_not_nan(temperature):
    # logits / temperature overflows to inf for these; the distribution must still be the argmax.
    logits = torch.tensor([1.0, 3.0, 0.0, float("-inf")])
    assert filtered_probs(logits, SamplingParams(temperature=temperature)).tolist() == [0.0, 1.0, 0.0, 0.0]
    rows = [make_sampling_row(SamplingParams(temperature=temperature), seed=s) for s in range(8)]
    assert Sampler()(logits.repeat(8, 1), rows).token_ids == [1] * 8


def test_top_k_keeps_the_k_most_likely():
    logits = torch.tensor([0.1, 0.4, 0.2, 0.3]).log()
    two = filtered_probs(logits, SamplingParams(top_k=2))
    assert kept(two) == [1, 3]
    assert two.tolist() == pytest.approx([0.0, 4 / 7, 0.0, 3 / 7], abs=1e-6)
    for disabled in (-1, 0, 4, 50):
        assert kept(filtered_probs(logits, SamplingParams(top_k=disabled))) == [0, 1, 2, 3]


def test_top_p_keeps_exactly_the_smallest_prefix_reaching_the_mass():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    probs = filtered_probs(logits, SamplingParams(top_p=0.8))
    assert kept(probs) == [0, 1]
    assert probs.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=1e-6)
    assert kept(filtered_probs(logits, SamplingParams(top_p=0.5))) == [0]
    assert kept(filtered_probs(logits, SamplingParams(top_p=0.49))) == [0]
    assert kept(filtered_probs(logits, SamplingParams(top_p=0.81))) == [0, 1, 2]
    assert kept(filtered_probs(logits, SamplingParams(top_p=0.96))) == [0, 1, 2, 3]
    assert kept(filtered_probs(logits, SamplingParams(top_p=1.0))) == [0, 1, 2, 3]


def test_top_p_follows_probability_order_not_token_order():
    logits = torch.tensor([0.05, 0.5, 0.15, 0.3]).log()
    probs = filtered_probs(logits, SamplingParams(top_p=0.8))
    assert kept(probs) == [1, 3]
    assert probs.tolist() == pytest.approx([0.0, 0.625, 0.0, 0.375], abs=1e-6)


def test_top_p_applies_to_the_temperature_scaled_distribution():
    # At temperature 2 these logits give back [0.5, 0.3, 0.15, 0.05]: top_p 0.9 keeps three tokens.
    # (Unscaled they would be [0.685, 0.247, 0.062, 0.007], where top_p 0.9 keeps two.)
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log() * 2
    assert kept(filtered_probs(logits, SamplingParams(temperature=2.0, top_p=0.9))) == [0, 1, 2]
    assert kept(filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.9))) == [0, 1]


def test_min_p_drops_tokens_below_min_p_times_max():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    probs = filtered_probs(logits, SamplingParams(min_p=0.45))  # threshold 0.18
    assert kept(probs) == [0, 1, 2]
    assert probs.tolist() == pytest.approx([4 / 9, 3 / 9, 2 / 9, 0.0], abs=1e-6)
    assert kept(filtered_probs(logits, SamplingParams(min_p=0.6))) == [0, 1]  # threshold 0.24
    assert kept(filtered_probs(logits, SamplingParams(min_p=0.8))) == [0]  # threshold 0.32
    assert kept(filtered_probs(logits, SamplingParams(min_p=1.0))) == [0]
    assert kept(filtered_probs(logits, SamplingParams(min_p=0.0))) == [0, 1, 2, 3]


def test_filters_combine():
    logits = torch.tensor([0.05, 0.35, 0.25, 0.2, 0.15]).log()
    # top_k 4 drops token 0; top_p 0.7 (of the remaining 0.95) then drops 0.15; min_p 0.6 drops < 0.21
    assert kept(filtered_probs(logits, SamplingParams(top_k=4, top_p=0.7))) == [1, 2, 3]
    probs = filtered_probs(logits, SamplingParams(top_k=4, top_p=0.7, min_p=0.6))
    assert kept(probs) == [1, 2]
    assert probs.tolist() == pytest.approx([0.0, 0.35 / 0.6, 0.25 / 0.6, 0.0, 0.0], abs=1e-6)


# ---- seeded draws ------------------------------------------------------------------------------

def draw_sequence(steps: torch.Tensor, batch_mates: list, position: int, params: SamplingParams) -> list[int]:
    """Tokens of a row sampled at `position` among `batch_mates` for each step's logits [steps, vocab]."""
    mates = [make_sampling_row(p, seed=100 + i) for i, p in enumerate(batch_mates)]
    rows = mates[:position] + [make_sampling_row(params)] + mates[position:]
    sampler = Sampler()
    tokens = []
    for step_logits in steps:
        noise = torch.randn(len(rows), step_logits.shape[0], generator=torch.Generator().manual_seed(len(tokens)))
        batch = noise.clone()
        batch[position] = step_logits
        tokens.append(sampler(batch, rows).token_ids[position])
    return tokens


def test_seeded_row_gives_the_same_tokens_alone_and_in_any_batch_position():
    steps = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=42)
    alone = draw_sequence(steps, [], 0, params)
    mates = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0), SamplingParams(seed=7, top_k=5),
             SamplingParams(repetition_penalty=1.2, top_p=0.9)]
    assert draw_sequence(steps, mates[:1], 0, params) == alone
    assert draw_sequence(steps, mates[:1], 1, params) == alone
    assert draw_sequence(steps, mates, 2, params) == alone
    assert draw_sequence(steps, mates[::-1], 4, params) == alone
    # The reference: one generator seeded 42 drawing from each step's softmax.
    generator = torch.Generator().manual_seed(42)
    assert alone == [sample_from(torch.softmax(s, -1), generator) for s in steps]
    assert len(set(alone)) > 10  # really random draws, not a constant


def test_two_rows_with_the_same_seed_in_one_batch_draw_the_same_tokens():
    logits = torch.zeros(2, 1000)
    rows = [make_sampling_row(SamplingParams(seed=5)), make_sampling_row(SamplingParams(seed=5))]
    draws = [Sampler()(logits, rows).token_ids for _ in range(30)]
    assert all(a == b for a, b in draws)
    assert len({a for a, _ in draws}) > 20


def test_different_seeds_give_different_sequences():
    logits = torch.zeros(1, 64)
    sequences = set()
    for seed in range(10):
        row = make_sampling_row(SamplingParams(seed=seed))
        sequences.add(tuple(Sampler()(logits, [row]).token_ids[0] for _ in range(50)))
    assert len(sequences) == 10


def test_draw_frequencies_follow_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.0, 0.15, 0.1])
    generator = torch.Generator().manual_seed(7)
    counts = torch.bincount(torch.tensor([sample_from(probs, generator) for _ in range(20000)]), minlength=5)
    assert int(counts[2]) == 0  # zero probability is never drawn
    nonzero = [0, 1, 3, 4]
    assert chi_square(counts[nonzero], probs[nonzero]) < 16.27  # p = 0.001 at 3 degrees of freedom
    assert chi_square(counts[nonzero], torch.full((4,), 0.25)) > 1000  # the bound can reject


def test_filtered_draws_follow_the_renormalized_distribution():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    probs = filtered_probs(logits, SamplingParams(top_p=0.9))  # [0.5, 0.3, 0.15] / 0.95
    generator = torch.Generator().manual_seed(11)
    counts = torch.bincount(torch.tensor([sample_from(probs, generator) for _ in range(20000)]), minlength=4)
    assert int(counts[3]) == 0
    assert chi_square(counts[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95) < 13.82  # p = 0.001 at 2 dof


# ---- logprobs ----------------------------------------------------------------------------------

def test_logprobs_are_of_the_raw_distribution_with_exact_rank_and_sorted_top():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3)) * 2
    rows = [
        make_sampling_row(SamplingParams(temperature=0.0, logprobs=5)),
        make_sampling_row(SamplingParams(temperature=0.5, top_k=10, repetition_penalty=1.5, logprobs=3),
                          prompt=list(range(25)), seed=1),
        make_sampling_row(SamplingParams(temperature=1.0)),
        make_sampling_row(SamplingParams(temperature=2.0, logprobs=0), seed=2),
    ]
    result = Sampler()(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert result.logprobs[2] is None
    for index in (0, 1, 3):
        entry, token_id = result.logprobs[index], result.token_ids[index]
        order = sorted(range(50), key=lambda t: -float(raw[index, t]))
        assert entry.token_id == token_id
        assert entry.logprob == float(raw[index, token_id])
        assert entry.rank == order.index(token_id) + 1
        assert entry.top == tuple((t, float(raw[index, t])) for t in order[:rows[index].params.logprobs])
    assert result.logprobs[0].rank == 1 and result.logprobs[0].token_id == int(logits[0].argmax())
    assert result.logprobs[3].top == ()


def test_logprobs_ignore_the_penalty_that_moved_the_choice():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    row = make_sampling_row(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=10.0), prompt=[1])
    entry = Sampler()(logits, [row]).logprobs[0]
    raw = torch.log_softmax(logits[0], -1)
    assert (entry.token_id, entry.rank) == (2, 2)  # penalty moved the choice off token 1
    assert entry.logprob == float(raw[2])
    assert entry.top == ((1, float(raw[1])), (2, float(raw[2])))
