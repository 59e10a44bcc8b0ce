"""Tiny Hugging Face-format models built locally: random weights from a fixed seed, a
byte-level BPE tokenizer trained in-process, and a ChatML chat template.

Used by the tests, the benchmarks and as the embedded default model; the result is an
ordinary model directory, loaded by the same code path as a real checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the of and to in is was for on that with as by at from it this be are or his had her not which but "
    "they have one you were all their an we been has more when who will would there so can if no out into "
    "some time two than up what other about only then them these may its over first new could like after "
    "also made most through well years where before man water river mill road town house city stone light "
    "morning evening night day year people world hand place part field village garden window door story "
    "tell me about old young small large long short high low good great little own right left open under "
    "between again never always often every each many much very still just here now why how because "
    "while during without within along across among around against toward upon number system model token "
    "server request cache block prefix decode prefill worker router stream latency memory cluster"
).split()

_SYLLABLES = ("ka", "lo", "mi", "ten", "ra", "vo", "shu", "pel", "dar", "in", "ex", "qua", "zo", "bri", "nu",
              "gor", "fle", "ath", "um", "sy", "wen", "tor", "ly", "cha", "pri", "os", "ve", "dri", "mon", "ix")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and seed of a tiny model; validated on construction."""

    arch: str = "llama"
    """llama or qwen2 (qwen2 adds q/k/v projection biases)."""
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 512
    """Exact tokenizer size and embedding rows (>= 300: 256 byte symbols + specials + merges)."""
    intermediate_size: int | None = None
    """MLP width; None derives ~8/3 x hidden rounded up to a multiple of 32."""
    max_position_embeddings: int = 2048
    seed: int = 0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.1
    """Std of the random weights; larger than HF's 0.02 so logits are not flat."""

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen2"):
            raise ValueError(f"arch must be llama or qwen2, got {self.arch!r}")
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if self.vocab_size < 300:
            raise ValueError(f"vocab_size must be >= 300, got {self.vocab_size}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1, got {self.intermediate_size}")

    @property
    def mlp_width(self) -> int:
        return self.intermediate_size or -(-(8 * self.hidden_size // 3) // 32) * 32

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


DEFAULT_MODEL_SPEC = TinyModelSpec(arch="llama", num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4,
                                   vocab_size=2048, seed=0)


def synthetic_corpus(seed: int, num_sentences: int) -> list[str]:
    """Deterministic English-like sentences mixing real words and made-up syllable words."""
    rng = random.Random(seed)
    invented = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(4000)]
    sentences = []
    for _ in range(num_sentences):
        words = [rng.choice(_WORDS) if rng.random() < 0.7 else rng.choice(invented) for _ in range(rng.randint(4, 14))]
        sentences.append(" ".join(words).capitalize() + rng.choice((".", "?", "!", ",", ";")))
    return sentences


def _train_bpe(vocab_size: int, seed: int, num_sentences: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(synthetic_corpus(seed, num_sentences), trainer=trainer)
    return tokenizer


def build_tokenizer(vocab_size: int, seed: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE of exactly `vocab_size` tokens; the corpus grows until enough merges exist."""
    num_sentences = 2000
    tokenizer = _train_bpe(vocab_size, seed, num_sentences)
    while tokenizer.get_vocab_size() < vocab_size:
        num_sentences *= 4
        tokenizer = _train_bpe(vocab_size, seed, num_sentences)
    assert tokenizer.get_vocab_size() == vocab_size
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)


def _hf_config(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast):
    config_class = LlamaConfig if spec.arch == "llama" else Qwen2Config
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return config_class(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.mlp_width,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=1e-6, rope_theta=10000.0,
        initializer_range=spec.initializer_range, tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id, dtype="float32")


def _random_model(spec: TinyModelSpec, config) -> torch.nn.Module:
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if spec.arch == "qwen2":
        # HF initializes projection biases to zero; random ones exercise the bias path.
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=spec.initializer_range)
    return model.eval()


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec) -> Path:
    """Write the model directory atomically (a crash never leaves a half-written model)."""
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(spec.vocab_size, spec.seed)
    config = _hf_config(spec, tokenizer)
    model = _random_model(spec, config)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
        GenerationConfig(eos_token_id=eos_ids, pad_token_id=eos_ids[0]).save_pretrained(staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPLITSERVE_CACHE_DIR", Path.home() / ".cache" / "splitserve"))


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """The embedded default model, built on first use and reused afterwards."""
    path = (cache_dir or default_cache_dir()) / f"default-{DEFAULT_MODEL_SPEC.fingerprint()}"
    if not (path / "config.json").is_file():
        build_tiny_model(path, DEFAULT_MODEL_SPEC)
    return path


def resolve_model_path(name_or_path: str) -> Path:
    if name_or_path == "default":
        return ensure_default_model()
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    return path
