"""The reference sampler: engine/sampler.py's per-row implementation as of commit bef4a6a, copied
verbatim, extended since only by the logit controls (apply_logit_controls: allowed_token_ids,
bad_words, logit_bias, defined here one row at a time as vLLM applies them). The batched sampler in
engine/sampler.py must equal it exactly, token ids and logprobs, for every option
(tests/test_sampler.py); bench/sampler.py times the two. Do not change it to follow the engine: it
is the definition of the expected output.

Order of logit processing, per row:
  0. logit controls: tokens outside allowed_token_ids and the last token of each bad word whose
     other tokens end the output at -inf, then logit_bias added
  1. repetition penalty over prompt + output tokens (positive logits divided, negative multiplied)
  2. frequency and presence penalties over output tokens (subtracted)
  3. greedy rows take the argmax here
  4. temperature, then top-k, top-p and min-p masks on the resulting distribution
  5. a draw by the exponential race (argmax of p / E, E ~ Exp(1)) from the row's own generator,
     so a seeded request's tokens do not depend on its batch mates.
Logprobs are of the raw model distribution (before any processing), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.token_logprobs import TokenLogprobs


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def apply_logit_controls(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Copy of one row's logits [vocab] with its logit controls applied."""
    params = row.params
    logits = logits.clone()
    if params.allowed_token_ids:
        allowed = torch.zeros(logits.shape[0], dtype=torch.bool)
        allowed[[t for t in params.allowed_token_ids if t < logits.shape[0]]] = True
        logits[~allowed] = float("-inf")
    output = row.output_token_ids
    for sequence in params.bad_words_token_ids:
        *prefix, last = sequence
        if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix and last < logits.shape[0]:
            logits[last] = float("-inf")
    for token_id, bias in params.logit_bias:
        if token_id < logits.shape[0]:
            logits[token_id] += bias
    return logits


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Penalized copy of one row's logits [vocab] (its logit controls first)."""
    params = row.params
    logits = apply_logit_controls(logits, row)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long,
                            device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                   values * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and row.output_token_ids:
        output = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(output, minlength=logits.shape[0]).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Distribution [vocab] after temperature, top-k, top-p and min-p (renormalized)."""
    # logits / tiny temperature would overflow to inf (softmax: inf - inf = NaN). Shifted logits are
    # <= 0, so dividing can only reach -inf; the max is kept at 0 even if the temperature is 0 in float32.
    shifted = logits - logits.max()
    probs = torch.softmax(torch.where(shifted < 0, shifted / params.temperature, 0.0), dim=-1)
    top_k = params.effective_top_k
    if 0 < top_k < probs.shape[0]:
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep a token while the mass of strictly better tokens is below top_p (at least one).
        drop = mass_before >= params.top_p * sorted_probs.sum()
        probs = probs.scatter(0, order[drop], 0.0)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs / probs.sum()


def sample_from(probs: torch.Tensor, generator: torch.Generator) -> int:
    race = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / race))


def token_logprobs(raw_logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    """Logprob, rank and top-`num_top` alternatives of one row [vocab]."""
    chosen = raw_logprobs[token_id]
    rank = int((raw_logprobs > chosen).sum()) + 1
    top = torch.topk(raw_logprobs, num_top) if num_top else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
    return TokenLogprobs(token_id=token_id, logprob=float(chosen), rank=rank, top=pairs)


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: [len(rows), vocab]; returns one token (and optional logprobs) per row."""
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(r.params.logprobs is not None for r in rows) else None
        greedy_argmax = torch.argmax(logits, dim=-1).tolist()
        token_ids: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        for index, row in enumerate(rows):
            token_id = self._sample_row(logits[index], row, greedy_argmax[index])
            token_ids.append(token_id)
            logprobs.append(None if row.params.logprobs is None
                            else token_logprobs(raw_logprobs[index], token_id, row.params.logprobs))
        return SamplerOutput(token_ids, logprobs)

    @staticmethod
    def _sample_row(logits: torch.Tensor, row: SamplingRow, plain_argmax: int) -> int:
        params = row.params
        has_penalty = (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
                       or params.presence_penalty != 0.0 or params.has_logit_controls)
        if params.is_greedy and not has_penalty:
            return plain_argmax
        if has_penalty:
            logits = apply_penalties(logits, row)
        if params.is_greedy:
            return int(torch.argmax(logits))
        return sample_from(filtered_probs(logits, params), row.generator)
