"""resolve_device: the engine's device from its config name; a CUDA device always carries its index, so a
thread of its own (a transfer or fence thread) can make it current (torch.cuda.set_device refuses "cuda")."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.engine_core import resolve_device


@pytest.fixture
def cuda_device_2(monkeypatch):
    """A machine whose current CUDA device is 2 (no GPU needed: only torch.cuda's queries are replaced)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)


@pytest.mark.parametrize("name, expected", [("cuda", torch.device("cuda", 2)), ("auto", torch.device("cuda", 2)),
                                            ("cuda:1", torch.device("cuda", 1)), ("cpu", torch.device("cpu"))])
def test_a_cuda_device_gets_the_current_index_unless_named(cuda_device_2, name, expected):
    assert resolve_device(name) == expected


def test_without_cuda_auto_is_the_cpu_and_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=f"device '{name}' requested but CUDA is not available"):
            resolve_device(name)
