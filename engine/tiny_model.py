"""Tiny Hugging Face-format models built locally: random weights from a fixed seed, a
byte-level BPE tokenizer trained in-process, and a ChatML chat template.

Used by the tests and the benchmarks that need a model of a given shape. The result is an
ordinary model directory, loaded by the same code path as a real checkpoint; nothing is
downloaded. Building is deterministic: the same spec gives byte-identical files.

The embedded models (`--model default`, `default-draft`) are not built here: they are trained
by engine/tiny_training.py and shipped as package data (resolve_model_path finds them).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, GenerationConfig, LlamaConfig, PretrainedConfig,
                          PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX

from splitserve.common.model_dir import DEFAULT_MODEL_NAME, EMBEDDED_MODELS

# Bump whenever the builder's output changes for an unchanged spec, so cached models built by
# an older version (the benchmarks cache theirs by fingerprint) are not silently reused.
BUILDER_VERSION = 3

EOS_TOKEN = "<|endoftext|>"
END_OF_TURN_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", END_OF_TURN_TOKEN)

# 256 byte symbols + the special tokens + a few merges.
MIN_VOCAB_SIZE = 300
# Keeps the invented-word pool far below the number of distinct syllable words (~24M).
MAX_VOCAB_SIZE = 1 << 18

ARCH_CONFIGS: dict[str, type[PretrainedConfig]] = {"llama": LlamaConfig, "qwen2": Qwen2Config}

# ChatML as in Qwen2, without Qwen's implicit default system prompt.
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
    "server request cache block prefix decode prefill worker router stream latency memory cluster answer "
    "question help please thank hello yes friend family child mother father school work life book word "
    "name home room food table paper music color green blue red white black sun moon star tree flower "
    "bird fish dog cat horse sea island mountain forest rain snow wind fire earth air summer winter "
    "spring autumn king queen ship boat car train bridge market street church castle song dance game "
    "write read speak listen think know want need make take give find keep begin end start stop run walk "
    "go come see look hear feel try ask call turn move live believe bring happen stand sit lose pay meet "
    "include continue set learn change lead understand watch follow create allow add spend grow offer "
    "remember love consider appear buy wait serve die send expect build stay fall cut reach kill remain "
    "suggest raise pass sell require report decide pull return explain hope develop carry break receive "
    "agree support hit produce eat cover catch draw choose cause point plan order form result reason "
    "simple quick quiet happy sure real true whole free clear full warm cold dark bright early late"
).split()

_SYLLABLES = ("ka", "lo", "mi", "ten", "ra", "vo", "shu", "pel", "dar", "in", "ex", "qua", "zo", "bri", "nu",
              "gor", "fle", "ath", "um", "sy", "wen", "tor", "ly", "cha", "pri", "os", "ve", "dri", "mon", "ix")


def _check_vocab_size(vocab_size: int) -> None:
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be in [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}], got {vocab_size}")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and seed of a tiny model; validated on construction."""

    arch: str = "llama"
    """Model family: "llama" or "qwen2" (qwen2 adds q/k/v projection biases)."""
    num_layers: int = 2
    """Number of decoder layers."""
    hidden_size: int = 64
    """Residual stream width; hidden_size / num_heads is the head dim and must be even (RoPE)."""
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide num_heads."""
    vocab_size: int = 512
    """Exact tokenizer size and embedding rows (>= 300: 256 byte symbols + specials + merges)."""
    intermediate_size: int | None = None
    """MLP width; None derives 8/3 x hidden_size rounded up to a multiple of 32."""
    max_position_embeddings: int = 2048
    """Longest sequence the config (and tokenizer) advertise."""
    seed: int = 0
    """Seeds both the tokenizer corpus and the weights."""
    tie_word_embeddings: bool = False
    """Share the input embedding matrix with the LM head."""
    initializer_range: float = 0.1
    """Std of the random weights; larger than HF's 0.02 so random logits are not flat."""

    def __post_init__(self) -> None:
        if self.arch not in ARCH_CONFIGS:
            raise ValueError(f"arch must be one of {sorted(ARCH_CONFIGS)}, got {self.arch!r}")
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "max_position_embeddings",
                     "intermediate_size", "initializer_range"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be num_heads ({self.num_heads}) x an even "
                             "head dim (RoPE rotates pairs of channels)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        _check_vocab_size(self.vocab_size)

    @property
    def mlp_width(self) -> int:
        """The MLP width actually used (intermediate_size or the derived default)."""
        return self.intermediate_size or -(-8 * self.hidden_size // (3 * 32)) * 32

    def fingerprint(self) -> str:
        """Short hash naming the built files: the spec, this builder and the libraries that make the bytes."""
        versions = [BUILDER_VERSION, torch.__version__, transformers.__version__, tokenizers.__version__]
        payload = json.dumps([asdict(self), versions], sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


EMBEDDED_MODELS_DIR = Path(__file__).resolve().parent / "default_models"
"""The embedded trained models: DEFAULT_MODEL_NAME (what `--model default` serves, trained on the Python
stdlib: docs/models.md) and DRAFT_MODEL_NAME."""


def _invented_words(rng: random.Random, count: int) -> list[str]:
    """`count` distinct made-up words; each can become a token, which is what makes large vocabs reachable."""
    words: dict[str, None] = {}  # a dict, not a set: insertion order keeps the corpus deterministic
    while len(words) < count:
        words.setdefault("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 5))), None)
    return list(words)


def _synthetic_corpus(seed: int, num_invented: int) -> list[str]:
    """English-like sentences: mostly common words, the rest from `num_invented` made-up words."""
    rng = random.Random(seed)
    invented = _invented_words(rng, num_invented)
    sentences = []
    for _ in range(num_invented):
        words = [rng.choice(_WORDS) if rng.random() < 0.6 else rng.choice(invented) for _ in range(rng.randint(4, 14))]
        sentences.append(" ".join(words).capitalize() + rng.choice((".", "?", "!", ",", ";")))
    return sentences


def _byte_level_pipeline(tokenizer: Tokenizer) -> None:
    """GPT-2 style: no normalizer, ByteLevel with its built-in split regex (what the llama tiny model uses)."""
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)


def _qwen2_pipeline(tokenizer: Tokenizer) -> None:
    """The normalizer and pre-tokenizer transformers' Qwen2Tokenizer rebuilds on load (NFC + Qwen's split regex +
    ByteLevel without its own regex). tokenizer.json must carry the same pipeline, since the router reads that
    file while transformers (and anyone comparing against it) ignores the file's pipeline for model_type qwen2."""
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# Per arch: sets the normalizer/pre-tokenizer the merges are trained with and tokenizer.json is saved with.
_TOKENIZER_PIPELINES = {"llama": _byte_level_pipeline, "qwen2": _qwen2_pipeline}


def _train_bpe(vocab_size: int, corpus: list[str], arch: str) -> Tokenizer:
    # The trainer's output does not depend on thread count or hash seeds (checked by the tests),
    # so no RAYON_NUM_THREADS pinning is needed for determinism.
    tokenizer = Tokenizer(models.BPE())
    _TOKENIZER_PIPELINES[arch](tokenizer)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def build_tokenizer(vocab_size: int, seed: int, arch: str = "llama") -> PreTrainedTokenizerFast:
    """Byte-level BPE of exactly `vocab_size` tokens with a ChatML template and `arch`'s normalizer and
    pre-tokenizer; a pure function of its arguments."""
    _check_vocab_size(vocab_size)
    if arch not in _TOKENIZER_PIPELINES:
        raise ValueError(f"arch must be one of {sorted(_TOKENIZER_PIPELINES)}, got {arch!r}")
    # About one invented word per token is enough in practice; on a shortfall the pool
    # doubles, which keeps the result deterministic.
    num_invented = vocab_size
    tokenizer = _train_bpe(vocab_size, _synthetic_corpus(seed, num_invented), arch)
    while tokenizer.get_vocab_size() < vocab_size:
        num_invented *= 2
        tokenizer = _train_bpe(vocab_size, _synthetic_corpus(seed, num_invented), arch)
    assert tokenizer.get_vocab_size() == vocab_size, (tokenizer.get_vocab_size(), vocab_size)
    return _with_chat_template(tokenizer)


def train_tokenizer(vocab_size: int, corpus: list[str], arch: str = "llama") -> PreTrainedTokenizerFast:
    """build_tokenizer's tokenizer, with merges learnt from `corpus` (which must be large enough to
    yield exactly `vocab_size` tokens); a pure function of its arguments."""
    _check_vocab_size(vocab_size)
    tokenizer = _train_bpe(vocab_size, corpus, arch)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"the corpus yields only {tokenizer.get_vocab_size()} tokens, fewer than {vocab_size}")
    return _with_chat_template(tokenizer)


def _with_chat_template(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    # No BOS token (Qwen2 style): the backend has no post-processor, so nothing is prepended.
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)


def _hf_config(spec: TinyModelSpec, eos_id: int) -> PretrainedConfig:
    return ARCH_CONFIGS[spec.arch](
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.mlp_width,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=1e-6, rope_theta=10000.0,
        initializer_range=spec.initializer_range, tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id, dtype="float32")


def _random_model(spec: TinyModelSpec, config: PretrainedConfig) -> PreTrainedModel:
    # fork_rng: seeding here must not reset the caller's global random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if spec.arch == "qwen2":
            # HF initializes the projection biases to zero; random ones exercise the bias path.
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=spec.initializer_range)
    return model


def check_output_dir(out_dir: str | Path) -> None:
    """ValueError unless `out_dir` may be written as a model directory: missing, empty, or a model
    directory already (a rebuild replaces it whole). Anything else would be deleted by the replace
    (`make-tiny-model ~/work` once took a user's folder with it), so it is refused before any work."""
    out_dir = Path(out_dir)
    if not out_dir.exists() or _is_model_dir(out_dir) or (out_dir.is_dir() and not any(out_dir.iterdir())):
        return
    raise ValueError(f"{out_dir}: exists and is not a model directory (no config.json): choose a new or empty "
                     "directory")


@contextmanager
def _atomic_dir(out_dir: Path) -> Iterator[Path]:
    """Yield a staging directory beside `out_dir` that replaces it only once completely written
    (check_output_dir first: never a folder or file that is not a model directory)."""
    check_output_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    old = staging.with_name(staging.name + ".old")
    try:
        yield staging
        staging.chmod(0o755)  # mkdtemp makes it private; a model directory is readable like any other
        # rename() cannot replace a non-empty directory, so a previous model is moved aside first.
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def random_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """`spec`'s model with random weights from spec.seed (float32), its generation config set for `tokenizer`."""
    eos_id, end_of_turn_id = tokenizer.convert_tokens_to_ids([EOS_TOKEN, END_OF_TURN_TOKEN])
    model = _random_model(spec, _hf_config(spec, eos_id))
    # Chat turns end with <|im_end|>, plain completions with <|endoftext|>: generation stops on either.
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, end_of_turn_id], pad_token_id=eos_id)
    return model


def write_model_dir(out_dir: str | Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast,
                    extra_files: dict[str, str] | None = None) -> Path:
    """Save model, tokenizer and `extra_files` (name -> text) as `out_dir`, replacing it atomically."""
    out_dir = Path(out_dir)
    with _atomic_dir(out_dir) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text)
    return out_dir


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec) -> Path:
    """Write a complete model directory for `spec` to `out_dir` (replacing it); a crash never leaves half a model."""
    check_output_dir(out_dir)
    tokenizer = build_tokenizer(spec.vocab_size, spec.seed, spec.arch)
    tokenizer.model_max_length = spec.max_position_embeddings
    return write_model_dir(out_dir, random_model(spec, tokenizer), tokenizer)


def default_cache_dir() -> Path:
    """Where built models are cached: $SPLITSERVE_CACHE_DIR, else ~/.cache/splitserve."""
    return Path(os.environ.get("SPLITSERVE_CACHE_DIR") or Path.home() / ".cache" / "splitserve").expanduser()


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def embedded_model_path(name: str) -> Path:
    """The shipped model directory of an EMBEDDED_MODELS name (package data of splitserve.engine)."""
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"{name!r} is not an embedded model; those are {', '.join(EMBEDDED_MODELS)}")
    return EMBEDDED_MODELS_DIR / name


def resolve_model_path(name_or_path: str | Path) -> Path:
    """The shipped model for an EMBEDDED_MODELS name ("default", "default-draft"), else `name_or_path`
    if it is a model directory."""
    if str(name_or_path) in EMBEDDED_MODELS:
        return embedded_model_path(str(name_or_path))
    path = Path(name_or_path).expanduser()
    if not _is_model_dir(path):
        raise FileNotFoundError(f"{str(name_or_path)!r} is not a model directory (no config.json in {path}); "
                                f"use {DEFAULT_MODEL_NAME!r} for the embedded model or build one with "
                                "`splitserve make-tiny-model DIR`")
    return path
