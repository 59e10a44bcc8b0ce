"""CudaFences: the one CUDA-only part of layer-wise announcements (the ordering logic runs on CPU
in tests/test_layer_fences.py)."""

from __future__ import annotations

import torch

from splitserve.common.kv_transfer_types import LayerAnnouncement
from splitserve.prefill_worker.layer_fences import CudaFences, FencedSender
from tests.factories import requires_cuda

pytestmark = requires_cuda


def test_an_announcement_leaves_only_after_the_kernels_queued_before_it():
    device = torch.device("cuda", 0)
    x = torch.randn(4096, 4096, device=device)
    y = torch.zeros_like(x)
    for _ in range(50):  # long enough that the host reaches send() well before the GPU is done
        y = y + x @ x
    layer_done = torch.cuda.Event()
    layer_done.record()
    seen: list[bool] = []
    sender = FencedSender(lambda message: seen.append(layer_done.query()), CudaFences(device))
    sender.send(LayerAnnouncement("r", "agent", 0))
    sender.close(timeout_s=60.0)
    assert seen == [True]
