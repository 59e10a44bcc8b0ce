"""SpeculativeConfig.from_vllm / speculative_settings: vLLM's speculative_config spelling (the CLI's
--speculative-config, LLM(speculative_config=...)) mapped onto splitserve's fields, torch-free."""

from __future__ import annotations

import pytest

from splitserve.common.config import SpeculativeConfig, speculative_settings


@pytest.mark.parametrize(("vllm", "ours"), [
    ({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
     SpeculativeConfig(method="ngram", num_speculative_tokens=5, ngram_min=2, ngram_max=4)),
    ({"model": "/models/draft", "num_speculative_tokens": 3},
     SpeculativeConfig(method="draft", draft_model="/models/draft", num_speculative_tokens=3)),
    ({"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1},
     SpeculativeConfig(method="draft", draft_model="/models/draft", num_speculative_tokens=3)),
    ({"model": "[ngram]", "num_speculative_tokens": 2}, SpeculativeConfig(method="ngram", num_speculative_tokens=2)),
    ({"method": "ngram_gpu", "num_speculative_tokens": 2}, SpeculativeConfig(method="ngram", num_speculative_tokens=2)),
    ({"method": "ngram", "prompt_lookup_max": 3}, SpeculativeConfig(method="ngram", ngram_min=3, ngram_max=3)),
    ({"method": "ngram", "prompt_lookup_min": 2}, SpeculativeConfig(method="ngram", ngram_min=2, ngram_max=2)),
    ({"method": "ngram", "prompt_lookup_min": 2, "ngram_max": 5},
     SpeculativeConfig(method="ngram", ngram_min=2, ngram_max=5)),
    ({"method": "ngram", "disable_by_batch_size": 8}, SpeculativeConfig(method="ngram", disable_above_batch_size=7)),
    ({"method": "ngram", "disable_by_batch_size": 1}, SpeculativeConfig(method="ngram", disable_above_batch_size=0)),
    ({"method": "draft", "draft_model": "default-draft", "adaptive": False, "disable_above_batch_size": 2},
     SpeculativeConfig(method="draft", draft_model="default-draft", adaptive=False, disable_above_batch_size=2)),
], ids=["ngram", "draft-by-model", "draft_model", "ngram-model-name", "ngram_gpu", "lone-max", "lone-min",
        "mixed-spellings", "disable-by-batch-size", "disable-by-batch-size-1", "ours"])
def test_vllms_speculative_config_maps_onto_ours(vllm, ours):
    assert SpeculativeConfig.from_vllm(vllm) == ours


def test_only_the_keys_given_are_settings_so_a_config_files_other_fields_stay():
    assert speculative_settings({"num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}) == {
        "num_speculative_tokens": 5, "ngram_max": 4, "ngram_min": 2}
    assert speculative_settings({}) == {}


@pytest.mark.parametrize(("vllm", "message"), [
    ({"method": "eagle3", "model": "/models/eagle3-head", "num_speculative_tokens": 3},
     "speculative.method 'eagle3' is not supported: splitserve runs ngram (prompt lookup; vLLM's ngram, ngram_gpu) "
     "and draft (a draft model; vLLM's draft_model) speculation (docs/speculative.md)"),
    ({"method": "medusa", "model": "/m"}, "speculative.method 'medusa' is not supported: "),
    ({"method": "mtp", "num_speculative_tokens": 1}, "speculative.method 'mtp' is not supported: "),
    ({"method": "suffix"}, "speculative.method 'suffix' is not supported: "),
    ({"method": "ngram", "prompt_lookup_max": 4, "ngram_max": 4},
     "speculative: 'prompt_lookup_max' and 'ngram_max' set the same field (ngram_max); give one of them"),
    ({"model": "/m", "draft_model": "/m"},
     "speculative: 'model' and 'draft_model' set the same field (draft_model); give one of them"),
    ({"disable_above_batch_size": 3, "disable_by_batch_size": 4},
     "speculative: 'disable_above_batch_size' and 'disable_by_batch_size' set the same field "
     "(disable_above_batch_size); give one of them"),
    ({"method": "ngram", "prompt_lookup_maximum": 4},
     "speculative: unknown key 'prompt_lookup_maximum' (known: adaptive, disable_above_batch_size, "
     "disable_by_batch_size, draft_model, draft_tensor_parallel_size, method, model, ngram_max, ngram_min, "
     "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min)"),
    ({"disable_by_batch_size": 0}, "speculative.disable_by_batch_size must be an integer >= 1, got 0"),
    ({"disable_by_batch_size": True}, "speculative.disable_by_batch_size must be an integer >= 1, got True"),
    ({"model": "/m", "draft_tensor_parallel_size": 2},
     "speculative.draft_tensor_parallel_size: only 1 is supported, got 2: the draft model runs on its target's "
     "device"),
    ({"model": "/m", "draft_tensor_parallel_size": 1.0},
     "speculative.draft_tensor_parallel_size: only 1 is supported, got 1.0"),
    ({"method": "draft_model"}, "speculative.draft_model must name a model directory when method is 'draft'"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "speculative ngram sizes need 1 <= ngram_min <= ngram_max, got 4, 2"),
], ids=["eagle3", "medusa", "mtp", "suffix", "both-spellings", "model-and-draft_model", "both-batch-limits",
        "unknown-key", "disable-by-0", "disable-by-bool", "draft-tp-2", "draft-tp-float", "draft_model-without-model", "min-above-max"])
def test_a_vllm_speculative_config_splitserve_cannot_run_is_refused_naming_why(vllm, message):
    with pytest.raises(ValueError) as error:
        SpeculativeConfig.from_vllm(vllm)
    assert str(error.value).startswith(message)
