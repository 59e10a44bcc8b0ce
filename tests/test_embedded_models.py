"""The shipped models (engine/default_models): complete Hugging Face directories, loadable by
transformers and splitserve with identical greedy output, whose recorded held-out loss a fresh
evaluation reproduces, and whose quick-start output in the README is what they produce."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.factories import hf_greedy
from splitserve.deploy.cli import main as cli_main
from splitserve.engine import LLM
from splitserve.engine.llm import load_tokenizer
from splitserve.engine.stdlib_corpus import stdlib_root
from splitserve.common.model_dir import DEFAULT_MODEL_NAME, DRAFT_MODEL_NAME
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.tiny_model import resolve_model_path
from splitserve.engine.tiny_training import read_record
from splitserve.eval import EngineVariant, evaluate, heldout_windows
from splitserve.eval.quality import corpus_matches_record
from splitserve.testing.workloads import GreedyCase

MODELS = (DEFAULT_MODEL_NAME, DRAFT_MODEL_NAME)
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja", "training_record.json")
README = Path(__file__).resolve().parents[1] / "README.md"
LOSS_TOLERANCE = 1e-4
"""Nats. The record's loss is transformers' float32 forward of the saved bf16 weights, batched 8 windows at a
time; the fresh one runs window by window, so only float summation order differs (~1e-6)."""
DEFAULT_PERPLEXITY_BOUND = 100.0
"""The rule for "not gibberish": the default model's held-out perplexity (72 as shipped) stays below this, against
682 for a unigram model of the training tokens and about the vocabulary size (4096) for random weights of its
shape (README, "The embedded models"); the recorded value is checked against a fresh evaluation above."""


def _heldout_def_prompt() -> str:
    """The first top-level `def` line of the held-out files, in the record's order (what the README's
    quick start completes)."""
    record = read_record(resolve_model_path(DEFAULT_MODEL_NAME))
    lines = (line for name in record.heldout_files for line in (stdlib_root() / name).read_text().splitlines())
    return next(line for line in lines if line.startswith("def "))


@pytest.mark.parametrize("name", MODELS)
def test_shipped_directory_is_complete_and_bf16(name):
    path = resolve_model_path(name)
    assert sorted(p.name for p in path.iterdir()) == sorted(FILES)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(path / "model.safetensors", "pt") as weights:
        assert {str(weights.get_slice(key).get_dtype()) for key in weights.keys()} == {"BF16"}
    assert sum(p.stat().st_size for p in path.iterdir()) < 25 * 2**20


def test_the_draft_shares_the_tokenizer_and_is_about_ten_times_smaller():
    main, draft = (resolve_model_path(name) for name in MODELS)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (main / file).read_bytes() == (draft / file).read_bytes()
    ratio = read_record(main).num_parameters / read_record(draft).num_parameters
    assert 7 <= ratio <= 14
    assert read_record(main).heldout_files == read_record(draft).heldout_files


@pytest.mark.parametrize("name", MODELS)
def test_greedy_output_equals_transformers(name):
    path = resolve_model_path(name)
    prompt = load_tokenizer(path).encode(_heldout_def_prompt())
    cases = [GreedyCase(tuple(prompt), 48, ignore_eos=False), GreedyCase(tuple(prompt[:3]), 32, ignore_eos=True)]
    llm = LLM(path, dtype="float32")
    outputs = llm.generate([list(c.prompt_token_ids) for c in cases], [c.params() for c in cases])
    assert [o.token_ids for o in outputs] == [hf_greedy(path, case) for case in cases]


@pytest.mark.parametrize("name", MODELS)
def test_recorded_heldout_loss_equals_a_fresh_evaluation(name):
    path = resolve_model_path(name)
    if not corpus_matches_record(path):
        pytest.skip("this interpreter's stdlib is not the one the shipped models were trained on")
    record = read_record(path)
    reference, engine = evaluate(path, [EngineVariant("engine-float32", dtype="float32")], heldout_windows(path))
    assert reference.num_tokens == engine.num_tokens == record.heldout_tokens
    assert reference.loss == pytest.approx(record.heldout_loss, abs=LOSS_TOLERANCE)
    assert engine.loss == pytest.approx(record.heldout_loss, abs=LOSS_TOLERANCE)
    assert engine.top1_agreement > 0.999 and engine.kl_divergence < 1e-6


def test_llm_takes_an_embedded_models_name_as_the_cli_does(tmp_path):
    by_name = LLM(DEFAULT_MODEL_NAME, dtype="float32").generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0))
    by_path = LLM(resolve_model_path(DEFAULT_MODEL_NAME), dtype="float32").generate(
        [[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0))
    assert by_name[0].token_ids == by_path[0].token_ids
    with pytest.raises(FileNotFoundError, match="is not a model directory .no config.json in"):
        LLM(tmp_path / "missing")


def test_llm_takes_vllms_parallelism_and_remote_code_arguments_at_their_one_device_values():
    greedy = SamplingParams(max_tokens=4, temperature=0)
    llm = LLM(DEFAULT_MODEL_NAME, dtype="float32", tensor_parallel_size=1, pipeline_parallel_size=1,
              trust_remote_code=True)
    assert len(llm.generate([[5, 6, 7]], greedy)[0].token_ids) == 4
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        with pytest.raises(ValueError, match=f"^{name}: only 1 is supported, got 2: an engine runs on one device"):
            LLM(DEFAULT_MODEL_NAME, **{name: 2})


def test_the_default_model_is_not_gibberish():
    assert read_record(resolve_model_path(DEFAULT_MODEL_NAME)).heldout_perplexity < DEFAULT_PERPLEXITY_BOUND


def _readme_quickstart() -> tuple[str, str]:
    """The command and its output from the README's quick-start block (between the marker comments)."""
    block = re.search(r"<!-- quickstart -->\n```console\n(.*?)```\n<!-- /quickstart -->", README.read_text(), re.S)
    command, _, output = block.group(1).partition("\n")
    return command.removeprefix("$ "), output


def test_readme_quickstart_output_is_the_default_models(capsys):
    command, expected = _readme_quickstart()
    args = shlex.split(command)
    assert args[:3] == ["splitserve", "generate", _heldout_def_prompt()] and "--model" not in args
    assert cli_main(args[1:]) == 0
    assert capsys.readouterr().out == expected
