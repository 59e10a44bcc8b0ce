"""The tiny model builder: deterministic, HF-loadable, exact tokenizer size, working chat template, atomic writes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import unicodedata

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from splitserve.deploy.cli import main as cli_main
from splitserve.engine import tiny_model
from splitserve.engine.tiny_model import (EMBEDDED_MODELS_DIR, TinyModelSpec, build_tiny_model, build_tokenizer,
                                          embedded_model_path, resolve_model_path)
from splitserve.testing.tiny_models import TINY_SPECS

MODEL_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json",
               "generation_config.json", "chat_template.jinja")


def test_same_spec_gives_identical_files(tmp_path, tiny_llama_dir):
    again = build_tiny_model(tmp_path / "again", TINY_SPECS["llama"])
    for name in MODEL_FILES:
        assert (again / name).read_bytes() == (tiny_llama_dir / name).read_bytes(), name


def test_different_seed_changes_weights(tmp_path, tiny_llama_dir):
    other = build_tiny_model(tmp_path / "other", TinyModelSpec(seed=5))
    a = load_file(tiny_llama_dir / "model.safetensors")
    b = load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    assert not a["model.embed_tokens.weight"].equal(b["model.embed_tokens.weight"])


def test_tokenizer_is_identical_in_another_process_with_one_thread():
    # A fresh process has other hash seeds and here a different thread count: neither may change the merges.
    code = ("import hashlib; from splitserve.engine.tiny_model import build_tokenizer; "
            "print(hashlib.sha256(build_tokenizer(4096, 3).backend_tokenizer.to_str().encode()).hexdigest())")
    env = {**os.environ, "RAYON_NUM_THREADS": "1"}
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    here = hashlib.sha256(build_tokenizer(4096, 3).backend_tokenizer.to_str().encode()).hexdigest()
    assert other.stdout.strip() == here


def test_building_does_not_reseed_the_callers_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", TinyModelSpec(num_layers=1))
    assert torch.rand(3).equal(expected)


@pytest.mark.parametrize("vocab_size", [300, 512, 4096])
def test_tokenizer_has_exactly_the_requested_size(vocab_size):
    tokenizer = build_tokenizer(vocab_size, seed=0)
    assert len(tokenizer) == vocab_size
    assert tokenizer.backend_tokenizer.get_vocab_size() == vocab_size


@pytest.mark.parametrize("text", [
    "Grüße, 世界! 🚀 naïve café",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "日本語のテキストと한국어 and 👩‍👩‍👧 (a ZWJ emoji) + é (combining accent)",
    "special tokens inside text: <|im_start|>user\nhi<|im_end|>",
])
def test_encode_decode_round_trip_is_exact(tiny_llama_dir, text):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")


# Where pre-tokenizers and normalizers differ: runs of spaces/newlines, digits, contractions, emoji
# sequences, composed vs decomposed accents, compatibility characters NFC leaves alone.
TRICKY_TEXTS = (
    "", " ", "   ", "\n", "a\n \n b  ", "Hello,  World!\n\n  x\r\n\ttab\t\t", "  leading and trailing  ",
    "2024 3.14159 1,000,000 \u0661\u0662\u0663", "don't I'LL we've WE'VE o'clock",
    "emoji \U0001f30d\U0001f680 \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f1eb\U0001f1f7 \U0001f44d\U0001f3fd",
    "e\u0301 caf\u00e9", unicodedata.normalize("NFD", "na\u00efve \u00dcn\u00efc\u00f6d\u00e9 \u00c5ngstr\u00f6m"),
    "\ufb01 \u212b \u00c5 \u212a \u2460",  # ligature, Angstrom/Kelvin signs (NFC maps them), circled digit
    "\u4e2d\u6587 \u0442\u0435\u043a\u0441\u0442 \u03b5\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac",
    "x!!!\n\n\ny?.. -- ... ;;", "<|im_start|>user\nhi<|im_end|>",
)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_json_encodes_like_transformers(tiny_model_dirs, arch):
    # The router tokenizes with tokenizer.json alone; transformers may rebuild the pipeline by model_type
    # (Qwen2Tokenizer does), so the two must agree on every text, not just on plain ASCII.
    file_backend = Tokenizer.from_file(str(tiny_model_dirs[arch] / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(tiny_model_dirs[arch])
    for text in TRICKY_TEXTS:
        assert file_backend.encode(text).ids == hf(text)["input_ids"], text
    # NFC is applied for qwen2 only: the decomposed and composed spellings tokenize alike there.
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    same = file_backend.encode(composed).ids == file_backend.encode(decomposed).ids
    assert same == (arch == "qwen2")


def test_qwen2_tokenizer_json_has_the_qwen2_pipeline(tiny_qwen2_dir, tiny_llama_dir):
    saved = json.loads((tiny_qwen2_dir / "tokenizer.json").read_text())
    assert saved["normalizer"] == {"type": "NFC"}
    assert saved["pre_tokenizer"] == {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": PRETOKENIZE_REGEX}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    llama = json.loads((tiny_llama_dir / "tokenizer.json").read_text())
    assert llama["normalizer"] is None
    assert llama["pre_tokenizer"] == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                      "use_regex": True}


def test_build_tokenizer_rejects_an_unknown_arch():
    with pytest.raises(ValueError, match="arch"):
        build_tokenizer(512, seed=0, arch="gpt2")


def test_special_tokens_and_no_bos(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    assert tokenizer.encode("hello") == tokenizer.encode("hello", add_special_tokens=False)
    assert tokenizer.model_max_length == TINY_SPECS["llama"].max_position_embeddings


def test_chat_template(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "again"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                      "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n"
                      "<|im_start|>assistant\n")
    without = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=False, tokenize=False)
    assert without == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize("arch, class_name", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")])
def test_directory_loads_and_generates_with_transformers(tiny_model_dirs, arch, class_name):
    model_dir = tiny_model_dirs[arch]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == class_name and model.dtype == torch.float32
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    inputs = tokenizer("The river mill", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert out.shape == (1, inputs.input_ids.shape[1] + 8)
    # initializer_range 0.1 spreads the random logits (std ~0.8; HF's 0.02 gives ~0.16, nearly flat).
    assert model(**inputs).logits[0, -1].std() > 0.5


def test_qwen2_attention_biases_are_random(tiny_qwen2_dir):
    weights = load_file(tiny_qwen2_dir / "model.safetensors")
    for proj in ("q_proj", "k_proj", "v_proj"):
        bias = weights[f"model.layers.0.self_attn.{proj}.bias"]
        assert bias.abs().min() > 0, proj


def test_tied_embeddings_load(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tied", TinyModelSpec(num_layers=1, tie_word_embeddings=True))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("field, overrides", [
    ("arch", dict(arch="gpt2")),
    ("num_layers", dict(num_layers=0)),
    ("hidden_size", dict(hidden_size=66)),
    ("hidden_size", dict(hidden_size=12, num_heads=4, num_kv_heads=1)),  # head dim 3 is odd: no RoPE
    ("num_kv_heads", dict(num_kv_heads=3)),
    ("num_kv_heads", dict(num_kv_heads=0)),
    ("vocab_size", dict(vocab_size=100)),
    ("intermediate_size", dict(intermediate_size=-1)),
    ("max_position_embeddings", dict(max_position_embeddings=0)),
    ("initializer_range", dict(initializer_range=0.0)),
    ("seed", dict(seed=-1)),
])
def test_invalid_spec_names_the_field(field, overrides):
    with pytest.raises(ValueError, match=field):
        TinyModelSpec(**overrides)


def test_failed_build_leaves_no_partial_directory(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(tiny_model.PreTrainedTokenizerFast, "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        build_tiny_model(tmp_path / "m", TinyModelSpec(num_layers=1))
    assert list(tmp_path.iterdir()) == []


def test_rebuild_replaces_an_existing_directory(tmp_path):
    out = tmp_path / "m"
    build_tiny_model(out, TinyModelSpec(num_layers=1, seed=1))
    (out / "stale.txt").write_text("left over")
    build_tiny_model(out, TinyModelSpec(num_layers=1, seed=2))
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_the_cli_never_replaces_what_is_not_a_model_directory(tmp_path, capsys, kind):
    out = tmp_path / "work"
    if kind == "folder":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    else:
        out.write_text("mine")
    assert cli_main(["make-tiny-model", str(out), "--layers", "1"]) == 2
    assert capsys.readouterr().err == (f"splitserve: error: {out}: exists and is not a model directory (no "
                                       "config.json): choose a new or empty directory\n")
    assert (out / "notes.txt" if kind == "folder" else out).read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_embedded_model_names_resolve_to_the_shipped_directories():
    for name in ("default", "default-draft"):
        path = resolve_model_path(name)
        assert path == EMBEDDED_MODELS_DIR / name and (path / "config.json").is_file()
    with pytest.raises(ValueError, match="not an embedded model"):
        embedded_model_path("default-large")


def test_fingerprint_tracks_the_spec_and_the_builder(monkeypatch):
    assert TinyModelSpec().fingerprint() == TinyModelSpec().fingerprint()
    assert TinyModelSpec(seed=1).fingerprint() != TinyModelSpec().fingerprint()
    before = TinyModelSpec().fingerprint()
    monkeypatch.setattr(tiny_model, "BUILDER_VERSION", tiny_model.BUILDER_VERSION + 1)
    assert TinyModelSpec().fingerprint() != before


def test_resolve_model_path(tmp_path, tiny_llama_dir):
    assert resolve_model_path(str(tiny_llama_dir)) == tiny_llama_dir
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path))  # exists, but is not a model directory


def test_cli_builds_a_model(tmp_path, capsys):
    assert cli_main(["make-tiny-model", str(tmp_path / "m"), "--arch", "qwen2", "--layers", "1", "--vocab", "400"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert len(tokenizer) == 400
    assert "wrote qwen2 model" in capsys.readouterr().out
