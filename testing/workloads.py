"""Greedy workloads: one request's prompt and output length (GreedyCase), and a mix of prompts
that share prefixes."""

from __future__ import annotations

import random
from dataclasses import dataclass

from splitserve.common.sampling_params import SamplingParams


@dataclass(frozen=True)
class GreedyCase:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos)


def mixed_workload(vocab_size: int, num_requests: int = 32, seed: int = 0, max_prompt: int = 300,
                   max_output: int = 40, num_shared_prefixes: int = 3) -> list[GreedyCase]:
    """Prompts of 1..max_prompt tokens; about two thirds extend one of a few shared prefixes."""
    rng = random.Random(seed)
    token = lambda: rng.randrange(3, vocab_size)  # noqa: E731 - ids 0..2 are special tokens
    prefixes = [[token() for _ in range(rng.randrange(20, max_prompt // 2))] for _ in range(num_shared_prefixes)]
    cases = []
    for index in range(num_requests):
        if index % 3 != 2:
            prefix = prefixes[index % num_shared_prefixes]
            prompt = prefix + [token() for _ in range(rng.randrange(0, max_prompt - len(prefix)))]
        else:
            prompt = [token() for _ in range(rng.randrange(1, max_prompt + 1))]
        cases.append(GreedyCase(tuple(prompt), rng.randrange(1, max_output + 1), ignore_eos=index % 2 == 0))
    return cases
