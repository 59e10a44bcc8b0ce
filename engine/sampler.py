"""Token sampling, batched: logit controls, penalties, greedy, temperature / top-k / top-p / min-p, seeded
draws, logprobs.

Order of logit processing, per row (vLLM's order):
  0. logit controls: tokens outside allowed_token_ids, banned tokens (min_tokens) and the last token of
     each bad word whose other tokens end the output at -inf, then logit_bias added
  1. repetition penalty over prompt + output tokens (positive logits divided, negative multiplied)
  2. frequency and presence penalties over output tokens (subtracted)
  3. greedy rows take the argmax here
  4. temperature, then top-k, top-p and min-p masks on the resulting distribution
  5. a draw by the exponential race (argmax of p / E, E ~ Exp(1)) from the row's own generator,
     so a seeded request's tokens do not depend on its batch mates.
Logprobs are of the raw model distribution (before any processing), as in vLLM; a structured-output
row's grammar mask comes before everything (its disallowed tokens are -inf from the start).

A step runs each stage as one set of tensor ops over the rows that need it (on CPU, per chunk of
rows small enough to stay in cache, CPU_CHUNK_LOGITS): greedy rows without penalties cost one
argmax over the batch, token counts are built only for rows with a penalty, and each filter runs
only on the rows that set it (top-p orders only the nonzero head of rows that a top-k has cut,
instead of sorting the vocabulary). Two things stay one row at a time, so that a row's result
never depends on its batch mates: the noise E, drawn from the row's own generator (rows sharing a
generator draw in row order), and the sums that renormalize a distribution (torch sums a long row
alone split across threads, in another order than one row of a batch). On CPU the result equals
the per-row sampler this replaced (testing/sampler_oracle.py) bit for bit, tokens and logprobs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.token_logprobs import TokenLogprobs
from splitserve.engine.structured_output.bitmask import TokenBitmask

CPU_CHUNK_LOGITS = 1 << 20
"""On CPU, rows with a penalty or a draw go through in chunks of at most this many logits (4 MiB
in float32), so that each op's tensors stay in cache: over [256, 32000] logits every op would
stream 32 MiB through memory, and the step takes 1.5x as long."""
HEAD_FRACTION = 8
"""top-p orders only the nonzero head of each row when it is at most 1 / HEAD_FRACTION of the vocab."""


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    all_token_ids: list[int]
    """Prompt followed by the output so far: the request's own list, read only for penalties."""
    num_prompt_tokens: int
    generator: torch.Generator
    banned_token_ids: tuple[int, ...] = ()
    """Tokens this row may not sample now (EOS and stop tokens before min_tokens): their logits
    become -inf before any other processing."""

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 allowed: TokenBitmask | None = None) -> SamplerOutput:
        """logits: [len(rows), vocab]; returns one token (and optional logprobs) per row. `allowed`:
        the grammar masks of structured-output rows, applied first (logprobs included, as in vLLM)."""
        logits = logits.float()  # [B, vocab] float32; never modified
        if allowed is not None:
            logits = allowed.applied_to(logits)
        processed = [i for i, row in enumerate(rows) if not _is_plain_greedy(row)]
        # [B] int64. Greedy rows without penalties (the common case) cost only this argmax.
        token_ids = (torch.argmax(logits, dim=-1) if len(processed) < len(rows)
                     else torch.empty(len(rows), dtype=torch.long, device=logits.device))
        for chunk in _chunks(processed, logits):
            token_ids[chunk] = _penalized_or_sampled(_take(logits, chunk), [rows[i] for i in chunk])
        return SamplerOutput(token_ids.tolist(), _logprobs(logits, rows, token_ids))


def _is_plain_greedy(row: SamplingRow) -> bool:
    params = row.params
    return params.is_greedy and params.repetition_penalty == 1.0 and not (
        params.frequency_penalty or params.presence_penalty or row.banned_token_ids or params.has_logit_controls)


def _penalized_or_sampled(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Token ids [n] of rows with a penalty or a draw; logits [n, vocab] float32 (not modified)."""
    logits = penalized(logits, rows)
    greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
    sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)  # [n]
    if greedy:
        token_ids[greedy] = torch.argmax(_take(logits, greedy), dim=-1)
    if sampled:
        probs = filtered_probs(_take(logits, sampled), [rows[i].params for i in sampled])
        token_ids[sampled] = draw(probs, [rows[i].generator for i in sampled])
    return token_ids


def _chunks(index: list[int], logits: torch.Tensor) -> list[list[int]]:
    """index cut in runs of at most CPU_CHUNK_LOGITS logits on CPU (whole on other devices)."""
    size = max(1, CPU_CHUNK_LOGITS // logits.shape[1]) if logits.device.type == "cpu" else max(1, len(index))
    return [index[start:start + size] for start in range(0, len(index), size)]


def _take(tensor: torch.Tensor, index: list[int]) -> torch.Tensor:
    """tensor[index] for an ascending index; the tensor itself (not a copy) when the index covers every row."""
    return tensor if len(index) == tensor.shape[0] else tensor[index]


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """[len(values), 1] tensor with like's dtype and device."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


# ---- penalties ---------------------------------------------------------------------------------

def penalized(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """logits [n, vocab] after each row's logit controls (allowed_token_ids, banned tokens, bad words,
    logit_bias), then its repetition, frequency and presence penalties: a new tensor when any row
    has one, else logits itself."""
    repeated = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    counted = [i for i, row in enumerate(rows) if (row.params.frequency_penalty or row.params.presence_penalty)
               and len(row.all_token_ids) > row.num_prompt_tokens]
    controlled = [i for i, row in enumerate(rows) if row.banned_token_ids or row.params.has_logit_controls]
    if not (repeated or counted or controlled):
        return logits
    logits = logits.clone()
    if controlled:
        _apply_logit_controls(logits, rows, controlled)
    if repeated:
        logits[repeated] = _repetition_penalized(logits[repeated], [rows[i] for i in repeated])
    if counted:
        logits[counted] = _frequency_presence_penalized(logits[counted], [rows[i] for i in counted])
    return logits


def _apply_logit_controls(logits: torch.Tensor, rows: Sequence[SamplingRow], controlled: list[int]) -> None:
    """Each controlled row's allowed-token mask, bans and bias, in place on logits [n, vocab]: one
    masked_fill, one -inf scatter and one add over index lists built from those rows only."""
    vocab_size = logits.shape[1]
    allowing = [i for i in controlled if rows[i].params.allowed_token_ids]
    if allowing:
        outside = torch.ones(len(allowing), vocab_size, dtype=torch.bool, device=logits.device)  # [m, vocab]
        # Built by torch from each row's tuple, not id by id in Python: a row may allow 2**18 ids.
        ids = [torch.tensor(rows[i].params.allowed_token_ids, dtype=torch.long) for i in allowing]  # [k_j] each
        cols = torch.cat(ids)  # [sum k_j]
        mask_rows = torch.repeat_interleave(torch.arange(len(allowing)), torch.tensor([len(row) for row in ids]))
        kept = cols < vocab_size
        outside[mask_rows[kept].to(logits.device), cols[kept].to(logits.device)] = False
        logits[allowing] = logits[allowing].masked_fill(outside, float("-inf"))
    ban_rows, ban_cols = _row_entries([_banned_now(rows[i]) for i in controlled], logits, controlled)
    logits[ban_rows, ban_cols] = float("-inf")
    biased = [i for i in controlled if rows[i].params.logit_bias]
    if biased:
        pairs = [rows[i].params.logit_bias for i in biased]
        bias_rows, bias_cols = _row_entries([[t for t, _ in row] for row in pairs], logits, biased)
        values = [bias for row in pairs for t, bias in row if t < vocab_size]
        # Token ids are distinct within a row (a mapping's keys): each logit gets at most one bias.
        logits.index_put_((bias_rows, bias_cols), torch.tensor(values, dtype=logits.dtype, device=logits.device),
                          accumulate=True)


def _banned_now(row: SamplingRow) -> list[int]:
    """Token ids the row may not sample next: its banned tokens, and the last token of each bad word
    whose other tokens (none for a one-token word) end its output."""
    tokens = row.all_token_ids
    num_output = len(tokens) - row.num_prompt_tokens
    banned = list(row.banned_token_ids)
    for sequence in row.params.bad_words_token_ids:
        prefix = len(sequence) - 1
        if prefix <= num_output and list(sequence[:prefix]) == tokens[len(tokens) - prefix:]:
            banned.append(sequence[-1])
    return banned


def _row_entries(columns: Sequence[Sequence[int]], like: torch.Tensor,
                 row_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns) [total] int64 index tensors on like's device of each list's ids below like's
    width (the vocabulary), the list at position j in row row_ids[j]."""
    pairs = [(row, t) for row, ids in zip(row_ids, columns) for t in ids if t < like.shape[1]]
    flat = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2).to(like.device)  # [total, 2]
    return flat[:, 0], flat[:, 1]


def _repetition_penalized(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """logits [n, vocab] with each token seen in prompt or output divided (> 0) or multiplied (<= 0)."""
    seen = token_counts([row.all_token_ids for row in rows], logits.shape[1], logits.device) > 0  # [n, vocab]
    penalty = _column([row.params.repetition_penalty for row in rows], logits)  # [n, 1]
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def _frequency_presence_penalized(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """logits [n, vocab] less frequency x output count + presence x (count > 0), per token."""
    counts = token_counts([row.output_token_ids for row in rows], logits.shape[1], logits.device)
    counts = counts.to(logits.dtype)  # [n, vocab]
    frequency = _column([row.params.frequency_penalty for row in rows], logits)  # [n, 1]
    presence = _column([row.params.presence_penalty for row in rows], logits)  # [n, 1]
    return logits - (frequency * counts + presence * (counts > 0).to(logits.dtype))


def token_counts(token_lists: Sequence[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab_size] int64: how often each token id occurs in each list (one bincount)."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists])  # [n]
    row_offsets = torch.repeat_interleave(torch.arange(len(token_lists)) * vocab_size, lengths)  # [total]
    flat = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long) + row_offsets  # [total]
    counts = torch.bincount(flat.to(device), minlength=len(token_lists) * vocab_size)
    return counts.view(len(token_lists), vocab_size)


# ---- temperature, top-k, top-p, min-p ----------------------------------------------------------

def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Distributions [n, vocab] after temperature, top-k, top-p and min-p (renormalized); logits [n, vocab]."""
    vocab_size = logits.shape[1]
    probs = _tempered_softmax(logits, _column([p.temperature for p in params], logits))
    probs = _on_rows(probs, _keep_top_k, {i: p.effective_top_k for i, p in enumerate(params)
                                          if 0 < p.effective_top_k < vocab_size})
    probs = _on_rows(probs, _keep_top_p, {i: p.top_p for i, p in enumerate(params) if p.top_p < 1.0})
    probs = _on_rows(probs, _keep_min_p, {i: p.min_p for i, p in enumerate(params) if p.min_p > 0.0})
    return probs / _row_sums(probs)


def _tempered_softmax(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """softmax(logits / temperature) [n, vocab]; temperature [n, 1] > 0."""
    # logits / tiny temperature would overflow to inf (softmax: inf - inf = NaN). Shifted logits are
    # <= 0, so dividing can only reach -inf; the max is kept at 0 even if the temperature is 0 in float32.
    shifted = logits - logits.amax(dim=-1, keepdim=True)  # [n, vocab], <= 0
    return torch.softmax(torch.where(shifted < 0, shifted / temperature, 0.0), dim=-1)


def _on_rows(probs: torch.Tensor, keep: Callable[[torch.Tensor, list], torch.Tensor],
             values: dict[int, int | float]) -> torch.Tensor:
    """probs [n, vocab] with keep(rows, their values) applied to the rows named in values (in place
    when they are not all the rows)."""
    if len(values) == probs.shape[0]:
        return keep(probs, list(values.values()))
    if values:
        index = list(values)
        probs[index] = keep(probs[index], list(values.values()))
    return probs


def _keep_top_k(probs: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """probs [n, vocab] with all but each row's top_k[i] (in [1, vocab)) most likely tokens zeroed."""
    k = torch.tensor(top_k, device=probs.device).unsqueeze(1)  # [n, 1] int64
    kth = torch.topk(probs, max(top_k), dim=-1).values.gather(1, k - 1)  # [n, 1]: the k-th largest
    return torch.where(probs >= kth, probs, 0.0)


def _keep_top_p(probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """probs [n, vocab] with each row cut to the smallest prefix of its descending order reaching
    top_p[i] of its mass. Rows whose nonzeros all fit in vocab / HEAD_FRACTION (after a top-k, or a
    low temperature) order only those instead of sorting the whole vocabulary."""
    threshold = _column(top_p, probs)  # [n, 1]
    width = max(1, int((probs > 0).sum(dim=-1).max()))  # most nonzero tokens in a row
    if width * HEAD_FRACTION > probs.shape[1]:
        return _keep_top_p_sorted(probs, threshold)
    return _keep_top_p_head(probs, threshold, width)


def _keep_top_p_head(probs: torch.Tensor, threshold: torch.Tensor, width: int) -> torch.Tensor:
    """_keep_top_p from each row's `width` largest probabilities, which hold all its nonzeros: the
    same values in the same places as the sorted vocabulary, so the cut falls at the same place."""
    values, ids = torch.topk(probs, width, dim=-1)  # [n, width] each, descending
    drop = _top_p_drop(values, threshold, probs.shape[1])  # [n, width]
    kept = probs.scatter(1, ids, values.masked_fill(drop, 0.0))
    # topk may order tied values unlike torch.sort: where tied tokens fall on both sides of the cut,
    # which of them are dropped could differ, so those rows are sorted in full.
    straddled = (values[:, 1:] == values[:, :-1]) & (values[:, 1:] > 0) & (drop[:, 1:] != drop[:, :-1])
    redo = straddled.any(dim=-1).nonzero().flatten().tolist()
    if redo:
        kept[redo] = _keep_top_p_sorted(probs[redo], threshold[redo])
    return kept


def _keep_top_p_sorted(probs: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """_keep_top_p by a sort of the whole vocabulary; probs [n, vocab], threshold [n, 1]."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # [n, vocab] each
    drop = _top_p_drop(sorted_probs, threshold, probs.shape[1])
    return probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))


def _top_p_drop(sorted_probs: torch.Tensor, threshold: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, width] bool: which of the descending probabilities [n, width] (the first width of each
    row's vocab_size; the rest are zeros) fall past the top_p cut; threshold [n, 1]."""
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [n, width]
    # The total over the whole sorted row, zeros included: a sum's rounding depends on its length.
    total = _row_sums(torch.nn.functional.pad(sorted_probs, (0, vocab_size - sorted_probs.shape[1])))  # [n, 1]
    # Keep a token while the mass of strictly better tokens is below top_p (at least one).
    return mass_before >= threshold * total


def _keep_min_p(probs: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """probs [n, vocab] with tokens below min_p[i] x the row's top probability zeroed."""
    threshold = _column(min_p, probs) * probs.amax(dim=-1, keepdim=True)  # [n, 1]
    return torch.where(probs >= threshold, probs, 0.0)


def _row_sums(tensor: torch.Tensor) -> torch.Tensor:
    """[n, 1]: each row of tensor [n, vocab] summed as a tensor of its own, so in the same order
    whatever the batch (a batched sum adds a long row in another order when it is alone)."""
    return torch.stack([row.sum() for row in tensor]).unsqueeze(1)


# ---- the draw ----------------------------------------------------------------------------------

def draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Token ids [n] drawn from probs [n, vocab] by the exponential race, row i's noise from generators[i]."""
    race = torch.empty_like(probs)  # [n, vocab]: Exp(1) noise
    for row, generator in zip(race, generators):
        row.exponential_(generator=generator)
    return torch.argmax(probs / race, dim=-1)


# ---- logprobs ----------------------------------------------------------------------------------

def _logprobs(logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor) -> list[
        TokenLogprobs | None]:
    """Entries of the rows that asked for logprobs (None for the others); logits [B, vocab] raw, token_ids [B]."""
    result: list[TokenLogprobs | None] = [None] * len(rows)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if wanted:
        raw_logprobs = torch.log_softmax(logits[wanted], dim=-1)  # [m, vocab]
        entries = token_logprobs(raw_logprobs, token_ids[wanted], [rows[i].params.logprobs for i in wanted])
        for index, entry in zip(wanted, entries):
            result[index] = entry
    return result


def token_logprobs(raw_logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """Logprob, rank and top-`num_top[i]` alternatives of each row; raw_logprobs [m, vocab], token_ids [m]."""
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1))  # [m, 1]
    ranks = ((raw_logprobs > chosen).sum(dim=-1) + 1).tolist()
    tops = _top_alternatives(raw_logprobs, num_top)
    return [TokenLogprobs(token_id=token_id, logprob=logprob, rank=rank, top=top)
            for token_id, logprob, rank, top in zip(token_ids.tolist(), chosen.squeeze(1).tolist(), ranks, tops)]


def _top_alternatives(raw_logprobs: torch.Tensor, num_top: list[int]) -> list[tuple[tuple[int, float], ...]]:
    """Each row's top-num_top[i] (token id, logprob) pairs, best first; raw_logprobs [m, vocab].

    One topk per distinct count: topk may order tied values differently for another k."""
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(num_top)
    for k in sorted(set(num_top) - {0}):
        index = [i for i, count in enumerate(num_top) if count == k]
        top = torch.topk(raw_logprobs[index], k, dim=-1)  # values, indices [len(index), k]
        for i, ids, values in zip(index, top.indices.tolist(), top.values.tolist()):
            tops[i] = tuple(zip(ids, values))
    return tops
