"""Quality of a model directory under an engine configuration.

For each held-out window of the model's training record (the stdlib files it never saw), the
engine under test scores every position (EngineCore.prompt_logits: the serving path, its dtype
and kernels) and the reference, the same model directory in float32 through transformers, does
too. Per configuration this yields one held-out loss / perplexity, the fraction of positions
whose top-1 token equals the reference's, and the mean KL(reference || engine) in nats: the
numbers quantization and speculative decoding report against.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, PreTrainedModel

from splitserve.engine.llm import LLM, load_tokenizer
from splitserve.engine.stdlib_corpus import CorpusSplit, files_hash, read_sources, stdlib_root
from splitserve.engine.tiny_model import random_model, write_model_dir
from splitserve.engine.tiny_training import eval_windows, read_record, token_stream

REFERENCE_NAME = "transformers-float32"
"""The reference's row in the results: itself, so agreement 1 and KL 0, and its own perplexity."""
BLOCK_SIZE = 16


@dataclass(frozen=True)
class EngineVariant:
    """One engine configuration under test. Quantization and speculative decoding add their fields here
    (e.g. a weight format, a draft model directory) and pass them on in engine_fields()."""

    name: str
    """Label in the results and the plot."""
    dtype: str = "float32"
    """Compute and KV dtype (EngineConfig.dtype): float32, bfloat16, float16 or auto (the checkpoint's)."""
    cpu_kernels: bool = True
    """The engine's C++ CPU kernels (False: the pure-torch reference ops)."""
    kv_cache_dtype: str = "auto"
    """EngineConfig.kv_cache_dtype: auto (KV in `dtype`), int8 or fp8_e4m3 (a quantized KV cache)."""
    quantization: str = "auto"
    """EngineConfig.quantization: int8 / int4 quantize the weights at load; auto follows the checkpoint."""
    quantization_group_size: int = 128
    """EngineConfig.quantization_group_size (int4)."""
    model_dir: Path | None = None
    """Another directory holding the same model (a GPTQ / AWQ checkpoint of it); None: the evaluated one."""

    def engine_fields(self, max_model_len: int) -> dict:
        """EngineConfig fields: a KV pool of exactly one window, which is all scoring needs."""
        return dict(dtype=self.dtype, cpu_kernels=self.cpu_kernels, kv_cache_dtype=self.kv_cache_dtype,
                    quantization=self.quantization, quantization_group_size=self.quantization_group_size,
                    block_size=BLOCK_SIZE,
                    max_model_len=max_model_len, num_kv_blocks=-(-max_model_len // BLOCK_SIZE),
                    enable_prefix_caching=False)


@dataclass(frozen=True)
class QualityResult:
    """One configuration's numbers over the same held-out windows."""

    model: str
    """The model directory's name."""
    variant: str
    dtype: str
    num_windows: int
    num_tokens: int
    """Predicted positions (windows x context length)."""
    loss: float
    """Mean next-token cross-entropy, nats."""
    top1_agreement: float
    """Fraction of positions whose argmax equals the reference's."""
    kl_divergence: float
    """Mean over positions of KL(reference || this), nats."""
    seconds: float
    """Wall time of this configuration's scoring."""

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


@dataclass
class _Totals:
    """Running sums of one configuration."""

    nll: float = 0.0
    agree: int = 0
    kl: float = 0.0
    positions: int = 0
    seconds: float = 0.0

    def add(self, logprobs: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor) -> None:
        """logprobs, reference: [T, vocab] log-softmax; targets: [T]."""
        self.nll -= logprobs.gather(1, targets.unsqueeze(1)).sum().item()
        self.agree += (logprobs.argmax(-1) == reference.argmax(-1)).sum().item()
        self.kl += (reference.exp() * (reference - logprobs)).sum().item()
        self.positions += len(targets)

    def result(self, model: str, variant: str, dtype: str, num_windows: int) -> QualityResult:
        return QualityResult(model, variant, dtype, num_windows, self.positions, self.nll / self.positions,
                             self.agree / self.positions, self.kl / self.positions, self.seconds)


def heldout_windows(model_dir: str | Path, max_windows: int | None = None, stdlib: Path | None = None) -> torch.Tensor:
    """The held-out windows [N, context_len + 1] of a trained model directory: its record's held-out files
    (read under `stdlib`, default the running interpreter's), tokenized and cut as training evaluated them."""
    record = read_record(Path(model_dir))
    root = stdlib or stdlib_root()
    stream = token_stream(load_tokenizer(model_dir), read_sources(root, record.heldout_files))
    return eval_windows(stream, record.config.context_len)[:max_windows]


def corpus_matches_record(model_dir: str | Path, stdlib: Path | None = None) -> bool:
    """Whether this interpreter's stdlib is the one the model was trained on (same files, same bytes)."""
    record = read_record(Path(model_dir))
    split = CorpusSplit.of(stdlib or stdlib_root(), record.config.heldout_every)
    return files_hash(split.root, split.train + split.heldout) == record.files_hash


def _reference(model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def evaluate(model_dir: str | Path, variants: list[EngineVariant], windows: torch.Tensor,
             show_progress: bool = False) -> list[QualityResult]:
    """The reference's row, then one row per variant, all over `windows` [N, T + 1]."""
    model_dir = Path(model_dir)
    reference_model = _reference(model_dir)
    max_model_len = windows.shape[1] - 1
    engines = [LLM(variant.model_dir or model_dir, **variant.engine_fields(max_model_len)) for variant in variants]
    reference_totals, totals = _Totals(), [_Totals() for _ in variants]
    for window in tqdm(windows, desc=f"evaluate {model_dir.name}", disable=not show_progress, unit="window"):
        inputs, targets = window[:-1], window[1:]  # [T] each
        started = time.perf_counter()
        reference = torch.log_softmax(reference_model(input_ids=inputs.unsqueeze(0)).logits[0].float(), -1)
        reference_totals.seconds += time.perf_counter() - started
        reference_totals.add(reference, reference, targets)
        for engine, total in zip(engines, totals):
            started = time.perf_counter()
            logprobs = torch.log_softmax(engine.prompt_logits(inputs.tolist()), -1)  # [T, vocab]
            total.seconds += time.perf_counter() - started
            total.add(logprobs, reference, targets)
    rows = [reference_totals.result(model_dir.name, REFERENCE_NAME, "float32", len(windows))]
    return rows + [t.result(model_dir.name, v.name, v.dtype, len(windows)) for v, t in zip(variants, totals)]


def random_twin(model_dir: str | Path, out_dir: str | Path) -> Path:
    """A model directory of the same shape and tokenizer as a trained `model_dir`, with the weights its
    training started from (same initialization and seed): the contrast for the trained model's numbers.
    It has no training record; evaluate it on the trained model's heldout_windows."""
    model_dir = Path(model_dir)
    tokenizer = load_tokenizer(model_dir)
    model = random_model(read_record(model_dir).config.model, tokenizer).to(torch.bfloat16)
    return write_model_dir(out_dir, model, tokenizer)
