"""The tiny models of tests and benches (tests/conftest.py builds them once per test session,
bench/fault_matrix.py into a temporary directory): same builder as `make-tiny-model`."""

from __future__ import annotations

from splitserve.engine.tiny_model import TinyModelSpec

TINY_SPECS = {
    "llama": TinyModelSpec(arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                           vocab_size=512, seed=0),
    "qwen2": TinyModelSpec(arch="qwen2", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                           vocab_size=512, seed=1),
}
