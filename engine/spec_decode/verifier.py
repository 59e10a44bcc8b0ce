"""Verification of draft tokens against the target model's logits (Leviathan et al., Chen et al. 2023).

Row j of a speculating request's logits is the target's next-token distribution after its tokens and
its first j drafts (j = 0 .. k). Each row is processed exactly as the sampler would process it
without speculation at that point (logit controls and penalties over the tokens so far, drafts
included; min_tokens bans by the output length there; then temperature / top-k / top-p / min-p),
giving p_j.

- Greedy: draft j is accepted while it equals argmax p_j; the first mismatch emits argmax p_j, so the
  output is token for token what non-speculative greedy decoding emits.
- Sampled: row j's token is drawn from p_j exactly as the sampler draws it without speculation (one
  row of noise from the request's own generator per emitted token, in order); draft j is accepted
  when it equals that draw, and the first draw that differs (or the draw after the last draft) is
  the run's last token. The drafts are point masses (every proposer here is deterministic), so this
  accepts d with probability p_j(d) and otherwise emits a draw from p_j with d removed: rejection
  sampling's acceptance and residual (renormalized max(0, p_j - q_j)). And each emitted token is the
  token decoding without speculation would emit: a seeded request's output does not depend on
  whether, or how far, it speculated, hence not on its batch mates either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.common.token_logprobs import TokenLogprobs
from splitserve.engine.sampler import Sampler, SamplingRow, draw, filtered_probs, penalized, token_logprobs


@dataclass(frozen=True)
class SpeculativeRows:
    """One speculating request as the verification sees it."""

    rows: tuple[SamplingRow, ...]
    """1 + k rows: rows[j] samples the token after the request's tokens and drafts[:j]."""
    drafts: tuple[int, ...]
    """The k draft tokens the step computed KV for."""


@dataclass(frozen=True)
class VerifiedRun:
    """What one speculating request emits this step."""

    token_ids: tuple[int, ...]
    """The accepted drafts, then one token of the target's (a correction or the bonus token)."""
    logprobs: tuple[TokenLogprobs, ...]
    """Raw-distribution logprobs of token_ids (empty unless the request asked for logprobs)."""

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


def verify(sampler: Sampler, logits: torch.Tensor, requests: Sequence[SpeculativeRows]) -> list[VerifiedRun]:
    """One run per request; logits [sum(1 + k_i), vocab] float32, each request's rows in order."""
    starts = [0]
    for spec in requests:
        starts.append(starts[-1] + len(spec.rows))
    runs: list[VerifiedRun | None] = [None] * len(requests)
    greedy = [i for i, spec in enumerate(requests) if spec.rows[0].params.is_greedy]
    if greedy:
        for i, run in zip(greedy, _verify_greedy(sampler, logits, [requests[i] for i in greedy],
                                                 [starts[i] for i in greedy])):
            runs[i] = run
    for i, spec in enumerate(requests):
        if runs[i] is None:
            runs[i] = verify_sampled(logits[starts[i]:starts[i + 1]], spec)
    return runs


def _verify_greedy(sampler: Sampler, logits: torch.Tensor, requests: Sequence[SpeculativeRows],
                   starts: Sequence[int]) -> list[VerifiedRun]:
    """All greedy requests' rows through the sampler at once (one argmax when none has a penalty)."""
    index = [start + j for spec, start in zip(requests, starts) for j in range(len(spec.rows))]
    output = sampler(logits[index], [row for spec in requests for row in spec.rows])
    runs, offset = [], 0
    for spec in requests:
        targets = output.token_ids[offset:offset + len(spec.rows)]
        num_accepted = _matching_prefix(spec.drafts, targets)
        logprobs = output.logprobs[offset:offset + num_accepted + 1]
        runs.append(VerifiedRun(tuple(targets[:num_accepted + 1]),
                                tuple(lp for lp in logprobs if lp is not None)))
        offset += len(spec.rows)
    return runs


def _matching_prefix(drafts: Sequence[int], targets: Sequence[int]) -> int:
    for j, (draft, target) in enumerate(zip(drafts, targets)):
        if draft != target:
            return j
    return len(drafts)


def verify_sampled(logits: torch.Tensor, spec: SpeculativeRows) -> VerifiedRun:
    """One sampled request's run; logits [1 + k, vocab] float32."""
    params = spec.rows[0].params
    generator = spec.rows[0].generator
    probs = filtered_probs(penalized(logits, spec.rows), [params] * len(spec.rows))  # [1 + k, vocab]
    tokens: list[int] = []
    for j in range(len(spec.rows)):
        tokens.append(int(draw(probs[j:j + 1], [generator])[0]))
        if j == len(spec.drafts) or tokens[-1] != spec.drafts[j]:
            break
    logprobs: tuple[TokenLogprobs, ...] = ()
    if params.logprobs is not None:
        raw = torch.log_softmax(logits[:len(tokens)], dim=-1)  # [len(tokens), vocab]
        ids = torch.tensor(tokens, dtype=torch.long, device=logits.device)
        logprobs = tuple(token_logprobs(raw, ids, [params.logprobs] * len(tokens)))
    return VerifiedRun(tuple(tokens), logprobs)
