"""Train a small Llama-family model on the Python standard library (`splitserve train-tiny-model`).

Plain torch: transformers' LlamaForCausalLM as the network, AdamW, linear warmup then a cosine
decay, random windows of the training files' token stream. Everything random comes from the
config's seed, so a run is reproducible for a fixed thread count (the record names it). The
output is an ordinary model directory (bf16 safetensors, tokenizer, chat template, generation
config) plus `training_record.json`, which says what the model saw and how well it did.
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import tokenizers
import torch
import transformers
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from splitserve.engine.stdlib_corpus import HELDOUT_EVERY, CorpusSplit, files_hash
from splitserve.engine.tiny_model import (EOS_TOKEN, TinyModelSpec, check_output_dir, random_model, train_tokenizer,
                                          write_model_dir)

RECORD_FILE = "training_record.json"
EVAL_BATCH_SIZE = 8
"""Held-out windows per forward pass; any value gives the same mean loss (up to float rounding)."""


@dataclass(frozen=True)
class TrainingConfig:
    """What `train` does; validated on construction."""

    model: TinyModelSpec
    """Shape, vocabulary size and seed (weights init, tokenizer-independent) of the model."""
    context_len: int = 256
    """Tokens per training window (and per held-out window)."""
    batch_size: int = 16
    """Windows per optimizer step."""
    steps: int = 1000
    """Optimizer steps."""
    peak_lr: float = 2e-3
    """Learning rate after warmup; the cosine decays it to peak_lr * min_lr_ratio at the last step."""
    warmup_steps: int = 50
    """Steps of linear warmup from 0 to peak_lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of peak_lr."""
    weight_decay: float = 0.1
    """AdamW decay of matrices (embeddings included); norms are not decayed."""
    grad_clip: float = 1.0
    """Max global gradient norm."""
    heldout_every: int = HELDOUT_EVERY
    """About 1 in this many files is held out (stdlib_corpus.is_heldout)."""
    threads: int = 1
    """torch intra-op threads (losses are reproducible for a fixed count)."""
    bf16_autocast: bool = True
    """Training forward/backward matmuls in bf16 under torch.autocast (weights, gradients and AdamW state
    stay float32): 1.6-1.7x the tokens/s of float32 on this project's AVX-512-bf16 CPUs."""

    def __post_init__(self) -> None:
        for name in ("context_len", "batch_size", "steps", "peak_lr", "heldout_every", "threads", "grad_clip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps), got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1 or self.weight_decay < 0:
            raise ValueError("min_lr_ratio must be in [0, 1] and weight_decay >= 0")
        if self.context_len > self.model.max_position_embeddings:
            raise ValueError(f"context_len {self.context_len} exceeds the model's max_position_embeddings "
                             f"{self.model.max_position_embeddings}")


@dataclass(frozen=True)
class TrainingRecord:
    """What a training run saw and reached; saved as training_record.json beside the weights."""

    config: TrainingConfig
    python_version: str
    stdlib_root: str
    files_hash: str
    """stdlib_corpus.files_hash of all files (training then held-out): names the corpus."""
    num_train_files: int
    heldout_files: tuple[str, ...]
    train_tokens: int
    """Tokens in the training stream (files joined by EOS)."""
    heldout_tokens: int
    """Predicted tokens in the held-out windows."""
    num_parameters: int
    steps: int
    tokens_seen: int
    final_train_loss: float
    """Mean training loss of the last 5% of steps (at least one)."""
    heldout_loss: float
    """Mean next-token cross-entropy (nats) on the held-out windows, of the saved bf16 weights."""
    step_losses: tuple[float, ...]
    wall_time_s: float
    """Tokenizer training, encoding, the optimizer steps and the held-out evaluation (not saving)."""
    train_time_s: float
    """The optimizer steps alone."""
    threads: int
    torch_version: str
    transformers_version: str
    tokenizers_version: str

    @property
    def heldout_perplexity(self) -> float:
        return math.exp(self.heldout_loss)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "heldout_perplexity": self.heldout_perplexity}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "TrainingRecord":
        data = json.loads(text)
        data.pop("heldout_perplexity")
        config = data.pop("config")
        config = TrainingConfig(model=TinyModelSpec(**config.pop("model")), **config)
        tuples = {name: tuple(data.pop(name)) for name in ("heldout_files", "step_losses")}
        return cls(config=config, **tuples, **data)


def read_record(model_dir: Path) -> TrainingRecord:
    return TrainingRecord.from_json((Path(model_dir) / RECORD_FILE).read_text())


def token_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """Every text's tokens followed by EOS, concatenated: [num_tokens] int64."""
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    ids: list[int] = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def eval_windows(stream: torch.Tensor, context_len: int) -> torch.Tensor:
    """Non-overlapping windows [N, context_len + 1]: inputs w[:-1] predict targets w[1:]; a final
    partial window is dropped, so each of the N * context_len targets is predicted once."""
    num_windows = (len(stream) - 1) // context_len
    starts = torch.arange(num_windows) * context_len  # [N]
    return stream[starts.unsqueeze(1) + torch.arange(context_len + 1)]  # [N, context_len + 1]


def _random_windows(stream: torch.Tensor, batch_size: int, context_len: int,
                    generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - context_len, (batch_size,), generator=generator)  # [B]
    return stream[starts.unsqueeze(1) + torch.arange(context_len + 1)]  # [B, context_len + 1]


def next_token_loss(model: PreTrainedModel, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats) of predicting windows[:, 1:] from windows[:, :-1]."""
    logits = model(input_ids=windows[:, :-1]).logits  # [B, T, vocab]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten())


@torch.inference_mode()
def heldout_loss(model: PreTrainedModel, windows: torch.Tensor) -> float:
    """Mean next-token loss over all windows (every window has the same number of targets)."""
    model.eval()
    losses = [next_token_loss(model, batch).item() * len(batch) for batch in windows.split(EVAL_BATCH_SIZE)]
    return sum(losses) / len(windows)


def learning_rate(config: TrainingConfig, step: int) -> float:
    """Linear warmup to peak_lr, then a cosine down to peak_lr * min_lr_ratio at the last step."""
    if step < config.warmup_steps:
        return config.peak_lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - 1 - config.warmup_steps)
    floor = config.peak_lr * config.min_lr_ratio
    return floor + (config.peak_lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _optimizer(model: PreTrainedModel, config: TrainingConfig) -> torch.optim.AdamW:
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": config.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.peak_lr, betas=(0.9, 0.95), eps=1e-8)


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _optimize(model: PreTrainedModel, stream: torch.Tensor, config: TrainingConfig,
              show_progress: bool) -> list[float]:
    """Run config.steps AdamW steps on random windows of `stream`; returns each step's loss."""
    optimizer = _optimizer(model, config)
    generator = torch.Generator().manual_seed(config.model.seed)
    tokens_per_step = config.batch_size * config.context_len
    losses: list[float] = []
    model.train()
    started = time.perf_counter()
    with tqdm(range(config.steps), desc="train", disable=not show_progress, unit="step") as progress:
        for step in progress:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(config, step)
            windows = _random_windows(stream, config.batch_size, config.context_len, generator)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16_autocast):
                loss = next_token_loss(model, windows)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            losses.append(loss.item())
            tokens_per_s = (step + 1) * tokens_per_step / (time.perf_counter() - started)
            progress.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_s:.0f}")
    return losses


def _round_to_bf16(model: PreTrainedModel) -> PreTrainedModel:
    """The model as it will be saved (bf16 weights); float32 compute, so evaluation sees only the rounding."""
    return model.to(torch.bfloat16).to(torch.float32)


def train(config: TrainingConfig, split: CorpusSplit, out_dir: str | Path,
          show_progress: bool = False) -> TrainingRecord:
    """Train on split.train, evaluate on split.heldout, write the model directory; returns the record.
    An `out_dir` that may not be replaced is refused before training (check_output_dir)."""
    check_output_dir(out_dir)
    started = time.perf_counter()
    with _torch_threads(config.threads), torch.random.fork_rng(devices=[]):
        train_texts = split.read(split.train)
        tokenizer = train_tokenizer(config.model.vocab_size, train_texts, config.model.arch)
        tokenizer.model_max_length = config.model.max_position_embeddings
        stream = token_stream(tokenizer, train_texts)
        heldout = eval_windows(token_stream(tokenizer, split.read(split.heldout)), config.context_len)
        model = random_model(config.model, tokenizer)
        optimize_started = time.perf_counter()
        losses = _optimize(model, stream, config, show_progress)
        train_time_s = time.perf_counter() - optimize_started
        model = _round_to_bf16(model)
        loss = heldout_loss(model, heldout)
    tail = losses[-max(1, len(losses) // 20):]
    wall_time_s = time.perf_counter() - started
    record = TrainingRecord(
        config=config, python_version=platform.python_version(), stdlib_root=str(split.root),
        files_hash=files_hash(split.root, split.train + split.heldout), num_train_files=len(split.train),
        heldout_files=split.heldout, train_tokens=len(stream), heldout_tokens=heldout[:, 1:].numel(),
        num_parameters=sum(p.numel() for p in model.parameters()), steps=config.steps,
        tokens_seen=config.steps * config.batch_size * config.context_len, final_train_loss=sum(tail) / len(tail),
        heldout_loss=loss, step_losses=tuple(losses), wall_time_s=wall_time_s, train_time_s=train_time_s,
        threads=config.threads, torch_version=torch.__version__, transformers_version=transformers.__version__,
        tokenizers_version=tokenizers.__version__)
    write_model_dir(out_dir, model.to(torch.bfloat16), tokenizer, {RECORD_FILE: record.to_json()})
    return record


# The shipped models (engine/default_models/): `splitserve train-tiny-model DIR --preset NAME` retrains
# them. Sized for about 20 minutes (main) and a few minutes (draft) on one busy core of a 2-core
# machine: at this budget (~2M tokens) a 5.5M-parameter model reached a lower held-out loss per second
# than an 8.5M one, and one thread ran faster than two while other work shared the cores (docs/models.md).
PRESETS: dict[str, TrainingConfig] = {
    "main": TrainingConfig(
        model=TinyModelSpec(arch="llama", num_layers=6, hidden_size=256, num_heads=8, num_kv_heads=4,
                            vocab_size=4096, max_position_embeddings=512, tie_word_embeddings=True,
                            initializer_range=0.02, seed=0),
        context_len=512, batch_size=4, steps=1100, peak_lr=3e-3, warmup_steps=50, threads=1),
    "draft": TrainingConfig(
        model=TinyModelSpec(arch="llama", num_layers=2, hidden_size=96, num_heads=4, num_kv_heads=2,
                            vocab_size=4096, max_position_embeddings=512, tie_word_embeddings=True,
                            initializer_range=0.02, seed=0),
        context_len=512, batch_size=4, steps=1100, peak_lr=3e-3, warmup_steps=50, threads=1),
}
