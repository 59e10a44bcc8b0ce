"""`train-tiny-model`: the stdlib split, and training that is reproducible to the bit for a fixed seed."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.factories import TINY_CORPUS, TINY_TRAINING
from splitserve.deploy.cli import TRAINING_PRESETS, main as cli_main
from splitserve.engine.stdlib_corpus import CorpusSplit, is_heldout, list_sources, stdlib_root
from splitserve.engine.tiny_training import PRESETS, eval_windows, learning_rate, read_record, train

# The losses of torch 2.13.0 on an AVX-512 CPU (1 thread; bit-identical run to run). They pin the
# recipe (init, data order, schedule, autocast): a change to any of them shows up here. The 1e-4
# tolerance admits the kernels of other CPUs, whose sums run in another order (an AVX2 CPU moved the
# fourth loss by 2.3e-5 and the first three by under 1e-6), and stays far below a recipe change's.
TINY_LOSSES = (5.754218101501465, 5.672914028167725, 5.5475335121154785, 5.375176429748535)


def test_tiny_corpus_split_is_by_path_and_skips_test_folders():
    split = CorpusSplit.of(TINY_CORPUS, heldout_every=3)
    assert split.train == ("counter.py", "intervals.py", "shapes.py")
    assert split.heldout == ("queue_utils.py",)
    assert "test/check_shapes.py" not in list_sources(TINY_CORPUS)


def test_stdlib_heldout_files_are_never_trained_on():
    split = CorpusSplit.of(stdlib_root())
    assert split.heldout and split.train
    assert not set(split.train) & set(split.heldout)
    assert set(split.train) | set(split.heldout) == set(list_sources(stdlib_root()))
    assert all(is_heldout(name) for name in split.heldout) and not any(is_heldout(name) for name in split.train)
    assert not any(part in ("test", "tests", "site-packages") for name in split.train for part in name.split("/"))


def test_a_split_that_overlaps_is_refused():
    with pytest.raises(ValueError, match="both in the training and the held-out set"):
        CorpusSplit(TINY_CORPUS, train=("shapes.py", "counter.py"), heldout=("shapes.py",))


def test_learning_rate_warms_up_then_decays_to_the_floor():
    config = dataclasses.replace(TINY_TRAINING, steps=11, warmup_steps=2, peak_lr=1.0, min_lr_ratio=0.1)
    rates = [learning_rate(config, step) for step in range(11)]
    assert rates[:3] == [0.5, 1.0, 1.0]
    assert rates[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(rates[2:], rates[3:]))


def test_eval_windows_cover_each_target_once():
    windows = eval_windows(torch.arange(10), context_len=3)
    assert windows.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]


def test_training_is_deterministic_for_a_fixed_seed(tmp_path):
    split = CorpusSplit.of(TINY_CORPUS, heldout_every=3)
    first = train(TINY_TRAINING, split, tmp_path / "a")
    second = train(TINY_TRAINING, split, tmp_path / "b")
    assert first.step_losses == second.step_losses
    assert first.step_losses == pytest.approx(TINY_LOSSES, abs=1e-4)
    assert first.heldout_loss == second.heldout_loss
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert first.tokens_seen == 4 * 2 * 32
    assert first.heldout_files == ("queue_utils.py",) and first.num_train_files == 3


def test_the_record_round_trips_and_the_model_loads_in_transformers(tmp_path):
    record = train(TINY_TRAINING, CorpusSplit.of(TINY_CORPUS, heldout_every=3), tmp_path / "m")
    assert read_record(tmp_path / "m") == record
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert model.dtype == torch.bfloat16 and model.num_parameters() == record.num_parameters
    assert len(AutoTokenizer.from_pretrained(tmp_path / "m")) == 300


def test_cli_trains_a_preset_with_overrides_on_the_stdlib(tmp_path, capsys):
    assert TRAINING_PRESETS == tuple(sorted(PRESETS))
    assert cli_main(["train-tiny-model", str(tmp_path / "m"), "--preset", "draft", "--steps", "2",
                     "--batch-size", "1", "--context-len", "16", "--threads", "1", "--seed", "5"]) == 0
    record = read_record(tmp_path / "m")
    assert (record.steps, record.tokens_seen, record.threads, record.config.model.seed) == (2, 32, 1, 5)
    assert record.config.model == dataclasses.replace(PRESETS["draft"].model, seed=5)
    assert record.heldout_files == CorpusSplit.of(stdlib_root()).heldout
    assert "held-out loss" in capsys.readouterr().out


def test_building_the_cli_parser_does_not_import_torch():
    # TRAINING_PRESETS spells the preset names out so `splitserve --help` stays fast.
    code = "import sys; from splitserve.deploy.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
