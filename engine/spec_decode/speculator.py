"""The engine's speculation policy: who speculates, how far, with which proposer, and the counters."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from splitserve.common.config import SpeculativeConfig
from splitserve.common.stats import SpecDecodeStats
from splitserve.engine.attention import AttentionBackend
from splitserve.engine.model_loader import load_hf_config, load_model
from splitserve.engine.models.layer_ops import LayerOps
from splitserve.common.quantization_spec import checkpoint_quantization
from splitserve.engine.request import Request
from splitserve.engine.spec_decode.draft_model import DraftModelProposer, check_same_tokenizer
from splitserve.engine.spec_decode.ngram import NgramProposer
from splitserve.engine.spec_decode.proposer import DraftSlot, Proposer
from splitserve.engine.tiny_model import resolve_model_path

ACCEPTANCE_SMOOTHING = 0.5
"""Weight of the latest verification in a request's average accepted length (the adaptive k)."""


class Speculator:
    """Proposes drafts for the decoding requests after each step and keeps the acceptance counters.

    Invariant: num_accepted_per_pos[j] counts verifications that accepted at least j + 1 drafts."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self._accepted_length: dict[str, float] = {}
        """Per request: a moving average of its accepted drafts per verification."""
        self._num_drafts = 0
        self._num_draft_tokens = 0
        self._num_accepted_per_pos = [0] * config.num_speculative_tokens

    def propose(self, running: Sequence[Request]) -> None:
        """Set spec_token_ids of the running requests that decode next step (clear the others')."""
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        for request in decoding:
            request.spec_token_ids.clear()
        if len(decoding) > self.config.batch_limit:
            return
        slots, requests = [], []
        for request in decoding:
            k = self.num_speculative_tokens(request)
            if k > 0:
                slots.append(DraftSlot(request.request_id, request.all_token_ids, k))
                requests.append(request)
        for request, drafts in zip(requests, self.proposer.propose(slots) if slots else ()):
            request.spec_token_ids.extend(drafts)

    def num_speculative_tokens(self, request: Request) -> int:
        """k for the request's next step: its recent accepted length + 1 (adaptive), within what
        max_tokens and max_model_len leave after the target's own token. 0 for structured output:
        its grammar constrains each position, which the verification does not do."""
        if request.sampling_params.structured_output is not None:
            return 0
        k = self.config.num_speculative_tokens
        if self.config.adaptive:
            k = min(k, round(self._accepted_length.get(request.request_id, k)) + 1)
        remaining = request.sampling_params.max_tokens - request.num_output_tokens - 1
        return max(0, min(k, remaining, self.max_model_len - request.num_tokens - 1))

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """One verification of `num_drafts` drafts of which the first `num_accepted` were accepted."""
        self._num_drafts += 1
        self._num_draft_tokens += num_drafts
        for j in range(num_accepted):
            self._num_accepted_per_pos[j] += 1
        previous = self._accepted_length.get(request_id, float(num_accepted))
        self._accepted_length[request_id] = (1 - ACCEPTANCE_SMOOTHING) * previous + ACCEPTANCE_SMOOTHING * num_accepted

    def tracked_request_ids(self) -> frozenset[str]:
        """The requests whose acceptance this keeps (each running request that verified drafts)."""
        return frozenset(self._accepted_length)

    def forget(self, request_id: str) -> None:
        self._accepted_length.pop(request_id, None)
        self.proposer.forget(request_id)

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(self._num_drafts, self._num_draft_tokens, sum(self._num_accepted_per_pos),
                               tuple(self._num_accepted_per_pos))


def build_proposer(config: SpeculativeConfig, target_tokenizer_dir: Path, target_vocab_size: int, num_blocks: int,
                   block_size: int, dtype: torch.dtype, device: torch.device, attention: AttentionBackend,
                   layer_ops: LayerOps) -> Proposer:
    """The configured proposer; a draft model is loaded in the target's dtype on its device, its weights
    as its own checkpoint says (a GPTQ / AWQ draft; the target's `quantization` is about the target),
    with as many KV blocks as the target's pool (a draft block is smaller than a target block).
    `target_tokenizer_dir`: where the target's tokenizer.json is (its --tokenizer directory, else its own), which
    the draft's must equal."""
    if config.method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    draft_dir = resolve_model_path(config.draft_model)
    check_same_tokenizer(target_tokenizer_dir, draft_dir)
    quantization = checkpoint_quantization(getattr(load_hf_config(draft_dir), "quantization_config", None))
    model = load_model(draft_dir, dtype, device, attention, False, layer_ops, quantization)
    return DraftModelProposer(model, num_blocks, block_size, dtype, device, attention, target_vocab_size)
