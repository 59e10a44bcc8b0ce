"""The tiny models of tests and benches (tests/conftest.py builds them once per test session,
bench/fault_matrix.py into a temporary directory): same builder as `make-tiny-model`."""

from __future__ import annotations

from pathlib import Path

from splitserve.engine.tiny_model import TinyModelSpec, build_tiny_model, default_cache_dir

TINY_SPECS = {
    "llama": TinyModelSpec(arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                           vocab_size=512, seed=0),
    "qwen2": TinyModelSpec(arch="qwen2", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                           vocab_size=512, seed=1),
}

RANDOM_SERVING_SPEC = TinyModelSpec(arch="llama", num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4,
                                    vocab_size=2048, seed=0)
"""The random-weight model the serving benchmarks measure with (it was `--model default` until a trained model
took that name): their recorded results stay comparable, and its 2048 positions fit their longest prompts."""


def cached_tiny_model(spec: TinyModelSpec) -> Path:
    """The model of `spec`, built on first use into the cache and reused (keyed by its fingerprint)."""
    path = default_cache_dir() / f"bench-{spec.fingerprint()}"
    if not (path / "config.json").is_file():
        build_tiny_model(path, spec)
    return path
