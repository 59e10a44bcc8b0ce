"""--tokenizer DIR (vLLM's): a model directory without tokenizer files served with another directory's
tokenizer, over LLM and over HTTP, token for token as transformers gives them (that tokenizer + the model);
and the start-up errors about such a directory."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.factories import (hf_greedy, http_request, make_draft_model_dir, model_without_tokenizer, save_tokenizer_dir,
                             served_apis)
from splitserve.common.config import EngineConfig, SpeculativeConfig
from splitserve.common.errors import UnsupportedModelError
from splitserve.deploy.cli import main as cli_main
from splitserve.deploy.cluster_config import ClusterConfigError, default_cluster_config
from splitserve.deploy.preflight import check_model
from splitserve.engine import LLM, EngineCore, SamplingParams
from splitserve.router.tokenizer import RouterTokenizer
from splitserve.testing.workloads import GreedyCase

PROMPT = "Hello world, the tiny tokenizer"
MODEL = "tiny"
OTHER_TOKENIZER = dict(vocab_size=400, seed=7)
"""Not the tiny Llama's own (512 tokens, seed 0): its ids differ, and it fits the model's 512-row embedding."""


@pytest.fixture(scope="module")
def split_model(tmp_path_factory, tiny_llama_dir) -> tuple[Path, Path]:
    """(the tiny Llama without its tokenizer files, a directory holding another tokenizer)."""
    root = tmp_path_factory.mktemp("split-model")
    return (model_without_tokenizer(tiny_llama_dir, root / "model"),
            save_tokenizer_dir(root / "tokenizer", **OTHER_TOKENIZER))


def test_the_other_tokenizer_gives_other_ids(split_model, tiny_llama_dir):
    """What makes the tests below able to fail: reading the model's own tokenizer would give other ids."""
    _, tokenizer_dir = split_model
    assert (AutoTokenizer.from_pretrained(tokenizer_dir)(PROMPT)["input_ids"]
            != AutoTokenizer.from_pretrained(tiny_llama_dir)(PROMPT)["input_ids"])


def test_llm_tokenizes_with_the_tokenizer_dir(split_model):
    model_dir, tokenizer_dir = split_model
    hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt = hf_tokenizer(PROMPT)["input_ids"]
    llm = LLM(model_dir, tokenizer=tokenizer_dir, dtype="float32", device="cpu", block_size=16, max_model_len=512,
              num_kv_blocks=64)
    output = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    expected = hf_greedy(model_dir, GreedyCase(tuple(prompt), 8, True))
    assert (list(output.prompt_token_ids), list(output.outputs[0].token_ids)) == (prompt, expected)
    assert output.outputs[0].text == hf_tokenizer.decode(expected)


def test_offline_generate_command_takes_the_tokenizer_dir(split_model, capsys):
    """`splitserve generate --tokenizer DIR` reaches LLM(tokenizer=DIR): the text is the tokenizer dir's decoding
    of transformers' greedy ids; without the flag the model directory's missing tokenizer.json is the error."""
    model_dir, tokenizer_dir = split_model
    hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    expected = hf_greedy(model_dir, GreedyCase(tuple(hf_tokenizer(PROMPT)["input_ids"]), 8, True))
    argv = ["generate", "--model", str(model_dir), "--dtype", "float32", "--device", "cpu", "--temperature", "0",
            "--max-tokens", "8", "--ignore-eos", PROMPT]
    assert cli_main([*argv, "--tokenizer", str(tokenizer_dir)]) == 0
    assert capsys.readouterr().out == hf_tokenizer.decode(expected) + "\n"
    assert cli_main(argv) == 2
    assert capsys.readouterr().err == (f"splitserve: error: {model_dir}: missing tokenizer.json (splitserve reads the "
                                       "fast tokenizer file only); it has no tokenizer files at all\n")


def test_llm_without_tokenizer_files_and_no_tokenizer_dir_says_so(split_model):
    model_dir, _ = split_model
    with pytest.raises(UnsupportedModelError) as caught:
        check_model(str(model_dir), None)
    assert str(caught.value) == (f"{model_dir}: missing tokenizer.json (splitserve reads the fast tokenizer file "
                                 "only); it has no tokenizer files at all")


def _post(port: int, path: str, body: dict) -> dict:
    status, _, answer = http_request(port, "POST", path, json.dumps({"model": MODEL, **body}).encode())
    assert status == 200, answer
    return json.loads(answer)


def test_http_serves_with_the_tokenizer_dir(split_model):
    """The router tokenizes and renders the chat with the tokenizer directory's files, the workers compute
    grammars over its vocabulary; the outputs are transformers' greedy ids (the model + that tokenizer)."""
    model_dir, tokenizer_dir = split_model
    hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    messages = [{"role": "user", "content": PROMPT}]
    chat_prompt = list(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))
    greedy = dict(max_tokens=6, temperature=0, ignore_eos=True, return_token_ids=True)
    with served_apis(model_dir, MODEL, tokenizer_dir=tokenizer_dir) as served:
        completion = _post(served.http_port, "/v1/completions", dict(prompt=PROMPT, **greedy))["choices"][0]
        chat = _post(served.http_port, "/v1/chat/completions", dict(messages=messages, **greedy))
        choice = _post(served.http_port, "/v1/completions", dict(
            prompt=PROMPT, max_tokens=6, temperature=0, structured_outputs={"choice": ["yes", "no"]}))["choices"][0]
    prompt = hf_tokenizer(PROMPT)["input_ids"]
    assert (completion["prompt_token_ids"], completion["token_ids"]) == (
        prompt, hf_greedy(model_dir, GreedyCase(tuple(prompt), 6, True)))
    assert completion["text"] == hf_tokenizer.decode(completion["token_ids"])
    assert (chat["prompt_token_ids"], chat["choices"][0]["token_ids"]) == (
        chat_prompt, hf_greedy(model_dir, GreedyCase(tuple(chat_prompt), 6, True)))
    assert choice["text"] in ("yes", "no")


# ---- start-up errors ----------------------------------------------------------------------------

def test_a_missing_tokenizer_dir_names_the_flag(split_model, tmp_path):
    model_dir, _ = split_model
    missing = str(tmp_path / "nowhere")
    with pytest.raises(UnsupportedModelError) as from_check:
        check_model(str(model_dir), None, missing)
    with pytest.raises(UnsupportedModelError) as from_llm:
        LLM(model_dir, tokenizer=missing, device="cpu")
    assert str(from_check.value) == str(from_llm.value) == f"--tokenizer {missing!r}: no such tokenizer directory"


def test_a_tokenizer_dir_without_tokenizer_json_names_the_flag(split_model, tmp_path):
    model_dir, _ = split_model
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(UnsupportedModelError) as caught:
        check_model(str(model_dir), None, str(tmp_path))
    assert str(caught.value) == (
        f"--tokenizer {str(tmp_path)!r}: {tmp_path}: missing tokenizer.json (splitserve reads the fast tokenizer "
        "file only); it has vocab.json: save the tokenizer once with transformers "
        "(AutoTokenizer.from_pretrained(dir).save_pretrained(dir)) to write tokenizer.json")


def test_an_unreadable_tokenizer_json_names_the_flag(split_model, tmp_path):
    model_dir, _ = split_model
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError) as caught:
        RouterTokenizer.from_model_dir(model_dir, tokenizer=tmp_path)
    assert str(caught.value) == (f"--tokenizer {str(tmp_path)!r}: {tmp_path / 'tokenizer.json'}: not a tokenizer "
                                 "file: key must be a string at line 1 column 2")


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(split_model, tmp_path):
    model_dir, _ = split_model
    larger = save_tokenizer_dir(tmp_path / "larger", vocab_size=600, seed=7)
    expected = (f"{larger / 'tokenizer.json'}: the tokenizer has 600 tokens, more than the model's vocab_size 512 "
                f"({model_dir / 'config.json'}); use the model's own tokenizer")
    with pytest.raises(UnsupportedModelError) as from_check:
        check_model(str(model_dir), None, str(larger))
    with pytest.raises(UnsupportedModelError) as from_llm:
        LLM(model_dir, tokenizer=larger, device="cpu")
    assert str(from_check.value) == str(from_llm.value) == expected
    for name in os.listdir(larger):  # the same tokenizer shipped in the model's own directory is served as it is
        shutil.copy(larger / name, model_dir / name)
    check_model(str(model_dir), None)
    assert len(RouterTokenizer.from_model_dir(model_dir).backend.get_vocab()) == 600


def test_the_model_dir_is_checked_with_the_tokenizer_dir(split_model):
    model_dir, tokenizer_dir = split_model
    check_model(str(model_dir), None, str(tokenizer_dir))  # no error: the tokenizer files are the directory's


def test_an_empty_tokenizer_setting_is_refused():
    with pytest.raises(ClusterConfigError) as caught:
        dataclasses.replace(default_cluster_config("default"), tokenizer="")
    assert str(caught.value) == "tokenizer: must not be empty (null reads the model directory's)"


def test_workers_and_router_actors_get_the_tokenizer_dir_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = default_cluster_config("default")
    assert (config.tokenizer_path, dataclasses.replace(config, tokenizer="tok").tokenizer_path) == (
        None, str(tmp_path / "tok"))


def test_a_draft_model_must_share_the_tokenizer_dirs_tokenizer(split_model, tiny_llama_dir, tmp_path):
    model_dir, tokenizer_dir = split_model
    draft = make_draft_model_dir(tiny_llama_dir, tmp_path / "draft", seed=5)  # the tiny Llama's own tokenizer
    config = EngineConfig(device="cpu", dtype="float32", block_size=16, num_kv_blocks=64, max_model_len=512,
                          speculative=SpeculativeConfig(method="draft", draft_model=str(draft),
                                                        num_speculative_tokens=3))
    assert EngineCore(model_dir, config, tokenizer_dir=tiny_llama_dir).speculator is not None
    with pytest.raises(ValueError) as caught:
        EngineCore(model_dir, config, tokenizer_dir=tokenizer_dir)
    assert str(caught.value) == (f"speculative.draft_model {draft} does not share the target's tokenizer "
                                 f"({tokenizer_dir / 'tokenizer.json'} differs)")


@pytest.mark.slow
def test_a_ray_cluster_serves_with_the_tokenizer_dir(split_model):
    """The launcher hands the tokenizer directory to the router and to every worker actor: a text prompt is
    tokenized with it, the KV pulled over NIXL, and the output is transformers' greedy ids and their text."""
    from splitserve.proto.splitserve.v1 import generation_pb2 as pb
    from splitserve.testing.local_cluster import running_cluster, tiny_cluster_config
    from tests.factories import stream_tokens

    model_dir, tokenizer_dir = split_model
    hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt = hf_tokenizer(PROMPT)["input_ids"]
    config = tiny_cluster_config(model_dir, tokenizer=str(tokenizer_dir))
    request = pb.GenerateRequest(text=PROMPT.encode(), sampling=pb.SamplingParams(temperature=0.0, max_tokens=6,
                                                                                  ignore_eos=True))
    with running_cluster(config) as (cluster, _):
        tokens, text, responses = stream_tokens(cluster.port, request)
    expected = hf_greedy(model_dir, GreedyCase(tuple(prompt), 6, True))
    assert (responses[-1].usage.prompt_tokens, tokens, text) == (len(prompt), expected, hf_tokenizer.decode(expected))
