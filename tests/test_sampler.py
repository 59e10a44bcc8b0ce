"""Sampler: exact penalty arithmetic, filters, seeded draws and logprobs (pure tensors, no model), and
bit-for-bit equality of the batched sampler with the per-row reference (testing/sampler_oracle.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.factories import make_sampling_row
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine import sampler
from splitserve.engine.sampler import Sampler, SamplingRow, draw, filtered_probs, penalized, token_counts
from splitserve.engine.structured_output.bitmask import TokenBitmask
from splitserve.testing import sampler_oracle as oracle

ORACLE_SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None)
LONG_VOCAB = 40_000
"""Above torch's reduction grain (32768): a row summed alone is split across threads."""


def kept(probs: torch.Tensor) -> list[int]:
    """Token ids with nonzero probability, ascending."""
    return torch.nonzero(probs).flatten().tolist()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def penalized_row(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """One row's logits [vocab] after its penalties."""
    return penalized(logits.unsqueeze(0), [row])[0]


def probs_of(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's filtered distribution [vocab]."""
    return filtered_probs(logits.unsqueeze(0), [params])[0]


def sample_one(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(draw(probs.unsqueeze(0), [generator])[0])


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def torch_threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


# ---- penalties ---------------------------------------------------------------------------------

def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 4.0, 0.0, -3.0])
    row = make_sampling_row(SamplingParams(repetition_penalty=2.0), prompt=[0, 1, 5], output=[1, 4, 6])
    # seen = {0, 1, 4, 5, 6}: 2 -> 1, -2 -> -4, 4 -> 2, 0 stays 0, -3 -> -6; tokens 2 and 3 untouched
    assert torch.equal(penalized_row(logits, row), torch.tensor([1.0, -4.0, 1.0, -1.0, 2.0, 0.0, -6.0]))


def test_repetition_penalty_below_one_encourages_seen_tokens():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0])
    row = make_sampling_row(SamplingParams(repetition_penalty=0.5), prompt=[0], output=[1])
    assert torch.equal(penalized_row(logits, row), torch.tensor([4.0, -1.0, 1.0, -1.0]))


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
    assert torch.equal(penalized_row(logits, row), torch.tensor(expected))


def test_frequency_and_presence_penalties_need_output_tokens():
    logits = torch.tensor([1.0, 2.0, 3.0])
    row = make_sampling_row(SamplingParams(frequency_penalty=2.0, presence_penalty=2.0), prompt=[0, 1, 2])
    assert torch.equal(penalized_row(logits, row), logits)


def test_repetition_penalty_applies_before_frequency_and_presence():
    logits = torch.tensor([4.0, -2.0, 1.0])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0)
    row = make_sampling_row(params, output=[0, 1, 0])
    # repetition: [2, -4, 1]; then counts [2, 1, 0] subtract [2.0, 1.5, 0] (the other order gives [1, -7, 1])
    assert torch.equal(penalized_row(logits, row), torch.tensor([0.0, -5.5, 1.0]))


def test_penalties_of_a_batch_touch_only_each_rows_own_tokens():
    logits = torch.tensor([[2.0, 2.0, 2.0, 2.0]]).repeat(4, 1)
    rows = [
        make_sampling_row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[3]),
        make_sampling_row(SamplingParams(), prompt=[1], output=[2]),  # no penalty: untouched
        make_sampling_row(SamplingParams(frequency_penalty=0.5), prompt=[0], output=[1, 1]),
        make_sampling_row(SamplingParams(repetition_penalty=4.0, presence_penalty=1.0), prompt=[2], output=[2]),
    ]
    assert penalized(logits, rows).tolist() == [[1.0, 2.0, 2.0, 1.0], [2.0, 2.0, 2.0, 2.0], [2.0, 1.0, 2.0, 2.0],
                               [2.0, 2.0, -0.5, 2.0]]


def test_token_counts_count_each_list_into_its_own_row():
    counts = token_counts([[1, 1, 4], [], [0, 4, 4, 4], [2]], 5, torch.device("cpu"))
    assert counts.tolist() == [[0, 2, 0, 0, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 3], [0, 0, 1, 0, 0]]


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
def test_greedy_equals_argmax_of_the_penalized_logits_on_random_rows(seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 100, generator=generator)
    history = torch.randint(0, 100, (4, 30), generator=generator).tolist()
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3)
    plain = logits.argmax(-1).tolist()
    # Each row has already produced its plain argmax 5 times: the penalties must move the choice.
    rows = [make_sampling_row(params, prompt=h[:10], output=h[10:] + [plain[i]] * 5) for i, h in enumerate(history)]
    expected = [int(torch.argmax(penalized_row(logits[i], rows[i]))) for i in range(4)]
    assert Sampler()(logits, rows).token_ids == expected
    assert all(e != p for e, p in zip(expected, plain))


def test_greedy_rows_draw_no_noise():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    rows = [make_sampling_row(SamplingParams(temperature=0.0, repetition_penalty=r), prompt=[1, 2], seed=i)
            for i, r in enumerate((1.0, 1.5, 1.0))]
    before = [row.generator.get_state() for row in rows]
    Sampler()(logits, rows)
    assert all(torch.equal(row.generator.get_state(), state) for row, state in zip(rows, before))


def test_the_sampler_leaves_its_logits_unchanged():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    original = logits.clone()
    rows = [make_sampling_row(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=list(range(50))),
            make_sampling_row(SamplingParams(top_k=5, frequency_penalty=1.0), output=list(range(25))),
            make_sampling_row(SamplingParams(top_p=0.5, logprobs=2))]
    Sampler()(logits, rows)
    assert torch.equal(logits, original)


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
    probs = probs_of(logits, SamplingParams(temperature=temperature))
    assert probs.tolist() == pytest.approx(torch.softmax(logits / temperature, -1).tolist(), abs=1e-7)


def test_temperature_sharpens_below_one_and_flattens_above():
    logits = torch.tensor([2.0, 1.0, 0.0])
    top = [float(probs_of(logits, SamplingParams(temperature=t))[0]) for t in (0.5, 1.0, 2.0)]
    assert top[0] > top[1] > top[2] > 1 / 3


@pytest.mark.parametrize("temperature", [1e-40, 1e-46, 1e-300])
def test_tiny_temperature_is_the_argmax_not_nan(temperature):
    # logits / temperature overflows to inf for these; the distribution must still be the argmax.
    logits = torch.tensor([1.0, 3.0, 0.0, float("-inf")])
    assert probs_of(logits, SamplingParams(temperature=temperature)).tolist() == [0.0, 1.0, 0.0, 0.0]
    rows = [make_sampling_row(SamplingParams(temperature=temperature), seed=s) for s in range(8)]
    assert Sampler()(logits.repeat(8, 1), rows).token_ids == [1] * 8


def test_top_k_keeps_the_k_most_likely():
    logits = torch.tensor([0.1, 0.4, 0.2, 0.3]).log()
    two = probs_of(logits, SamplingParams(top_k=2))
    assert kept(two) == [1, 3]
    assert two.tolist() == pytest.approx([0.0, 4 / 7, 0.0, 3 / 7], abs=1e-6)
    for disabled in (-1, 0, 4, 50):
        assert kept(probs_of(logits, SamplingParams(top_k=disabled))) == [0, 1, 2, 3]


def test_top_p_keeps_exactly_the_smallest_prefix_reaching_the_mass():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    probs = probs_of(logits, SamplingParams(top_p=0.8))
    assert kept(probs) == [0, 1]
    assert probs.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=1e-6)
    assert kept(probs_of(logits, SamplingParams(top_p=0.5))) == [0]
    assert kept(probs_of(logits, SamplingParams(top_p=0.49))) == [0]
    assert kept(probs_of(logits, SamplingParams(top_p=0.81))) == [0, 1, 2]
    assert kept(probs_of(logits, SamplingParams(top_p=0.96))) == [0, 1, 2, 3]
    assert kept(probs_of(logits, SamplingParams(top_p=1.0))) == [0, 1, 2, 3]


def test_top_p_follows_probability_order_not_token_order():
    logits = torch.tensor([0.05, 0.5, 0.15, 0.3]).log()
    probs = probs_of(logits, SamplingParams(top_p=0.8))
    assert kept(probs) == [1, 3]
    assert probs.tolist() == pytest.approx([0.0, 0.625, 0.0, 0.375], abs=1e-6)


def test_top_p_applies_to_the_temperature_scaled_distribution():
    # At temperature 2 these logits give back [0.5, 0.3, 0.15, 0.05]: top_p 0.9 keeps three tokens.
    # (Unscaled they would be [0.685, 0.247, 0.062, 0.007], where top_p 0.9 keeps two.)
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log() * 2
    assert kept(probs_of(logits, SamplingParams(temperature=2.0, top_p=0.9))) == [0, 1, 2]
    assert kept(probs_of(logits, SamplingParams(temperature=1.0, top_p=0.9))) == [0, 1]


def test_min_p_drops_tokens_below_min_p_times_max():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    probs = probs_of(logits, SamplingParams(min_p=0.45))  # threshold 0.18
    assert kept(probs) == [0, 1, 2]
    assert probs.tolist() == pytest.approx([4 / 9, 3 / 9, 2 / 9, 0.0], abs=1e-6)
    assert kept(probs_of(logits, SamplingParams(min_p=0.6))) == [0, 1]  # threshold 0.24
    assert kept(probs_of(logits, SamplingParams(min_p=0.8))) == [0]  # threshold 0.32
    assert kept(probs_of(logits, SamplingParams(min_p=1.0))) == [0]
    assert kept(probs_of(logits, SamplingParams(min_p=0.0))) == [0, 1, 2, 3]


def test_filters_combine():
    logits = torch.tensor([0.05, 0.35, 0.25, 0.2, 0.15]).log()
    # top_k 4 drops token 0; top_p 0.7 (of the remaining 0.95) then drops 0.15; min_p 0.6 drops < 0.21
    assert kept(probs_of(logits, SamplingParams(top_k=4, top_p=0.7))) == [1, 2, 3]
    probs = probs_of(logits, SamplingParams(top_k=4, top_p=0.7, min_p=0.6))
    assert kept(probs) == [1, 2]
    assert probs.tolist() == pytest.approx([0.0, 0.35 / 0.6, 0.25 / 0.6, 0.0, 0.0], abs=1e-6)


def test_each_row_of_a_batch_gets_its_own_filters():
    logits = torch.tensor([0.05, 0.35, 0.25, 0.2, 0.15]).log().repeat(5, 1)
    params = [SamplingParams(top_k=2), SamplingParams(), SamplingParams(top_p=0.5), SamplingParams(min_p=0.6),
              SamplingParams(top_k=3, min_p=0.7)]
    assert [kept(row) for row in filtered_probs(logits, params)] == [[1, 2], [0, 1, 2, 3, 4], [1, 2], [1, 2],
                                                                     [1, 2]]


@pytest.mark.parametrize("seed", range(10))
def test_top_p_after_top_k_cuts_a_tie_where_the_full_sort_does(seed):
    # After top_k 5: one token at 0.4 and four tied at 0.15; top_p 0.6 keeps two of the tied four.
    # The head (topk) may order the tie unlike torch.sort; the sampler must drop the same two.
    tokens = torch.randperm(64, generator=torch.Generator().manual_seed(seed))
    logits = torch.full((64,), -30.0)
    logits[tokens[0]], logits[tokens[1:5]] = math.log(0.4), math.log(0.15)
    params = SamplingParams(top_k=5, top_p=0.6)
    expected = oracle.filtered_probs(logits, params)
    assert len(kept(expected)) == 3
    assert torch.equal(probs_of(logits, params), expected)


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
    assert alone == [oracle.sample_from(torch.softmax(s, -1), generator) for s in steps]
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


def test_rows_sharing_a_generator_draw_from_it_in_row_order():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(4))
    shared = torch.Generator().manual_seed(9)
    rows = [SamplingRow(SamplingParams(temperature=t), [], 0, shared) for t in (0.5, 1.0, 2.0)]
    reference = torch.Generator().manual_seed(9)
    expected = [oracle.sample_from(oracle.filtered_probs(logits[i], rows[i].params), reference) for i in range(3)]
    assert Sampler()(logits, rows).token_ids == expected
    assert torch.equal(shared.get_state(), reference.get_state())


def test_draw_frequencies_follow_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.0, 0.15, 0.1])
    generator = torch.Generator().manual_seed(7)
    counts = torch.bincount(draw(probs.repeat(20000, 1), [generator] * 20000), minlength=5)
    assert int(counts[2]) == 0  # zero probability is never drawn
    nonzero = [0, 1, 3, 4]
    assert chi_square(counts[nonzero], probs[nonzero]) < 16.27  # p = 0.001 at 3 degrees of freedom
    assert chi_square(counts[nonzero], torch.full((4,), 0.25)) > 1000  # the bound can reject


def test_filtered_draws_follow_the_renormalized_distribution():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    probs = probs_of(logits, SamplingParams(top_p=0.9))  # [0.5, 0.3, 0.15] / 0.95
    generator = torch.Generator().manual_seed(11)
    counts = torch.bincount(torch.tensor([sample_one(probs, generator) for _ in range(20000)]), minlength=4)
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


def test_tied_top_alternatives_do_not_depend_on_what_batch_mates_ask_for():
    # All logprobs tie: which ids topk returns depends on k, so each row must get its own k.
    logits = torch.zeros(4, 100)
    rows = [make_sampling_row(SamplingParams(temperature=0.0, logprobs=k)) for k in (3, 5, 1, 3)]
    tops = [entry.top for entry in Sampler()(logits, rows).logprobs]
    alone = [Sampler()(logits[:1], [row]).logprobs[0].top for row in rows]
    assert tops == alone
    assert [len(top) for top in tops] == [3, 5, 1, 3]


# ---- equality with the per-row reference (testing/sampler_oracle.py) -----------------------------

def reference_rows(rows: list[SamplingRow]) -> list[oracle.SamplingRow]:
    """The oracle's rows for the same requests: own token lists and generators in the same states (rows
    that share a generator share its copy)."""
    copies: dict[int, torch.Generator] = {}
    for row in rows:
        copies.setdefault(id(row.generator), torch.Generator().set_state(row.generator.get_state()))
    return [oracle.SamplingRow(row.params, row.all_token_ids[:row.num_prompt_tokens], row.output_token_ids,
                               copies[id(row.generator)]) for row in rows]


def step_logits(kind: str, batch: int, vocab_size: int, seed: int) -> torch.Tensor:
    """[batch, vocab] float32 logits: plain, widely spread, full of ties, or partly -inf (token 0 finite)."""
    logits = torch.randn(batch, vocab_size, generator=torch.Generator().manual_seed(seed))
    if kind == "wide":
        return logits * 30
    if kind == "ties":
        return (logits * 2).to(torch.bfloat16).float().round()
    if kind == "masked":
        masked = torch.rand(batch, vocab_size, generator=torch.Generator().manual_seed(seed + 1)) < 0.5
        masked[:, 0] = False
        return logits.masked_fill(masked, float("-inf"))
    return logits * 2


def sampling_params(vocab_size: int) -> st.SearchStrategy[SamplingParams]:
    """Every option, each often at its neutral value."""
    penalty = st.one_of(st.just(0.0), st.floats(-2.0, 2.0))
    return st.builds(
        SamplingParams,
        temperature=st.one_of(st.just(0.0), st.sampled_from([1e-40, 0.5, 1.0]), st.floats(0.05, 3.0)),
        top_k=st.one_of(st.sampled_from([-1, 0, 1]), st.integers(1, vocab_size + 2)),
        top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
        min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
        repetition_penalty=st.one_of(st.just(1.0), st.floats(0.25, 4.0)),
        frequency_penalty=penalty, presence_penalty=penalty,
        seed=st.one_of(st.none(), st.integers(0, 3)),
        logprobs=st.one_of(st.none(), st.integers(0, min(vocab_size, 5))),
        **logit_controls(vocab_size))


def logit_controls(vocab_size: int) -> dict[str, st.SearchStrategy]:
    """logit_bias, allowed_token_ids and bad words, each often absent. Token 0 stays possible (always
    allowed, never a bad word's last token) so that a "masked" row keeps a finite logit; ids may be
    out of the vocabulary (the sampler skips them; the APIs refuse them)."""
    token = st.integers(0, vocab_size + 1)
    bias = st.one_of(st.sampled_from([-100.0, 100.0, 0.0]), st.floats(-100.0, 100.0))
    word_end = st.integers(1, vocab_size - 1) if vocab_size > 1 else st.nothing()
    word = st.builds(lambda prefix, last: (*prefix, last), st.lists(st.integers(0, vocab_size - 1), max_size=2),
                     word_end)
    return {"logit_bias": st.one_of(st.just({}), st.dictionaries(token, bias, max_size=6)),
            "allowed_token_ids": st.one_of(st.none(), st.lists(token, max_size=5).map(lambda ids: [0, *ids])),
            "bad_words_token_ids": st.one_of(st.just(()), st.lists(word, max_size=3))}


@st.composite
def batches(draw_from, vocab_sizes=st.sampled_from([1, 2, 7, 64, 300])) -> tuple[list[SamplingRow], int]:
    """(rows, vocab size): rows without a seed share one generator, as in the engine."""
    vocab_size = draw_from(vocab_sizes)
    tokens = st.lists(st.integers(0, vocab_size - 1), max_size=12)
    shared = torch.Generator().manual_seed(draw_from(st.integers(0, 2 ** 16)))
    rows = []
    for params in draw_from(st.lists(sampling_params(vocab_size), min_size=1, max_size=6)):
        prompt, output = draw_from(tokens), draw_from(tokens)
        generator = shared if params.seed is None else torch.Generator().manual_seed(params.seed)
        rows.append(SamplingRow(params, prompt + output, len(prompt), generator))
    return rows, vocab_size


def assert_sampler_equals_oracle(rows: list[SamplingRow], logits: torch.Tensor) -> list[int]:
    """One step of both samplers on the same rows; returns the sampled token ids."""
    references = reference_rows(rows)
    expected = oracle.Sampler()(logits, references)
    result = Sampler()(logits, rows)
    assert result.token_ids == expected.token_ids
    assert result.logprobs == expected.logprobs
    for row, reference in zip(rows, references):
        assert torch.equal(row.generator.get_state(), reference.generator.get_state())
    return result.token_ids


@ORACLE_SETTINGS
@given(batch=batches(), kind=st.sampled_from(["plain", "wide", "ties", "masked"]), seed=st.integers(0, 2 ** 16))
def test_the_sampler_equals_the_per_row_reference(batch, kind, seed):
    rows, vocab_size = batch
    for step in range(3):
        token_ids = assert_sampler_equals_oracle(rows, step_logits(kind, len(rows), vocab_size, seed + step))
        for row, token_id in zip(rows, token_ids):
            row.all_token_ids.append(token_id)


@ORACLE_SETTINGS
@given(batch=batches(), kind=st.sampled_from(["plain", "wide", "ties", "masked"]), seed=st.integers(0, 2 ** 16))
def test_penalties_and_filters_equal_the_per_row_reference_bit_for_bit(batch, kind, seed):
    rows, vocab_size = batch
    logits = step_logits(kind, len(rows), vocab_size, seed)
    penalties = penalized(logits, rows)
    references = reference_rows(rows)
    assert torch.equal(penalties, torch.stack([oracle.apply_penalties(logits[i], r) for i, r in enumerate(references)]))
    params = [row.params for row in rows]
    expected = torch.stack([oracle.filtered_probs(penalties[i], p) for i, p in enumerate(params)])
    assert torch.equal(filtered_probs(penalties, params), expected)


@settings(ORACLE_SETTINGS, max_examples=100)
@given(batch=batches(st.sampled_from([7, 64])), kind=st.sampled_from(["plain", "ties"]), seed=st.integers(0, 2 ** 16))
def test_rows_cut_in_chunks_equal_the_per_row_reference(batch, kind, seed):
    rows, vocab_size = batch
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampler, "CPU_CHUNK_LOGITS", 2 * vocab_size)  # two rows per chunk
        assert_sampler_equals_oracle(rows, step_logits(kind, len(rows), vocab_size, seed))


@pytest.mark.parametrize("seed", range(3))
def test_long_vocab_rows_equal_the_reference_and_do_not_depend_on_the_batch(torch_threads, seed):
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=seed), SamplingParams(temperature=1.3, top_k=500),
              SamplingParams(top_p=0.5, min_p=0.01, repetition_penalty=1.2, frequency_penalty=0.5, logprobs=3),
              SamplingParams(temperature=0.0, presence_penalty=1.0, logprobs=1)]
    shared = torch.Generator().manual_seed(seed)
    rows = [SamplingRow(p, list(range(0, LONG_VOCAB, 7)), 100, torch.Generator().manual_seed(p.seed)
                        if p.seed is not None else shared) for p in params]
    logits = step_logits("plain", len(rows), LONG_VOCAB, seed)
    assert_sampler_equals_oracle(rows, logits)
    probs = filtered_probs(logits, params)
    for index, row_params in enumerate(params):
        assert torch.equal(filtered_probs(logits[index:index + 1], [row_params])[0], probs[index])


def test_banned_tokens_are_never_sampled_greedy_or_not():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [0.0, 5.0, 4.0, 1.0]])
    greedy = make_sampling_row(SamplingParams(temperature=0.0))
    banned = SamplingRow(greedy.params, [], 0, greedy.generator, banned_token_ids=(1, 2))
    assert Sampler()(logits, [greedy, banned]).token_ids == [1, 3]
    hot = make_sampling_row(SamplingParams(temperature=5.0, seed=3))
    rows = [SamplingRow(hot.params, [], 0, torch.Generator().manual_seed(seed), banned_token_ids=(1, 2))
            for seed in range(50)]
    assert set(Sampler()(logits[:1].expand(50, 4), rows).token_ids) == {0, 3}


# ---- logit controls: logit_bias, allowed_token_ids, bad words -----------------------------------

def test_logit_controls_mask_then_bias_before_penalties():
    logits = torch.arange(1.0, 11.0)
    params = SamplingParams(allowed_token_ids=[0, 1, 2, 4], logit_bias={"1": 2.5, 3: 100, 4: -1.0},
                            bad_words_token_ids=[(7, 2), (9, 0)], repetition_penalty=2.0)
    row = make_sampling_row(params, prompt=[9], output=[4, 7])
    # 3 and 5-9 outside the allowed ids, 2 a bad word after 7 (the word after 9 does not match: 9 is the
    # prompt's); then 2 + 2.5 and 5 - 1 = 4, divided by 2 (token 4 was seen)
    assert penalized_row(logits, row).tolist() == [1.0, 4.5, -math.inf, -math.inf, 2.0] + [-math.inf] * 5


def test_a_one_token_bad_word_is_always_banned_and_a_longer_one_only_after_its_prefix():
    logits = torch.zeros(5)
    params = SamplingParams(bad_words_token_ids=[(3,), (1, 2, 4)])
    assert penalized_row(logits, make_sampling_row(params, output=[1, 2])).tolist() == [0, 0, 0, -math.inf, -math.inf]
    assert penalized_row(logits, make_sampling_row(params, output=[2, 1])).tolist() == [0, 0, 0, -math.inf, 0]
    assert penalized_row(logits, make_sampling_row(params, prompt=[1], output=[2])).tolist() == [0, 0, 0, -math.inf, 0]


def test_greedy_with_a_logit_bias_takes_the_biased_token():
    logits = torch.tensor([[3.0, 9.0, -2.0, 0.5]])
    row = make_sampling_row(SamplingParams(temperature=0.0, logit_bias={2: 100.0}))
    assert Sampler()(logits, [row]).token_ids == [2]
    assert Sampler()(logits, [make_sampling_row(SamplingParams(temperature=0.0, logit_bias={1: -100.0}))]
                     ).token_ids == [0]


@pytest.mark.parametrize("temperature", [0.0, 1.0, 50.0])
def test_sampled_tokens_stay_in_the_allowed_ids_and_avoid_bad_words(temperature):
    logits = torch.randn(64, 40, generator=torch.Generator().manual_seed(1)) * 3
    params = SamplingParams(temperature=temperature, allowed_token_ids=[3, 5, 8, 13, 21],
                            bad_words_token_ids=[(13,), (5, 8)])
    rows = [make_sampling_row(params, output=[5], seed=seed) for seed in range(64)]
    token_ids = Sampler()(logits, rows).token_ids
    # 13 is always a bad word, 8 one after 5
    candidates = torch.tensor([3, 5, 21])
    if temperature == 0.0:
        assert token_ids == candidates[logits[:, candidates].argmax(dim=-1)].tolist()
    else:
        assert set(token_ids) == {3, 5, 21}


def test_seeded_rows_with_logit_controls_do_not_depend_on_batch_mates():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=0.9, top_p=0.8, seed=11, logit_bias={7: 4.0, 9: -3.0},
                            allowed_token_ids=list(range(0, 50, 2)), bad_words_token_ids=[(1, 2), (4,)])
    mates = [SamplingParams(temperature=0.0, logit_bias={0: 50.0}), SamplingParams(top_k=3, seed=5),
             SamplingParams(allowed_token_ids=[1], presence_penalty=1.0)]
    alone = Sampler()(logits[:1], [make_sampling_row(params, output=[1])]).token_ids[0]
    for position in range(4):
        batch = [make_sampling_row(p, output=[1]) for p in mates]
        batch.insert(position, make_sampling_row(params, output=[1]))
        batch_logits = torch.cat([logits[1:position + 1], logits[:1], logits[position + 1:]])
        assert Sampler()(batch_logits, batch).token_ids[position] == alone


@ORACLE_SETTINGS
@given(batch=batches(st.sampled_from([7, 64])), seed=st.integers(0, 2 ** 16))
def test_grammar_masks_compose_with_logit_controls_as_in_the_per_row_reference(batch, seed):
    rows, vocab_size = batch
    logits = step_logits("plain", len(rows), vocab_size, seed)
    bits = torch.rand(len(rows), vocab_size, generator=torch.Generator().manual_seed(seed)) < 0.6
    bits[:, 0] = True  # the grammar always allows token 0 (so do the controls): no row is all -inf
    words = torch.zeros(len(rows), (vocab_size + 31) // 32, dtype=torch.int64)
    for column in range(vocab_size):
        words[:, column // 32] |= bits[:, column].long() << (column % 32)
    grammar = TokenBitmask(tuple(range(len(rows))), words.to(torch.int32))
    references = reference_rows(rows)
    expected = oracle.Sampler()(grammar.applied_to(logits), references)
    assert Sampler()(logits, rows, grammar).token_ids == expected.token_ids
