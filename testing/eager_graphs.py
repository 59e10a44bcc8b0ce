"""A stand-in for CUDA graph capture (engine.cuda_graphs.Graphs) that runs on any device.

"Capturing" runs the function once and keeps its output; "replaying" runs it again and writes the
result into that same output tensor, as a CUDA graph's replay rewrites its static output. What a
replay reads is therefore whatever the static inputs hold at replay time, as on a GPU, so the
decode graph runner's bookkeeping (static inputs, re-planning before each replay, padding, output
rows) is tested on CPU; only the capture itself is left to tests/gpu.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class EagerGraph:
    def __init__(self, forward: Callable[[], torch.Tensor], output: torch.Tensor) -> None:
        self._forward = forward
        self._output = output

    def replay(self) -> None:
        self._output.copy_(self._forward())


class EagerGraphs:
    def __init__(self) -> None:
        self.num_captures = 0

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[EagerGraph, torch.Tensor]:
        self.num_captures += 1
        output = forward()
        return EagerGraph(forward, output), output
