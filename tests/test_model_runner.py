"""Input building: exact slots, spans, decode buckets and sampling indices for a scheduled step."""

from __future__ import annotations

import torch

from splitserve.engine.model_runner import InputBuilder, bucket_by_length
from splitserve.engine.scheduler import ScheduledChunk, SchedulerOutput


def test_bucket_by_length_groups_similar_lengths_in_input_order():
    lengths = [4, 40, 33, 5, 30, 39]
    groups = bucket_by_length(list(range(len(lengths))), lambda i: lengths[i])
    # 40 starts a bucket; 39, 33, 30 are >= 0.75 * 40; 5 and 4 form the next one.
    assert groups == [[1, 2, 4, 5], [0, 3]]
    assert bucket_by_length([7, 7, 7], lambda x: x) == [[7, 7, 7]]


def test_build_flattens_chunks_with_exact_slots():
    block_size = 4
    output = SchedulerOutput(chunks=(
        ScheduledChunk("decode", (9,), start_position=5, block_table=(3, 7), samples=True),
        ScheduledChunk("prefill", (1, 2, 3), start_position=2, block_table=(5, 2), samples=False),
        ScheduledChunk("fresh", (4, 5), start_position=0, block_table=(6,), samples=True),
    ), preempted_request_ids=())
    model_input = InputBuilder(block_size, torch.device("cpu")).build(output)
    assert model_input.input_ids.tolist() == [9, 1, 2, 3, 4, 5]
    assert model_input.positions.tolist() == [5, 2, 3, 4, 0, 1]
    # key row = block * 2 * block_size + offset; value row = key row + block_size
    assert model_input.metadata.key_slots.tolist() == [7 * 8 + 1, 5 * 8 + 2, 5 * 8 + 3, 2 * 8 + 0, 6 * 8 + 0, 6 * 8 + 1]
    assert (model_input.metadata.value_slots - model_input.metadata.key_slots).tolist() == [4] * 6
    assert model_input.logits_indices.tolist() == [0, 5]
    spans = [(s.query_start, s.query_len, s.context_len, s.block_table.tolist()) for s in model_input.metadata.prefills]
    assert spans == [(1, 3, 5, [5, 2]), (4, 2, 2, [6])]
    (decode,) = model_input.metadata.decodes
    assert (decode.token_indices.tolist(), decode.block_tables.tolist(), decode.context_lens.tolist()) == (
        [0], [[3, 7]], [6])
