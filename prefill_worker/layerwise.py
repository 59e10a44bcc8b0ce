"""Layer-wise transfer, producer side: hold a prompt's blocks as its final chunk's forward starts and
announce every layer the forward writes, so the consumer's READs overlap the rest of the forward.

`LayerwiseAnnouncer` is the engine's PrefillLayerListener (EngineCore.set_layer_listener). It runs
on the engine thread inside step(): `final_chunks_starting` holds each finishing prompt under a
layer-wise lease and sends its TransferParams, `layer_written` sends one LayerAnnouncement per
prompt and layer. `send` carries both to the consumer in that order (a request's TransferParams
before its announcements: ConsumerConnector drops an announcement for a pull it has not started).

After the step the worker settles each early-held request: one that holds its KV (its first token
did not end it) keeps the lease; one that ended at its first token, or whose step failed, has its
lease released (the generations are bumped before the blocks are reused, so a consumer still
reading them fails its check).
"""

from __future__ import annotations

from collections.abc import Callable

from splitserve.common.kv_transfer_types import LayerAnnouncement, TransferParams
from splitserve.engine.engine_core import FinalPrefillChunk, HeldKV
from splitserve.kv_transfer import ProducerConnector

LayerwiseMessage = TransferParams | LayerAnnouncement
"""What the producer sends the consumer: a request's TransferParams, then its layers one by one."""


class LayerwiseAnnouncer:
    """Implements engine_core.PrefillLayerListener over the worker's ProducerConnector.

    Invariant: every request it held is settled exactly once (settle() or abandon()), so no
    layer-wise lease outlives its request except to be pulled or to expire."""

    def __init__(self, leases: ProducerConnector, send: Callable[[LayerwiseMessage], None]) -> None:
        self._leases = leases
        self._send = send
        self._in_forward: tuple[str, ...] = ()
        """Requests whose final chunk the current forward computes (announced after each layer)."""
        self._unsettled: dict[str, TransferParams] = {}
        """Held at their final chunk's start, not yet settled."""

    # ---- PrefillLayerListener (engine thread, inside step()) ---------------------------------
    def final_chunks_starting(self, chunks: tuple[FinalPrefillChunk, ...]) -> None:
        for chunk in chunks:
            params = self._leases.hold(chunk.request_id, chunk.block_ids, chunk.num_tokens, layerwise=True)
            self._unsettled[chunk.request_id] = params
            self._send(params)
        self._in_forward = tuple(chunk.request_id for chunk in chunks)

    def layer_written(self, layer: int) -> None:
        for request_id in self._in_forward:
            self._send(self._leases.announce(request_id, layer))

    # ---- after the step ------------------------------------------------------------------
    def settle(self, request_id: str, held: HeldKV | None) -> TransferParams | None:
        """The request's step ended: its TransferParams while it holds its KV (`held`), else None
        with the lease released (it ended at its first token; the caller frees nothing: the engine
        already did, in the same thread, before any later step could reuse the blocks).
        None also for a request this announcer did not hold."""
        self._in_forward = ()
        params = self._unsettled.pop(request_id, None)
        if params is None:
            return None
        if held is None:
            self._leases.release(request_id)
            return None
        if held.block_ids != params.block_ids:
            raise AssertionError(f"{request_id}: held blocks {held.block_ids} differ from the blocks announced "
                                 f"while its final chunk ran ({params.block_ids})")
        return params

    def abandon(self) -> list[str]:
        """A step failed: release every unsettled lease; returns their request ids (the caller aborts them)."""
        self._in_forward = ()
        abandoned, self._unsettled = list(self._unsettled), {}
        for request_id in abandoned:
            self._leases.release(request_id)
        return abandoned
