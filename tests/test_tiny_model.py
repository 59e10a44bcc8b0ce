"""The tiny model builder: deterministic, HF-loadable, exact tokenizer size, working chat template."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from splitserve.deploy.cli import main as cli_main
from splitserve.engine.tiny_model import TinyModelSpec, build_tiny_model, build_tokenizer, resolve_model_path
from safetensors.torch import load_file


def test_same_spec_gives_identical_files(tmp_path, tiny_llama_dir):
    from conftest import TINY_SPECS

    again = build_tiny_model(tmp_path / "again", TINY_SPECS["llama"])
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (tiny_llama_dir / name).read_bytes(), name


def test_different_seed_changes_weights(tmp_path, tiny_llama_dir):
    other = build_tiny_model(tmp_path / "other", TinyModelSpec(seed=5))
    a = load_file(tiny_llama_dir / "model.safetensors")
    b = load_file(other / "model.safetensors")
    assert not a["model.embed_tokens.weight"].equal(b["model.embed_tokens.weight"])


@pytest.mark.parametrize("vocab_size", [300, 512, 4096])
def test_tokenizer_has_exactly_the_requested_size(vocab_size):
    assert len(build_tokenizer(vocab_size, seed=0)) == vocab_size


def test_directory_loads_with_transformers_and_chat_template(tiny_qwen2_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    text = "Grüße, 世界! 🚀"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "hi"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0


@pytest.mark.parametrize("field, overrides", [
    ("arch", dict(arch="gpt2")), ("hidden_size", dict(hidden_size=66)), ("num_heads", dict(num_kv_heads=3)),
    ("vocab_size", dict(vocab_size=100)), ("num_layers", dict(num_layers=0)),
])
def test_invalid_spec_names_the_field(field, overrides):
    with pytest.raises(ValueError, match=field):
        TinyModelSpec(**overrides)


def test_resolve_model_path_rejects_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path / "missing"))


def test_cli_builds_a_model(tmp_path, capsys):
    assert cli_main(["make-tiny-model", str(tmp_path / "m"), "--arch", "qwen2", "--layers", "1", "--vocab", "400"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert len(tokenizer) == 400
    assert "wrote qwen2 model" in capsys.readouterr().out
