"""Layer-wise transfer with a real prefill engine: the final chunk's forward announces each layer,
the consumer READs it before the next layer is computed, and the pulled KV equals a whole-request
pull byte for byte and decodes to the same greedy tokens (in-process and NIXL/UCX backends)."""

from __future__ import annotations

import random

import pytest
import torch

from splitserve.common.config import EngineConfig
from splitserve.common.kv_transfer_types import TransferParams
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_core import EngineCore, FinalPrefillChunk
from splitserve.kv_transfer import PullStatus
from splitserve.testing.layerwise_pair import LayerwisePair, pulled_bytes
from tests.factories import assert_pool_idle, engine_token_ids, requires_nixl

CONFIG = EngineConfig(block_size=8, num_kv_blocks=128, max_num_batched_tokens=32, max_model_len=256, dtype="float32",
                      device="cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BACKENDS = ["inprocess", pytest.param("nixl", marks=requires_nixl)]


def _prompts() -> dict[str, list[int]]:
    """In order: a prefix-cache hit needs the prompt it shares 3 blocks with to have run first."""
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(3, 512) for _ in range(n)]  # noqa: E731
    partial = tokens(29)
    return {"partial-last-block": partial,  # 3 full blocks + 5 tokens
            "block-aligned": tokens(24),
            "chunked": tokens(70),  # chunks of 32 + 32 + 6 (max_num_batched_tokens=32)
            "prefix-hit": partial[:24] + tokens(9)}


def _pull_all(pair: LayerwisePair) -> dict:
    return {request_id: pair.prefill(request_id, prompt, GREEDY) for request_id, prompt in _prompts().items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_layerwise_pull_equals_the_whole_request_pull_byte_for_byte(tiny_llama_dir, backend):
    with LayerwisePair(tiny_llama_dir, CONFIG, backend, layerwise=False) as whole_pair, \
            LayerwisePair(tiny_llama_dir, CONFIG, backend, layerwise=True) as layer_pair:
        whole, layered = _pull_all(whole_pair), _pull_all(layer_pair)
        for request_id, prompt in _prompts().items():
            a, b = whole[request_id], layered[request_id]
            assert (b.outcome.state, b.outcome.num_bytes) == (PullStatus.DONE, a.outcome.num_bytes)
            assert (b.first_token_ids, b.remote_block_ids, b.local_block_ids) == (
                a.first_token_ids, a.remote_block_ids, a.local_block_ids)
            assert len(b.local_block_ids) == -(-len(prompt) // CONFIG.block_size)
            for layer, (x, y) in enumerate(zip(pulled_bytes(whole_pair.consumer_layers, a.local_block_ids),
                                               pulled_bytes(layer_pair.consumer_layers, b.local_block_ids))):
                assert torch.equal(x, y), f"{request_id}: layer {layer}"
        # the prefix-cache hit reused the first prompt's 3 full blocks on the producer
        assert layered["prefix-hit"].remote_block_ids[:3] == layered["partial-last-block"].remote_block_ids[:3]
        assert layer_pair.consumer.pulls.stats().num_unmatched_announcements == 0
        assert_pool_idle(layer_pair.engine.block_manager)


def test_each_layer_is_read_inside_the_forward_before_the_next_layer_is_written(tiny_llama_dir):
    """Inline consumer: when layer l is announced, the consumer READs it at once; at that moment
    layer l + 1 of the prompt's last token is not yet written on the producer."""
    with LayerwisePair(tiny_llama_dir, CONFIG, "inprocess", layerwise=True) as pair:
        num_layers = len(pair.consumer_layers)
        seen: list[tuple[int, list[bool], torch.Tensor | None]] = []
        params: dict[str, TransferParams] = {}
        receive = pair.consumer.receive

        def recording_receive(message, layerwise: bool) -> None:
            receive(message, layerwise)
            if isinstance(message, TransferParams):
                params[message.request_id] = message
                return
            remote, local = params[message.request_id].block_ids, pair.consumer.local_block_ids[message.request_id]
            read = [torch.equal(pair.consumer_layers[l][list(local)], pair.engine.kv_cache.layers[l][list(remote)])
                    for l in range(num_layers)]
            seen.append((message.layer, read, _last_token_kv(pair, params[message.request_id], message.layer + 1)))

        pair.consumer.receive = recording_receive
        prompt = _prompts()["chunked"]
        pulled = pair.prefill("r", prompt, GREEDY)
        assert [layer for layer, _, _ in seen] == list(range(num_layers))
        for layer, read, next_layer_then in seen:
            assert read == [l <= layer for l in range(num_layers)], f"after layer {layer}'s announcement"
            if next_layer_then is not None:
                assert not torch.equal(next_layer_then, _last_token_kv(pair, params["r"], layer + 1)), \
                    f"layer {layer + 1} was already written when layer {layer} was read"
        assert pulled.outcome.state is PullStatus.DONE


def _last_token_kv(pair: LayerwisePair, params: TransferParams, layer: int) -> torch.Tensor | None:
    """The producer's keys and values [2, kv_heads, head_dim] of the prompt's last token in `layer`
    (None past the last layer)."""
    if layer >= len(pair.engine.kv_cache.layers):
        return None
    position = params.num_tokens - 1
    block = params.block_ids[position // CONFIG.block_size]
    return pair.engine.kv_cache.layers[layer][block, :, position % CONFIG.block_size].clone()


@pytest.mark.parametrize("backend", BACKENDS)
def test_layerwise_pulled_kv_decodes_to_the_same_greedy_tokens(tiny_llama_dir, backend):
    prompts = _prompts()
    one = EngineCore(tiny_llama_dir, CONFIG)
    for request_id, prompt in prompts.items():
        one.add_request(request_id, prompt, GREEDY)
    expected = engine_token_ids(one)
    consumer = EngineCore(tiny_llama_dir, CONFIG)
    with LayerwisePair(tiny_llama_dir, CONFIG, backend, layerwise=True) as pair:
        for request_id, pulled in _pull_all(pair).items():
            local = consumer.add_remote_request(request_id, prompts[request_id], list(pulled.first_token_ids), GREEDY,
                                                0, None)
            for src, dst in zip(pair.consumer_layers, consumer.kv_cache.layers):
                dst[list(local)] = src[list(pulled.local_block_ids)]
            consumer.remote_kv_ready(request_id)
            assert list(pulled.first_token_ids) == expected[request_id][:1]
        decoded = engine_token_ids(consumer)
    assert {r: expected[r][:1] + decoded[r] for r in prompts} == expected


class RecordingListener:
    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def final_chunks_starting(self, chunks: tuple[FinalPrefillChunk, ...]) -> None:
        self.events.append(("final", chunks))

    def layer_written(self, layer: int) -> None:
        self.events.append(("layer", layer))


def test_only_the_final_chunks_forward_is_followed_layer_by_layer(tiny_llama_dir):
    engine = EngineCore(tiny_llama_dir, CONFIG)
    listener = RecordingListener()
    engine.set_layer_listener(listener)
    engine.add_request("held", _prompts()["chunked"], GREEDY, hold_kv_after_prefill=True)
    engine.add_request("plain", _prompts()["block-aligned"], GREEDY)  # not held: never announced
    steps = 0
    while engine.take_held_kv("held") is None:
        engine.step()
        steps += 1
    num_layers = len(engine.kv_cache.layers)
    held = engine.take_held_kv("held")
    assert steps == 3  # 32 + 32 + 6 tokens (the plain prompt shares the budget after the held one)
    assert listener.events == [("final", (FinalPrefillChunk("held", held.block_ids, 70),)),
                               *(("layer", layer) for layer in range(num_layers))]
    engine.set_layer_listener(None)
    engine.release_held_kv("held")
    while engine.has_work():
        engine.step()
    assert len(listener.events) == 1 + num_layers


def test_a_prompt_that_ends_at_its_first_token_releases_its_layerwise_lease(tiny_llama_dir):
    """Its blocks were held and announced while the forward ran, and the inline consumer's pull ended
    inside that forward (every layer was written: the bytes it checked are the final ones). Settling
    the request releases the lease; the pull's notification is then late, and nothing leaks."""
    with LayerwisePair(tiny_llama_dir, CONFIG, "inprocess", layerwise=True) as pair:
        pair.engine.add_request("once", _prompts()["block-aligned"], SamplingParams(temperature=0.0, max_tokens=1),
                                hold_kv_after_prefill=True)
        [delta] = pair.engine.step()
        assert delta.finish_reason == "length" and pair.engine.take_held_kv("once") is None
        assert pair.announcer.settle("once", None) is None
        assert pair.leases.poll() == []
        stats = pair.leases.stats()
        assert (stats.num_held, stats.num_released, stats.num_late_notifications) == (0, 1, 1)
        pair.consumer.collect()
        outcome, _ = pair.consumer.done.pop("once")
        assert outcome.state is PullStatus.DONE
        assert_pool_idle(pair.engine.block_manager)


def test_a_failed_step_abandons_its_layerwise_leases(tiny_llama_dir):
    with LayerwisePair(tiny_llama_dir, CONFIG, "inprocess", layerwise=True) as pair:
        pair.engine.add_request("r", _prompts()["block-aligned"], GREEDY, hold_kv_after_prefill=True)
        announced: list[int] = []
        layer_written = pair.announcer.layer_written

        def failing_layer_written(layer: int) -> None:
            layer_written(layer)
            announced.append(layer)
            if layer == 0:
                raise RuntimeError("injected failure after layer 0")

        pair.engine.set_layer_listener(_Delegate(pair.announcer, failing_layer_written))
        with pytest.raises(RuntimeError, match="injected failure after layer 0"):
            pair.engine.step()
        assert announced == [0]
        assert pair.announcer.abandon() == ["r"]
        assert pair.leases.poll() == [] and pair.leases.stats().num_released == 1
        assert pair.consumer.pulls.status("r") is PullStatus.AWAITING_LAYER  # it waits for layer 1...
        assert pair.consumer.pulls.abort("r")  # ...until the decode side gives up on it
        assert pair.engine.abort_request("r")
        pair.engine.step()
        assert_pool_idle(pair.engine.block_manager)


class _Delegate:
    """A PrefillLayerListener that forwards final_chunks_starting and calls `layer_written` instead."""

    def __init__(self, listener, layer_written) -> None:
        self.final_chunks_starting = listener.final_chunks_starting
        self.layer_written = layer_written
