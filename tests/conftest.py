"""Session fixtures: tiny models built once per test session (same builder as `make-tiny-model`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.engine.tiny_model import TinyModelSpec, build_tiny_model

TINY_SPECS = {
    "llama": TinyModelSpec(arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                           vocab_size=512, seed=0),
    "qwen2": TinyModelSpec(arch="qwen2", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                           vocab_size=512, seed=1),
}


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: build_tiny_model(root / name, spec) for name, spec in TINY_SPECS.items()}


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dirs) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_model_dirs) -> Path:
    return tiny_model_dirs["qwen2"]
