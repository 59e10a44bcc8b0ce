"""splitserve.eval on a model trained in seconds: the reference reproduces the training record, the engine
in float32 agrees with it, bfloat16 departs measurably, and an untrained twin scores near chance."""

from __future__ import annotations

import math

import pytest

from tests.factories import TINY_CORPUS, TINY_TRAINING
from splitserve.engine.stdlib_corpus import CorpusSplit
from splitserve.engine.tiny_training import train
from splitserve.eval import EngineVariant, evaluate, heldout_windows, random_twin
from splitserve.eval.quality import REFERENCE_NAME, corpus_matches_record

VARIANTS = [EngineVariant("fp32", dtype="float32"), EngineVariant("fp32-torch-ops", dtype="float32", cpu_kernels=False),
            EngineVariant("bf16", dtype="bfloat16")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "tiny"
    return out, train(TINY_TRAINING, CorpusSplit.of(TINY_CORPUS, TINY_TRAINING.heldout_every), out)


def test_heldout_windows_are_the_records(trained):
    model_dir, record = trained
    windows = heldout_windows(model_dir, stdlib=TINY_CORPUS)
    assert windows.shape[1] == TINY_TRAINING.context_len + 1
    assert windows[:, 1:].numel() == record.heldout_tokens
    assert heldout_windows(model_dir, max_windows=2, stdlib=TINY_CORPUS).equal(windows[:2])
    assert corpus_matches_record(model_dir, TINY_CORPUS)


def test_engine_float32_agrees_with_the_reference_and_bf16_departs(trained):
    model_dir, record = trained
    reference, fp32, torch_ops, bf16 = evaluate(model_dir, VARIANTS, heldout_windows(model_dir, stdlib=TINY_CORPUS))
    assert [r.variant for r in (reference, fp32, torch_ops, bf16)] == [REFERENCE_NAME, "fp32", "fp32-torch-ops", "bf16"]
    assert reference.loss == pytest.approx(record.heldout_loss, abs=1e-5)
    assert (reference.top1_agreement, reference.kl_divergence) == (1.0, 0.0)
    for row in (fp32, torch_ops):
        assert row.loss == pytest.approx(reference.loss, abs=1e-5)
        assert row.top1_agreement == 1.0 and row.kl_divergence < 1e-6  # float32 rounding of the log-softmax
    assert 1e-7 < bf16.kl_divergence < 1e-2
    assert bf16.perplexity == pytest.approx(math.exp(bf16.loss))


def test_an_untrained_twin_scores_near_chance(trained, tmp_path):
    model_dir, record = trained
    twin = random_twin(model_dir, tmp_path / "twin")
    reference, = evaluate(twin, [], heldout_windows(model_dir, stdlib=TINY_CORPUS))
    assert reference.perplexity == pytest.approx(TINY_TRAINING.model.vocab_size, rel=0.1)
    assert reference.loss > record.heldout_loss
