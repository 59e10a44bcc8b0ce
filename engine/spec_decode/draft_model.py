"""A draft model proposer: a smaller model with the target's tokenizer, run greedily with its own
paged KV pool on the same device (no EngineCore: a block manager, a KV cache and a model runner).

The draft KV of a request follows its tokens lazily: each propose() first feeds the draft model the
tokens it has not seen (the whole prompt the first time, on a decode worker too: the draft KV is
rebuilt from the prompt locally rather than shipped, since the draft model is ~10x smaller than the
target and its prefill costs less than a second transfer and handshake), then k - 1 more steps of
one token. Drafts the target rejected are rolled back by comparing what was fed with the tokens the
request really has.

The two models share a tokenizer but may pad their embeddings to different sizes (Qwen2.5-0.5B has
151936 rows, 7B 152064): a request holding an id past the draft's rows gets no drafts, and a draft
past the target's rows ends that request's drafts, so neither model is ever fed an id it has no row for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from splitserve.common.block_hash import BlockHasher
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.attention import AttentionBackend
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.kv_cache import KVCache, KVCacheSpec
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.models.llama import LlamaFamilyForCausalLM
from splitserve.engine.request import Request
from splitserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from splitserve.engine.spec_decode.proposer import DraftSlot


def check_same_tokenizer(target_dir: Path, draft_dir: Path) -> None:
    """ValueError unless both directories hold the same tokenizer.json (the drafts are token ids)."""
    if (target_dir / "tokenizer.json").read_bytes() != (draft_dir / "tokenizer.json").read_bytes():
        raise ValueError(f"speculative.draft_model {draft_dir} does not share the target's tokenizer "
                         f"({target_dir / 'tokenizer.json'} differs)")


@dataclass
class _DraftSequence:
    """What the draft KV pool holds of one request."""

    blocks: Request
    """The block manager's view: request_id and num_computed_tokens (draft tokens with KV)."""
    num_verified: int = 0
    """Leading tokens known to equal the request's own (the rest of the fed ones are drafts)."""
    fed_drafts: tuple[int, ...] = ()
    """Drafts fed after the first num_verified tokens; their KV is valid while they match."""


class DraftModelProposer:
    def __init__(self, model: LlamaFamilyForCausalLM, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, attention: AttentionBackend, target_vocab_size: int) -> None:
        """`model`: the loaded draft model (on `attention`); its pool holds num_blocks blocks of block_size tokens;
        `target_vocab_size`: the target's embedding rows (no draft is at or past it)."""
        arch = model.arch
        self.vocab_size = arch.vocab_size
        self.target_vocab_size = target_vocab_size
        spec = KVCacheSpec(arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim, dtype)
        self.max_model_len = arch.max_position_embeddings
        self.block_manager = BlockManager(num_blocks, block_size, BlockHasher(block_size, 0), False)
        self.runner = ModelRunner(model, KVCache(spec, num_blocks, device), device, attention.pads_decode_batches,
                                  attention.needs_paged_metadata)
        self._sequences: dict[str, _DraftSequence] = {}

    def propose(self, slots: Sequence[DraftSlot]) -> list[tuple[int, ...]]:
        budgets = [self._prepare(slot) for slot in slots]
        drafts: list[list[int]] = [[] for _ in slots]
        live = [i for i, k in enumerate(budgets) if k > 0]
        chunks = [self._catch_up_chunk(slots[i]) for i in live]
        while live:
            next_ids = torch.argmax(self.runner.execute(SchedulerOutput(tuple(chunks), ())), dim=-1).tolist()
            for i, token_id in zip(live, next_ids):
                drafts[i].append(token_id)
            live = [i for i in live if len(drafts[i]) < budgets[i]]
            chunks = [self._draft_chunk(slots[i], drafts[i]) for i in live]
        for slot, k, tokens in zip(slots, budgets, drafts):
            if k > 0:
                self._fed(slot, tuple(tokens[:-1]))
        return [self._for_target(tokens) for tokens in drafts]

    def _for_target(self, drafts: list[int]) -> tuple[int, ...]:
        """The drafts before the first one the target has no row for (a padded draft vocabulary)."""
        cut = next((j for j, token_id in enumerate(drafts) if token_id >= self.target_vocab_size), len(drafts))
        return tuple(drafts[:cut])

    def forget(self, request_id: str) -> None:
        if self._sequences.pop(request_id, None) is not None:
            self.block_manager.free(request_id)

    def _prepare(self, slot: DraftSlot) -> int:
        """Roll the request's draft KV back to what still matches its tokens and allocate for this
        round; returns how many drafts to make (0: none fit the draft's positions or pool)."""
        sequence = self._sequences.get(slot.request_id)
        if sequence is None:
            blocks = Request(slot.request_id, [], SamplingParams(), frozenset(), 0)
            sequence = self._sequences[slot.request_id] = _DraftSequence(blocks)
        self._roll_back(sequence, slot.token_ids)
        if max(slot.token_ids[sequence.blocks.num_computed_tokens:]) >= self.vocab_size:
            return 0  # a token the draft has no row for (a padded target vocabulary): no drafts
        num_tokens = len(slot.token_ids)
        # Drafts 1 .. k - 1 are fed at positions num_tokens .. num_tokens + k - 2.
        k = min(slot.num_tokens, self.max_model_len - num_tokens + 1)
        if k <= 0:
            return 0
        num_new = num_tokens - sequence.blocks.num_computed_tokens + k - 1
        if self.block_manager.allocate(sequence.blocks, num_new) is None:
            return 0
        return k

    def _roll_back(self, sequence: _DraftSequence, token_ids: list[int]) -> None:
        """Keep the fed drafts' KV only as far as the request's tokens agree with them."""
        base = sequence.num_verified
        matched = 0
        for draft, token_id in zip(sequence.fed_drafts, token_ids[base:]):
            if draft != token_id:
                break
            matched += 1
        blocks = sequence.blocks
        # The last token is always fed again (the catch-up must sample), even when nothing changed.
        blocks.num_computed_tokens = min(blocks.num_computed_tokens, base + matched, len(token_ids) - 1)
        sequence.num_verified, sequence.fed_drafts = blocks.num_computed_tokens, ()
        if self.block_manager.owns_blocks(blocks.request_id):
            self.block_manager.truncate(blocks.request_id, blocks.num_computed_tokens)

    def _catch_up_chunk(self, slot: DraftSlot) -> ScheduledChunk:
        """The request's tokens the draft KV lacks (at least its last token: the catch-up samples)."""
        start = self._sequences[slot.request_id].blocks.num_computed_tokens
        return self._chunk(slot.request_id, tuple(slot.token_ids[start:]), start)

    def _draft_chunk(self, slot: DraftSlot, drafts: list[int]) -> ScheduledChunk:
        """The latest draft, fed at its position to propose the next one."""
        return self._chunk(slot.request_id, (drafts[-1],), len(slot.token_ids) + len(drafts) - 1)

    def _chunk(self, request_id: str, token_ids: tuple[int, ...], start: int) -> ScheduledChunk:
        table = tuple(self.block_manager.block_table(request_id))
        return ScheduledChunk(request_id, token_ids, start, table, samples=True)

    def _fed(self, slot: DraftSlot, drafts: tuple[int, ...]) -> None:
        """Record that the draft KV now holds the request's tokens and then `drafts`."""
        sequence = self._sequences[slot.request_id]
        sequence.num_verified = len(slot.token_ids)
        sequence.fed_drafts = drafts
        sequence.blocks.num_computed_tokens = len(slot.token_ids) + len(drafts)
