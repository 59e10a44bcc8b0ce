"""Turns a SchedulerOutput into tensors, runs the model, returns logits of sampling rows."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from splitserve.engine.attention import AttentionMetadata, DecodeBatch, PrefillSpan
from splitserve.engine.attention.paged_kv_metadata import ChunkPages, FlashInferMetadata, build_flashinfer_metadata
from splitserve.engine.host_inputs import long_tensor, to_device
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.lora_manager import LoRAManager
from splitserve.engine.models.llama import LlamaFamilyForCausalLM
from splitserve.engine.scheduler import ScheduledChunk, SchedulerOutput


@dataclass(frozen=True)
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [R] int64: each chunk's last num_logit_rows tokens


def _key_slots(chunk: ScheduledChunk, block_size: int) -> np.ndarray:
    """Pool rows of the chunk's keys, pool viewed as [num_blocks * 2 * block_size, H, D]; a value's row
    is its key's row + block_size. One vectorized lookup per chunk, not a loop over its tokens."""
    positions = np.arange(chunk.start_position, chunk.context_len)  # [num_tokens]
    first, last = chunk.start_position // block_size, (chunk.context_len - 1) // block_size
    blocks = np.asarray(chunk.block_table[first:last + 1], dtype=np.int64)[positions // block_size - first]
    return blocks * (2 * block_size) + positions % block_size


def decode_key_slot(chunk: ScheduledChunk, block_size: int) -> int:
    """_key_slots of a one-token chunk, without numpy's per-call cost."""
    position = chunk.start_position
    return chunk.block_table[position // block_size] * 2 * block_size + position % block_size


def _verification_decodes(start: int, chunk: ScheduledChunk) -> list[tuple[int, ScheduledChunk]]:
    """A speculating chunk's tokens as one decode each (token j attends to its context of
    start_position + j + 1 keys, all written by this step first): the decode kernel's numerics, so
    that verifying a draft computes exactly the logits decoding it alone would (the prefill kernel
    accumulates in another order, which flips near-tied argmaxes in bf16)."""
    return [(start + j, ScheduledChunk(chunk.request_id, (token_id,), chunk.start_position + j, chunk.block_table,
                                       samples=True))
            for j, token_id in enumerate(chunk.token_ids)]


MIN_BUCKET_FILL = 0.75
"""A decode joins a bucket while its block count is >= this fraction of the bucket's longest."""


def bucket_by_length(items: list, length) -> list[list]:
    """Groups, longest first, where every length is >= MIN_BUCKET_FILL x the group's max.

    Items keep their input order inside a group (a single group is the input itself).
    """
    order = sorted(range(len(items)), key=lambda i: length(items[i]), reverse=True)
    groups: list[list[int]] = []
    for index in order:
        if groups and length(items[index]) >= MIN_BUCKET_FILL * length(items[groups[-1][0]]):
            groups[-1].append(index)
        else:
            groups.append([index])
    return [[items[i] for i in sorted(group)] for group in groups]


class InputBuilder:
    def __init__(self, block_size: int, device: torch.device, bucket_decodes: bool = True,
                 paged_metadata: bool = False) -> None:
        """bucket_decodes: split decodes into batches of similar length (for backends that pad a batch
        to its longest context); otherwise all decodes form one batch. paged_metadata: also describe the
        step in FlashInfer's format (AttentionMetadata.paged)."""
        self.block_size = block_size
        self.device = device
        self.bucket_decodes = bucket_decodes
        self.paged_metadata = paged_metadata

    def build(self, output: SchedulerOutput) -> ModelInput:
        input_ids: list[int] = []
        positions: list[int] = []
        key_slots: list[int | np.ndarray] = []  # an int per decode, an array per longer chunk
        prefills: list[tuple[int, ScheduledChunk]] = []
        decodes: list[tuple[int, ScheduledChunk]] = []
        logits_indices: list[int] = []
        for chunk in output.chunks:
            start = len(input_ids)
            input_ids.extend(chunk.token_ids)
            if chunk.num_tokens == 1:
                positions.append(chunk.start_position)
                key_slots.append(decode_key_slot(chunk, self.block_size))
                decodes.append((start, chunk))
            elif chunk.num_spec_tokens:
                positions.extend(range(chunk.start_position, chunk.context_len))
                key_slots.append(_key_slots(chunk, self.block_size))
                decodes.extend(_verification_decodes(start, chunk))
            else:
                positions.extend(range(chunk.start_position, chunk.context_len))
                key_slots.append(_key_slots(chunk, self.block_size))
                prefills.append((start, chunk))
            logits_indices.extend(range(len(input_ids) - chunk.num_logit_rows, len(input_ids)))
        keys = to_device(torch.from_numpy(np.hstack(key_slots).astype(np.int64, copy=False)), self.device)  # [T]
        spans, batches, paged = self._attention_parts(prefills, decodes)
        metadata = AttentionMetadata(positions=self._tensor(positions), key_slots=keys,
                                     value_slots=keys + self.block_size, prefills=spans, decodes=batches,
                                     block_size=self.block_size, paged=paged)
        return ModelInput(self._tensor(input_ids), metadata.positions, metadata, self._tensor(logits_indices))

    def _attention_parts(self, prefills: list[tuple[int, ScheduledChunk]],
                         decodes: list[tuple[int, ScheduledChunk]]
                         ) -> tuple[tuple[PrefillSpan, ...], tuple[DecodeBatch, ...], FlashInferMetadata | None]:
        """AttentionMetadata's prefills, decodes (block tables as tensors) and paged: with paged_metadata only
        the last, FlashInfer's format (the backend that asks for it reads nothing else)."""
        if not self.paged_metadata:
            spans = tuple(self._prefill_span(start, chunk) for start, chunk in prefills)
            return spans, self._decode_batches(decodes), None
        chunks = sorted(prefills + decodes, key=lambda item: item[0])  # step order
        return (), (), build_flashinfer_metadata(
            [ChunkPages(start, chunk.num_tokens, chunk.context_len, chunk.block_table) for start, chunk in chunks],
            self.block_size)

    def _prefill_span(self, start: int, chunk: ScheduledChunk) -> PrefillSpan:
        num_blocks = -(-chunk.context_len // self.block_size)
        return PrefillSpan(query_start=start, query_len=chunk.num_tokens, context_len=chunk.context_len,
                           block_table=self._tensor(list(chunk.block_table[:num_blocks])))

    def _decode_batches(self, decodes: list[tuple[int, ScheduledChunk]]) -> tuple[DecodeBatch, ...]:
        if not decodes:
            return ()
        if not self.bucket_decodes:
            return (self._decode_batch(decodes),)
        return tuple(self._decode_batch(group) for group in bucket_by_length(
            decodes, lambda item: -(-item[1].context_len // self.block_size)))

    def _decode_batch(self, decodes: list[tuple[int, ScheduledChunk]]) -> DecodeBatch:
        width = max(-(-chunk.context_len // self.block_size) for _, chunk in decodes)
        tables = [list(chunk.block_table[:width]) + [0] * (width - len(chunk.block_table[:width]))
                  for _, chunk in decodes]
        return DecodeBatch(token_indices=self._tensor([start for start, _ in decodes]),
                           block_tables=self._tensor(tables),
                           context_lens=self._tensor([chunk.context_len for _, chunk in decodes]))

    def _tensor(self, values: list) -> torch.Tensor:
        return long_tensor(values, self.device)


def adapter_rows(output: SchedulerOutput) -> dict[str, list[int]]:
    """LoRA adapter name -> the rows of the step's flattened batch (InputBuilder's order: chunk by chunk, each
    chunk's tokens in order) whose chunks run it; empty for a step of base-model chunks only."""
    rows: dict[str, list[int]] = {}
    offset = 0
    for chunk in output.chunks:
        if chunk.lora_name is not None:
            rows.setdefault(chunk.lora_name, []).extend(range(offset, offset + chunk.num_tokens))
        offset += chunk.num_tokens
    return rows


class DecodeGraphs(Protocol):
    def can_run(self, output: SchedulerOutput) -> bool:
        """Whether a captured graph computes this step (decodes only, each sampling, few enough)."""
        ...

    def execute(self, output: SchedulerOutput) -> torch.Tensor:
        """Logits [len(output.chunks), vocab] (float32) of a step that can_run."""
        ...


class ModelRunner:
    """Owns the model and the KV pool tensors for one device."""

    def __init__(self, model: LlamaFamilyForCausalLM, kv_cache: KVCache, device: torch.device,
                 bucket_decodes: bool = True, paged_metadata: bool = False, graphs: DecodeGraphs | None = None,
                 lora: LoRAManager | None = None) -> None:
        """graphs: captured decode steps (engine/cuda_graphs.py), replayed for the steps they can run (never a
        step with LoRA rows: the graphs hold the base model's ops only). lora: the adapters of an engine with
        enable_lora, whose LoRALinears `model` has."""
        self.model = model
        self.kv_cache = kv_cache
        self.inputs = InputBuilder(kv_cache.spec.block_size, device, bucket_decodes, paged_metadata)
        self.graphs = graphs
        self.lora = lora

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits [R, vocab] (float32) in chunk order, ScheduledChunk.num_logit_rows per chunk: one row per
        sampling chunk, 1 + num_spec_tokens rows (last token, then each draft) for a speculating one
        (never a captured graph: it takes one-token decodes only), every token's for one scoring its
        prompt. on_layer(l) runs after layer l of the forward (eager steps only: a step with a hook is
        never replayed from a graph)."""
        lora_rows = self._lora_rows(output)
        if on_layer is None and not lora_rows and self.graphs is not None and self.graphs.can_run(output):
            return self.graphs.execute(output)
        model_input, hidden = self._eager_forward(output, lora_rows, on_layer)
        return self.model.compute_logits(hidden[model_input.logits_indices]).float()

    @torch.inference_mode()
    def execute_with_hidden(self, output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor]:
        """execute()'s logits and the final hidden states [T, hidden] (after the final norm, before lm_head) of
        every scheduled token in batch order: what a step with pooling chunks needs (never a captured graph)."""
        model_input, hidden = self._eager_forward(output, self._lora_rows(output))
        return self.model.compute_logits(hidden[model_input.logits_indices]).float(), hidden

    @torch.inference_mode()
    def execute_all_positions(self, output: SchedulerOutput) -> torch.Tensor:
        """Logits [T, vocab] (float32) of every scheduled token in batch order, not only the sampling rows:
        what scoring a prompt needs."""
        _, hidden = self._eager_forward(output, self._lora_rows(output))
        return self.model.compute_logits(hidden).float()

    def _eager_forward(self, output: SchedulerOutput, lora_rows: dict[str, list[int]],
                       on_layer: Callable[[int], None] | None = None) -> tuple[ModelInput, torch.Tensor]:
        """The step's inputs and the final hidden states [T, hidden] of every scheduled token, from the eager
        forward with the step's adapters set (lora_rows: _lora_rows(output))."""
        model_input = self.inputs.build(output)
        with self._adapters(lora_rows):
            return model_input, self._forward(model_input, on_layer)  # [T, hidden]

    def _lora_rows(self, output: SchedulerOutput) -> dict[str, list[int]]:
        """adapter_rows, read only by an engine with enable_lora (without it no chunk names an adapter): the
        step's hot path stays free of the walk over its chunks."""
        return {} if self.lora is None else adapter_rows(output)

    @contextmanager
    def _adapters(self, rows_by_name: dict[str, list[int]]) -> Iterator[None]:
        """The step's LoRABatch set on the model's LoRALinears for the forward (nothing to set without rows)."""
        if not rows_by_name:
            yield
            return
        self.lora.context.batch = self.lora.batch(rows_by_name)
        try:
            yield
        finally:
            self.lora.context.batch = None

    def _forward(self, model_input: ModelInput, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        return self.model(model_input.input_ids, model_input.positions, self.kv_cache.layers,
                          model_input.metadata, on_layer)  # [T, hidden]
