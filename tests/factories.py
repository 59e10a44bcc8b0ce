"""The one shared set of test factories (requests, block managers, schedulers, model specs).

What bench/ shares with the tests (the tiny models' specs, workloads, the in-process and Ray
clusters, the fault scenarios, the sampler's reference) is in splitserve.testing; import it from there."""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import random
import types
from collections.abc import Mapping
from types import MappingProxyType

import pytest
import torch

from splitserve.common.block_hash import BlockHasher
from splitserve.common.kv_transfer_types import KVLayout
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.cpu_kernels import load_cpu_kernels
from splitserve.engine.request import Request
from splitserve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from splitserve.kv_transfer import NIXL_MODULES, nixl_module
from splitserve.testing.event_loop import EventLoopThread
from splitserve.testing.in_process_cluster import InProcessCluster
from splitserve.testing.paged_reference import ReferencePagedKernels
from splitserve.testing.workloads import GreedyCase

_arrivals = itertools.count()


def make_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                 eos_token_ids: frozenset[int] = frozenset(), cache_salt: str | None = None,
                 priority: int = 0, lora_name: str | None = None) -> Request:
    return Request(request_id, list(prompt_token_ids), params or SamplingParams(), eos_token_ids, next(_arrivals),
                   cache_salt=cache_salt, priority=priority, lora_name=lora_name)


def make_block_manager(num_blocks: int, block_size: int = 4, enable_prefix_caching: bool = True,
                       hash_seed: int = 0) -> BlockManager:
    return BlockManager(num_blocks, block_size, BlockHasher(block_size, hash_seed), enable_prefix_caching)


def make_scheduler(num_blocks: int, block_size: int = 4, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                   max_model_len: int = 256, enable_chunked_prefill: bool = True,
                   enable_prefix_caching: bool = True, policy: str = "fcfs", max_loras: int | None = None) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, enable_chunked_prefill, policy,
                             max_loras)
    return Scheduler(config, make_block_manager(num_blocks, block_size, enable_prefix_caching))


def assert_pool_idle(block_manager: BlockManager) -> None:
    """Every block is back in the free list with no owner (cached-free blocks allowed)."""
    assert block_manager.num_free_blocks == block_manager.num_blocks
    assert all(block_manager.ref_count(b) == 0 for b in range(block_manager.num_blocks))
    assert sorted(block_manager.free_block_order()) == list(range(block_manager.num_blocks))


# ---- the Hugging Face oracle and model checkpoints --------------------------------------------
from dataclasses import dataclass  # noqa: E402
from functools import lru_cache  # noqa: E402
from pathlib import Path  # noqa: E402


@lru_cache(maxsize=4)
def _hf_model(model_dir: Path, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def hf_greedy(model_dir: Path, case: GreedyCase, dtype: str = "float32") -> list[int]:
    """The oracle: transformers `generate`, batch 1, greedy, fp32 (or the checkpoint cast to `dtype`)."""
    model = _hf_model(model_dir, dtype)
    kwargs = {"eos_token_id": None} if case.ignore_eos else {}
    with torch.inference_mode():
        output = model.generate(torch.tensor([case.prompt_token_ids]), max_new_tokens=case.max_tokens,
                                do_sample=False, pad_token_id=0, **kwargs)
    return output[0, len(case.prompt_token_ids):].tolist()


def hf_logits(model_dir: Path, prompt_token_ids: list[int]) -> torch.Tensor:
    """The oracle's next-token logits at every prompt position: [len(prompt), vocab] float32."""
    with torch.inference_mode():
        return _hf_model(model_dir)(torch.tensor([prompt_token_ids])).logits[0].float()


@lru_cache(maxsize=4)
def _hf_base_model(model_dir: Path):
    from transformers import AutoModel

    return AutoModel.from_pretrained(model_dir, dtype="float32").eval()


def hf_embedding(model_dir: Path, prompt_token_ids: list[int], pooling_type: str, normalize: bool = True,
                 dimensions: int | None = None) -> list[float]:
    """The oracle of a pooling request: transformers' AutoModel (the decoder without lm_head), batch 1, fp32; its
    last_hidden_state (after the final norm) pooled, cut and L2-normalized here by hand."""
    with torch.inference_mode():
        hidden = _hf_base_model(model_dir)(torch.tensor([prompt_token_ids])).last_hidden_state[0]  # [T, hidden]
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling_type]
    vector = vector if dimensions is None else vector[:dimensions]
    return (vector / vector.norm() if normalize else vector).tolist()


def with_sentence_transformers_files(model_dir: Path, out_dir: Path, pooling_mode: str, normalize: bool) -> Path:
    """A copy of `model_dir` with sentence-transformers' modules.json (Transformer, Pooling and, with `normalize`,
    Normalize modules) and 1_Pooling/config.json selecting `pooling_mode` (lasttoken, mean, cls, ...)."""
    import json
    import shutil

    shutil.copytree(model_dir, out_dir)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out_dir / "modules.json").write_text(json.dumps(modules))
    (out_dir / "1_Pooling").mkdir()
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": pooling_mode == "cls",
         "pooling_mode_mean_tokens": pooling_mode == "mean", "pooling_mode_lasttoken": pooling_mode == "lasttoken",
         "pooling_mode_max_tokens": pooling_mode == "max", "include_prompt": True}))
    return out_dir


def reference_beam_search(model_dir: Path, prompt: list[int], beam_width: int, max_tokens: int, eos: int,
                          length_penalty: float = 1.0, ignore_eos: bool = False) -> list[tuple[list[int], str]]:
    """The oracle of beam search: vLLM's algorithm written out over transformers' fp32 logits (independent of
    common/beam_search.py); (output token ids without the EOS, finish reason) of the best beams, best first."""
    beams: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
    completed: list[tuple[list[int], float, str]] = []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum_logprob in beams:
            logprobs = torch.log_softmax(hf_logits(model_dir, tokens)[-1], dim=-1)
            values, ids = logprobs.topk(2 * beam_width)
            for token_id, logprob in zip(ids.tolist(), values.tolist()):
                if token_id == eos and not ignore_eos:
                    completed.append((tokens, cum_logprob + logprob, "stop"))
                else:
                    candidates.append((tokens + [token_id], cum_logprob + logprob))
        beams = sorted(candidates, key=lambda beam: beam[1], reverse=True)[:beam_width]
        if not beams:
            break

    def score(beam: tuple[list[int], float, str]) -> float:
        tokens, cum_logprob, _ = beam
        return cum_logprob / ((len(tokens) - (tokens[-1] == eos)) ** length_penalty)

    ranked = sorted(completed + [(tokens, cum, "length") for tokens, cum in beams], key=score, reverse=True)
    return [(tokens[len(prompt):], reason) for tokens, _, reason in ranked[:beam_width]]


def eos_model(model_dir: Path, out_dir: Path, eos_token_id: int) -> Path:
    """A copy of the model whose tokenizer's EOS is `eos_token_id` (generation_config.json unchanged): with a token
    the model ranks high, beam search sees EOS among its candidates (a tiny model's own EOS never is)."""
    import json
    import shutil

    shutil.copytree(model_dir, out_dir)
    vocab = json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"]
    eos = next(token for token, index in vocab.items() if index == eos_token_id)
    config = json.loads((out_dir / "tokenizer_config.json").read_text())
    (out_dir / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": eos}))
    return out_dir


MOE_DEFAULTS = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=48),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
}
"""The mixtures of experts' tiny shapes: 8 (6, 4) experts 48 wide, 2 per token; Qwen3-MoE's dense layers (none
unless mlp_only_layers or decoder_sparse_step say so) keep the base 128."""


MODEL_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
"""The files a tiny model directory holds for its tokenizer (the rest is weights, config and generation config)."""


def model_without_tokenizer(model_dir: Path, out_dir: Path) -> Path:
    """A copy of the model directory without its tokenizer files (for --tokenizer DIR)."""
    import shutil

    shutil.copytree(model_dir, out_dir, ignore=shutil.ignore_patterns(*MODEL_TOKENIZER_FILES))
    return out_dir


def save_tokenizer_dir(out_dir: Path, vocab_size: int, seed: int) -> Path:
    """A directory holding only a tiny byte-level BPE tokenizer (tiny_tokenizer: a ChatML template, no BOS) of
    `vocab_size` tokens: another tokenizer than a tiny model's own when `seed` differs from its spec's."""
    tiny_tokenizer(vocab_size, seed).save_pretrained(out_dir)
    return out_dir


def save_random_hf_model(out_dir: Path, architecture: str, seed: int = 0, **config_overrides) -> Path:
    """A random-weight checkpoint of any supported family (no tokenizer), via transformers itself."""
    from transformers import (Gemma2Config, Gemma3TextConfig, GemmaConfig, GptOssConfig, GraniteConfig, LlamaConfig,
                              MistralConfig, MixtralConfig, Olmo2Config, Phi3Config, Qwen2Config, Qwen3Config,
                              Qwen3MoeConfig, SmolLM3Config)

    config_class = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
                    "phi3": Phi3Config, "granite": GraniteConfig, "gemma": GemmaConfig, "gemma2": Gemma2Config,
                    "gemma3": Gemma3TextConfig, "qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig,
                    "smollm3": SmolLM3Config, "olmo2": Olmo2Config, "gpt_oss": GptOssConfig}
    base = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1, bos_token_id=None,
                eos_token_id=None, pad_token_id=None)
    if architecture in ("gemma", "gemma2", "gemma3", "gpt_oss"):
        # hidden_size / heads, as the others derive it (Gemma's config defaults to 256, GPT-OSS's to 64)
        base["head_dim"] = 16
    config = config_class[architecture](**{**base, **MOE_DEFAULTS.get(architecture, {}), **config_overrides})
    _random_hf_model(config, seed).save_pretrained(out_dir)
    return out_dir


def save_random_base_model(out_dir: Path, architecture: str, seed: int = 0) -> Path:
    """save_random_hf_model's checkpoint saved as transformers' base model (`Qwen3Model`, `MistralModel`, ...): no
    lm_head, tensor names without the `model.` prefix, config.json's architectures the base class, as embedding models
    (Qwen3-Embedding, e5-mistral) ship; with a tokenizer of the config's 384 ids."""
    import json

    save_random_hf_model(out_dir, architecture, seed, tie_word_embeddings=False)
    causal = _hf_model(out_dir)
    causal.model.save_pretrained(out_dir)  # overwrites the weights and config.json
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == [type(causal.model).__name__]
    save_tokenizer_dir(out_dir, vocab_size=384, seed=seed)
    return out_dir


def save_random_classifier(out_dir: Path, architecture: str, num_labels: int, seed: int = 0,
                           **config_fields) -> Path:
    """save_random_hf_model's decoder as transformers' *ForSequenceClassification (a random `score` head of
    `num_labels`, no lm_head; config.json's architectures that class, `config_fields` added to it), with a tokenizer
    of the config's 384 ids: a tiny cross-encoder (num_labels 1) or classifier."""
    import json

    from transformers import AutoModelForSequenceClassification

    save_random_hf_model(out_dir, architecture, seed, tie_word_embeddings=False)
    config = _hf_model(out_dir).config
    config.num_labels = num_labels
    torch.manual_seed(seed + 1)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    model.model.load_state_dict(_hf_model(out_dir).model.state_dict())
    torch.nn.init.normal_(model.score.weight, std=0.5)
    for stale in out_dir.glob("*.safetensors"):
        stale.unlink()
    model.save_pretrained(out_dir)
    saved = json.loads((out_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({**saved, **config_fields}))
    save_tokenizer_dir(out_dir, vocab_size=384, seed=seed)
    return out_dir


@lru_cache(maxsize=4)
def _hf_classifier(model_dir: Path):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(model_dir, dtype="float32").eval()


def hf_classifier_logits(model_dir: Path, prompt_token_ids: list[int]) -> list[float]:
    """The oracle of a classification model: transformers' AutoModelForSequenceClassification, batch 1, fp32."""
    with torch.inference_mode():
        return _hf_classifier(model_dir)(torch.tensor([prompt_token_ids])).logits[0].tolist()


def _random_hf_model(config, seed: int):
    """transformers' model of `config` with random weights from `seed`, in float32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for name, param in model.named_parameters():
        if name.endswith("bias") or name.endswith("norm.weight"):
            # HF initializes these to 0 / 1; random values make the test see if they are loaded.
            torch.nn.init.normal_(param, mean=1.0 if name.endswith("norm.weight") else 0.0, std=0.1)
        elif name.endswith("sinks"):
            # GPT-OSS's attention sinks: HF's N(0, 0.1) barely moves a softmax over more than a few keys; logits
            # around exp(1) ~ the tiny models' summed exp(scores) take a share of it the tokens depend on.
            torch.nn.init.normal_(param, mean=1.0, std=1.0)
    return model


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every projection of a Llama-family decoder layer (PEFT's target_modules names)."""


def _lora_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_features, out_features) of a Llama-family config.json (qkv_proj and gate_up_proj:
    Phi-3's fused modules)."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size, kv_size = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
            "o_proj": (q_size, hidden), "gate_proj": (hidden, inner), "up_proj": (hidden, inner),
            "down_proj": (inner, hidden), "qkv_proj": (hidden, q_size + 2 * kv_size),
            "gate_up_proj": (hidden, 2 * inner)}


def save_random_lora_adapter(model_dir: Path, out_dir: Path, seed: int, rank: int = 8, lora_alpha: float = 16,
                             targets: tuple[str, ...] = LORA_TARGETS, use_rslora: bool = False, std: float = 0.3,
                             **config_fields) -> Path:
    """A PEFT LoRA adapter directory for the model at `model_dir`, as PEFT's save_pretrained writes one
    (adapter_config.json, adapter_model.safetensors with PEFT's tensor names), with random A and B from `seed`
    (PEFT initializes B to zeros; random B makes the adapter change the model). config_fields: more
    adapter_config.json fields (or replacements)."""
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    shapes = _lora_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in targets:
            in_features, out_features = shapes[module]
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj", "gate_up_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
                      "r": rank, "lora_alpha": lora_alpha, "target_modules": list(targets), "use_rslora": use_rslora,
                      "bias": "none", "lora_dropout": 0.0, "fan_in_fan_out": False, "modules_to_save": None,
                      "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, **config_fields}
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config))
    return out_dir


def merge_lora_adapter(model_dir: Path, adapter_dir: Path, out_dir: Path) -> Path:
    """A copy of the model at `model_dir` with the adapter merged into its weights (W + scaling * B @ A, scaling
    lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora): what transformers runs as the oracle."""
    import math
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    rank = adapter_config["r"]
    scaling = adapter_config["lora_alpha"] / (math.sqrt(rank) if adapter_config.get("use_rslora") else rank)
    weights = load_file(str(out_dir / "model.safetensors"))
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for name, a in adapter.items():
        if ".lora_A." not in name:
            continue
        b = adapter[name.replace(".lora_A.", ".lora_B.")]
        target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        weights[target] = weights[target] + scaling * (b.double() @ a.double()).to(weights[target].dtype)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def save_published_model(out_dir: Path, config: dict, generation_config: dict, chat_template: str,
                         special_tokens: dict, seed: int = 0) -> Path:
    """A model directory as a Hub repo ships one: `config` and `generation_config` written verbatim as its
    config.json and generation_config.json (legacy field names, auto_map, transformers_version and all), random
    weights of the model transformers builds from that config.json, saved as safetensors in its torch_dtype, and
    the tiny tokenizer (tiny_tokenizer(512)) with `chat_template` and `special_tokens` (bos_token, eos_token,
    additional_special_tokens ...: tokens the template writes, added after the 512)."""
    import json

    from transformers import AutoConfig, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text(json.dumps(config))
    hf_config = AutoConfig.from_pretrained(out_dir, local_files_only=True)
    hf_config.initializer_range = 0.1  # weights only: larger than the published 0.02 so random logits are not flat
    model = _random_hf_model(hf_config, seed).to(getattr(torch, config.get("torch_dtype", "float32")))
    model.save_pretrained(out_dir)
    (out_dir / "config.json").write_text(json.dumps(config))
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer(512).backend_tokenizer,
                                        chat_template=chat_template, clean_up_tokenization_spaces=False,
                                        **special_tokens)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def copy_with_config_fields(model_dir: Path, out_dir: Path, **fields) -> Path:
    """A copy of `model_dir` whose config.json also holds `fields` (written into the file as a user's would be,
    not through a config class that could drop or rename them)."""
    import json
    import shutil

    shutil.copytree(model_dir, out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({**config, **fields}))
    return out_dir


def copy_with_generation_config(model_dir: Path, out_dir: Path, **fields) -> Path:
    """A copy of `model_dir` whose generation_config.json also holds `fields` (sampling defaults such
    as a Qwen2.5 or Llama 3 instruct model ships: temperature, top_p, top_k, repetition_penalty ...),
    written as raw JSON so a bad value stays as the user wrote it."""
    import json
    import shutil

    shutil.copytree(model_dir, out_dir)
    path = out_dir / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return out_dir


def engine_token_ids(engine) -> dict[str, list[int]]:
    """Step an EngineCore until it has no work: each request's new token ids, in emission order."""
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return tokens


def run_fake_step(scheduler: Scheduler, next_token=lambda request: 7):
    """One engine step without a model: schedule, mark KV computed, append a token to samplers."""
    output = scheduler.schedule()
    scheduler.advance(output)
    for chunk in output.chunks:
        if chunk.samples:
            scheduler.requests[chunk.request_id].append_output_token(next_token(scheduler.requests[chunk.request_id]))
    return output


def chunk_summary(output) -> list[tuple[str, int, int, bool]]:
    """(request_id, start_position, num_tokens, samples) of every scheduled chunk, in order."""
    return [(c.request_id, c.start_position, c.num_tokens, c.samples) for c in output.chunks]


def make_sampling_row(params: SamplingParams, prompt: list[int] = (), output: list[int] = (),
                      seed: int | None = None, device: str = "cpu"):
    """A sampler row with its own generator on `device` (seeded from params.seed, else `seed`, else 0)."""
    import torch

    from splitserve.engine.sampler import SamplingRow

    generator = torch.Generator(device).manual_seed(params.seed if params.seed is not None else (seed or 0))
    return SamplingRow(params, list(prompt) + list(output), len(prompt), generator)


@lru_cache(maxsize=2)
def tiny_tokenizer(vocab_size: int = 512, seed: int = 0):
    """The tiny models' byte-level BPE tokenizer (a transformers fast tokenizer), built once per process."""
    from splitserve.engine.tiny_model import build_tokenizer

    return build_tokenizer(vocab_size=vocab_size, seed=seed)


# ---- streams, requests to the router's servers, served APIs -----------------------------------
import asyncio  # noqa: E402
from contextlib import contextmanager  # noqa: E402


def stream_tokens(port: int, request, timeout_s: float = 120.0) -> tuple[list[int], str, list]:
    """Run one Generate call; returns (token ids, text, responses)."""
    import grpc

    from splitserve.proto.splitserve.v1 import generation_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=timeout_s))
    return [t for r in responses for t in r.token_ids], "".join(r.text for r in responses), responses


class RouterOutputs:
    """A router's end of one decode worker's stream, for tests that drive a worker directly
    (opened as the router's dispatcher opens it): submit requests, read their deltas."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    @classmethod
    async def open(cls, worker, router_id: str) -> "RouterOutputs":
        from splitserve.router.dispatcher import connect_output_stream

        return cls(*await connect_output_stream(worker, router_id))

    def submit(self, request) -> None:
        from splitserve.common.output_stream import encode_frame

        self._writer.write(encode_frame(request))

    async def next(self, max_wait_s: float = 1.0) -> list:
        """The next frame's TokenDeltas, or [] when none came within max_wait_s."""
        from splitserve.common.output_stream import read_frame

        try:
            async with asyncio.timeout(max_wait_s):
                return await read_frame(self._reader)
        except TimeoutError:
            return []

    def close(self) -> None:
        self._writer.close()


def make_request_limits(max_model_len: int = 2048, vocab_size: int = 512, max_bytes_per_token: int = 13, **fields):
    """The request limits of the tiny models (vocabulary 512, longest entry 13 bytes) unless told;
    `fields` override RequestLimits' own defaults."""
    import dataclasses

    from splitserve.router.request_limits import RequestLimits

    return dataclasses.replace(RequestLimits.for_model(max_model_len, vocab_size, max_bytes_per_token), **fields)


# ---- KV events and load reports -------------------------------------------------------------
import dataclasses  # noqa: E402

from splitserve.common.kv_events import KVEventBatch, KVSnapshot, LoadReport, WorkerCounters, WorkerReport  # noqa: E402
from splitserve.common.slo import SloOutcome  # noqa: E402
from splitserve.common.stats import RequestRecord  # noqa: E402


def make_request_record(request_id: str, **fields) -> RequestRecord:
    """A finished request's record (64-token prompt, one output token, TTFT = e2e = 10 ms, both SLO
    targets met, prefill-0 -> decode-0) with `fields` replaced."""
    base = RequestRecord(
        request_id=request_id, finish_reason="length", error_code=None, routing_reason="load", rejection_reason=None,
        prefill_worker="prefill-0", decode_worker="decode-0", num_prompt_tokens=64, num_cached_tokens=0,
        num_output_tokens=1, ttft_s=0.01, inter_token_latencies=(), e2e_s=0.01, queue_s=None, prefill_s=None,
        decode_s=None, ttft_breakdown=(), kv_transfer=None, slo=SloOutcome(True, True))
    return dataclasses.replace(base, **fields)


def make_load_report(num_running: int = 0, num_waiting: int = 0, num_queued_prefill_tokens: int = 0,
                     num_kv_blocks: int = 64, num_free_kv_blocks: int = 64, prefill_s_per_token: float | None = None,
                     decode_step_s: float | None = None) -> LoadReport:
    return LoadReport(num_running, num_waiting, num_queued_prefill_tokens, num_kv_blocks, num_free_kv_blocks,
                      prefill_s_per_token, decode_step_s)


def make_worker_report(worker_id: str, epoch: str, batches: tuple[KVEventBatch, ...] = (),
                       snapshot: KVSnapshot | None = None, load: LoadReport | None = None,
                       counters: WorkerCounters | None = None) -> WorkerReport:
    return WorkerReport(worker_id, epoch, load or make_load_report(), tuple(batches), snapshot,
                        counters or WorkerCounters(0, 0, 0, 0, 0, 0))


class ScriptedReporter:
    """A worker whose report() answers follow a script (a WorkerReport is returned, an exception
    raised), each after `delay_s`; the last answer repeats. `num_reports` counts the calls."""

    def __init__(self, worker_id: str, answers: list, delay_s: float = 0.0) -> None:
        self.worker_id = worker_id
        self._answers = list(answers)
        self._delay_s = delay_s
        self.num_reports = 0

    async def report(self, epoch, after_seq: int, max_wait_s: float):
        self.num_reports += 1
        await asyncio.sleep(self._delay_s)
        answer = self._answers.pop(0) if len(self._answers) > 1 else self._answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


def http_request(port: int, method: str, path: str, body: bytes | None = None,
                 timeout_s: float = 60.0, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one plain HTTP request to a server on 127.0.0.1 (a JSON body; `headers` added)."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        headers = {**({"Content-Type": "application/json"} if body is not None else {}), **(headers or {})}
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def post_json(port: int, path: str, body: dict) -> tuple[int, dict]:
    """(status, JSON answer) of one POST of `body` to a server on 127.0.0.1."""
    status, _, raw = http_request(port, "POST", path, json.dumps(body).encode())
    return status, json.loads(raw)


def sse_json_events(port: int, path: str, body: dict) -> list[dict]:
    """The JSON bodies of a streamed POST's `data:` events (a 200 answer; the final [DONE] checked, where the
    API sends one, and left out; a Responses stream's `event:` lines skipped)."""
    status, _, raw = http_request(port, "POST", path, json.dumps(body).encode())
    assert status == 200, raw
    data = [line.removeprefix("data: ") for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]" or path == "/v1/responses"
    return [json.loads(item) for item in data if item != "[DONE]"]


@dataclass
class ServedApis:
    """Both public APIs (OpenAI-compatible HTTP with the router's /metrics, and gRPC) on free
    loopback ports over one InProcessCluster; test modules subclass it with their helpers."""

    cluster: InProcessCluster
    loop: EventLoopThread
    http_port: int
    grpc_port: int
    grpc_server: object
    """router.server.GrpcServer"""
    tokenizers: object
    """router.tokenizer_pool.TokenizerPool both APIs share (its `limits`: the request limits)."""

    def requests_ended(self, metric: str, **labels: str) -> float:
        """A request counter's value from GET /metrics on the HTTP API's port (`request_success`,
        `request_failure` with its `code`, ...)."""
        from prometheus_client.parser import text_string_to_metric_families

        status, _, body = http_request(self.http_port, "GET", "/metrics")
        assert status == 200
        samples = [s for family in text_string_to_metric_families(body.decode()) for s in family.samples
                   if s.name == f"splitserve_{metric}_total" and _without_model_name(s.labels) == labels]
        return samples[0].value if samples else 0.0

    def per_request_series(self) -> dict[tuple[str, frozenset], float]:
        """Every series of the metrics fed by request records (PER_REQUEST_METRICS) from GET /metrics, by name and
        label set."""
        from prometheus_client.parser import text_string_to_metric_families

        status, _, body = http_request(self.http_port, "GET", "/metrics")
        assert status == 200
        return {(s.name, frozenset(_without_model_name(s.labels).items())): s.value
                for family in text_string_to_metric_families(body.decode()) for s in family.samples
                if s.name in _per_request_series_names()}

    def per_request_changes(self, before: dict[tuple[str, frozenset], float]) -> dict[str, float]:
        """What moved in per_request_series() since `before`, by series name (with its label values, if any)."""
        after = self.per_request_series()
        return {name + "".join(f"{{{value}}}" for _, value in sorted(labels)): value - before.get((name, labels), 0.0)
                for (name, labels), value in after.items() if value != before.get((name, labels), 0.0)}

    def drain(self, timeout_s: float = 30.0) -> int:
        """Drain the router as SIGTERM does (router.server.drain); returns requests left in flight."""
        from splitserve.router.server import drain

        return self.loop.run(drain(self.cluster.orchestrator, self.grpc_server, timeout_s))


def _without_model_name(labels: dict[str, str]) -> dict[str, str]:
    """A sample's labels less `model_name`, which every sample carries (one value per router)."""
    return {name: value for name, value in labels.items() if name != "model_name"}


@lru_cache(maxsize=1)
def _per_request_series_names() -> frozenset[str]:
    """The exposed series of the metrics fed by request records (not the scrape-time worker, routing and event-loop
    ones): counters, and histograms' _count and _sum."""
    from splitserve.common import metrics as m

    metrics = (m.REQUEST_SUCCESS, m.REQUEST_FAILURE, m.TIME_TO_FIRST_TOKEN, m.INTER_TOKEN_LATENCY,
               m.TIME_PER_OUTPUT_TOKEN, m.E2E_REQUEST_LATENCY, m.REQUEST_QUEUE_TIME, m.REQUEST_PREFILL_TIME,
               m.REQUEST_DECODE_TIME, m.REQUEST_PROMPT_TOKENS, m.REQUEST_GENERATION_TOKENS, m.TTFT_BREAKDOWN,
               m.REQUEST_MIGRATIONS, m.SLO_REQUESTS, m.SLO_TTFT_MET, m.SLO_TPOT_MET, m.SLO_BOTH_MET, m.GOODPUT_TOKENS,
               m.INTERNAL_STEP_REQUESTS, m.REQUEST_PARAMS_N, m.REQUEST_PARAMS_MAX_TOKENS,
               m.REQUEST_MAX_NUM_GENERATION_TOKENS)
    return frozenset({d.exposed_name for d in metrics} | {d.name + suffix for d in metrics if d.kind == m.HISTOGRAM
                                                          for suffix in ("_count", "_sum")})


def capture_access_log(served: ServedApis, monkeypatch, caplog):
    """The served router's access-log lines from now on, as a function returning each line's fields (log_access added
    to its orchestrator's observer, as `splitserve serve` has it)."""
    from splitserve.deploy.router_app import each_of
    from splitserve.router.access_log import log_access

    orchestrator = served.cluster.orchestrator
    monkeypatch.setattr(orchestrator, "observer", each_of([orchestrator.observer, log_access]))
    caplog.set_level(logging.INFO, logger="splitserve.access")
    return lambda: [entry.fields for entry in caplog.records if entry.name == "splitserve.access"]


def process_stat(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state, ppid, ...); None once the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_running(pid: int) -> bool:
    """Whether pid runs (a zombie, exited and waiting for PID 1 to reap it, does not)."""
    fields = process_stat(pid)
    return fields is not None and fields[0] != "Z"


def child_of_killed_process(script: str, timeout_s: float = 10.0) -> tuple[int, bool]:
    """Run `script` (Python, from the repository root), which starts a child process and prints its pid, SIGKILL it
    once the pid is out, and wait up to timeout_s for the child to end: (the child's pid, whether it still ran
    when its parent was killed)."""
    import subprocess
    import sys
    import time

    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).parents[1])
    try:
        child = int(parent.stdout.readline())
        ran = process_running(child)
    finally:
        parent.kill()
        parent.wait(timeout=10)
    deadline = time.monotonic() + timeout_s
    while process_running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    return child, ran


@contextmanager
def served_apis(model_dir: Path, model_name: str, api_key: str | None = None,
                served_class: type[ServedApis] = ServedApis, tls=None, aliases: tuple[str, ...] = (),
                cors_allowed_origins: tuple[str, ...] = ("*",), tool_call_parser: str | None = None,
                reasoning_parser: str | None = None, generation_config=None, adapters: tuple = (),
                router_options: Mapping[str, object] = MappingProxyType({}), pooling=None, **cluster_options):
    """Start the cluster (InProcessCluster options: routing, slo, ...) and the router's servers as
    the local launcher does (deploy/router_app.py: gRPC and HTTP on free loopback ports over one
    TokenizerPool, the router's metrics on the HTTP API; over TLS with a router.tls.TlsConfig);
    everything is stopped on the way out. Requests may also name the model by `aliases`; browsers may call
    the HTTP API from `cors_allowed_origins` (router.cors_allowed_origins); `tool_call_parser` turns auto
    tool choice on with that parser (router.enable_auto_tool_choice, router.tool_call_parser);
    `reasoning_parser` splits chat outputs into reasoning and content (router.reasoning_parser);
    `generation_config` (a common.config.GenerationConfig; None: the default, auto) is where requests'
    sampling defaults come from (router.generation_config); `adapters` (common.lora.LoRARequests) are the LoRA
    adapters requests may name as `model` (lora_modules; the workers' engine_config needs enable_lora);
    `router_options`: other RouterConfig fields, e.g. {"cors_allow_credentials": True}; `pooling` (a
    common.pooling.ModelPooling): the workers embed (their engine_config's runner is pooling) and the HTTP API serves
    /v1/embeddings."""
    from splitserve.common.config import GenerationConfig
    from splitserve.common.slo import SloConfig
    from splitserve.deploy.cluster_config import RouterConfig
    from splitserve.deploy.router_app import start_servers
    from splitserve.router.metrics_server import RouterMetrics

    loop = EventLoopThread()
    metrics = RouterMetrics(SloConfig(), model_name)
    cluster = InProcessCluster(model_dir, observer=metrics.observe, **cluster_options)
    loop.run(cluster.__aenter__())
    config = RouterConfig(grpc_port=0, http_port=0, metrics_port=None, tls=tls, cors_allowed_origins=cors_allowed_origins,
                          enable_auto_tool_choice=tool_call_parser is not None, tool_call_parser=tool_call_parser,
                          reasoning_parser=reasoning_parser, generation_config=generation_config or GenerationConfig(),
                          **router_options)
    servers = loop.run(start_servers(cluster.orchestrator, cluster.tokenizer, config, model_name, metrics, api_key,
                                     aliases, adapters=adapters, pooling=pooling))
    try:
        yield served_class(cluster, loop, servers.http.port, servers.grpc.port, servers.grpc, servers.tokenizers)
    finally:
        loop.run(servers.stop(None))
        loop.run(cluster.__aexit__(None, None, None))
        loop.close()


# ---- TLS ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a throwaway CA, a server certificate it signed (SAN 127.0.0.1 and localhost)
    and a client certificate it signed; and of another CA and a client certificate signed by that."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca_cert: Path
    other_client_cert: Path
    other_client_key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """Write a fresh PKI (EC P-256 keys, valid from an hour ago for a day) under `directory`."""
    import ipaddress

    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_key, ca_cert = _self_signed_ca("splitserve test CA")
    server_key, server_cert = _signed_leaf(ca_key, ca_cert, "splitserve router", ExtendedKeyUsageOID.SERVER_AUTH,
                                           x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(
                                               "127.0.0.1")), x509.DNSName("localhost")]))
    client_key, client_cert = _signed_leaf(ca_key, ca_cert, "splitserve client", ExtendedKeyUsageOID.CLIENT_AUTH,
                                           x509.SubjectAlternativeName([x509.DNSName("client.splitserve.test")]))
    other_ca_key, other_ca_cert = _self_signed_ca("another CA")
    other_client_key, other_client_cert = _signed_leaf(
        other_ca_key, other_ca_cert, "stranger", ExtendedKeyUsageOID.CLIENT_AUTH,
        x509.SubjectAlternativeName([x509.DNSName("client.splitserve.test")]))
    files = {"ca_cert": ca_cert, "server_cert": server_cert, "server_key": server_key, "client_cert": client_cert,
             "client_key": client_key, "other_ca_cert": other_ca_cert, "other_client_cert": other_client_cert,
             "other_client_key": other_client_key}
    paths = {}
    for name, item in files.items():
        paths[name] = directory / f"{name}.pem"
        paths[name].write_bytes(_pem(item))
    return TlsFiles(**paths)


def _pem(item) -> bytes:
    from cryptography.hazmat.primitives import serialization

    if hasattr(item, "private_bytes"):
        return item.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
    return item.public_bytes(serialization.Encoding.PEM)


def _certificate(subject: str, issuer, public_key, signing_key, extensions):
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer).public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1)))
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(signing_key, hashes.SHA256())


def _self_signed_ca(name: str):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    usage = x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                          decipher_only=False)
    cert = _certificate(name, subject, key.public_key(), key,
                        [(x509.BasicConstraints(ca=True, path_length=0), True), (usage, True)])
    return key, cert


def _signed_leaf(ca_key, ca_cert, name: str, purpose, san):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(name, ca_cert.subject, key.public_key(), ca_key,
                        [(x509.BasicConstraints(ca=False, path_length=None), True),
                         (x509.ExtendedKeyUsage([purpose]), False), (san, False)])
    return key, cert


# ---- KV pools (transfer tests) ----------------------------------------------------------
class FakeClock:
    """A clock that moves only when a test sets `now` (inject it, or `lambda: clock.now + skew`)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_pool(layout: KVLayout, num_blocks: int, offset: float = 0.0) -> list[torch.Tensor]:
    """layers[l]: [num_blocks, 2, block_size, kv_heads, head_dim] holding offset + l * 1e6 + arange:
    every element of every layer distinct (and distinct across pools with offsets 1e7 apart)."""
    shape = (num_blocks, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    numel = num_blocks * 2 * layout.block_size * layout.num_kv_heads * layout.head_dim
    return [torch.arange(numel, dtype=torch.float64).add(offset + layer * 1e6).to(torch.float32).reshape(shape)
            for layer in range(layout.num_layers)]


def empty_pool(layout: KVLayout, num_blocks: int) -> list[torch.Tensor]:
    shape = (num_blocks, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return [torch.zeros(shape, dtype=torch.float32) for _ in range(layout.num_layers)]


def assert_blocks_pulled(local: list[torch.Tensor], local_ids: tuple[int, ...], remote: list[torch.Tensor],
                         remote_ids: tuple[int, ...]) -> None:
    """Every layer's local block local_ids[i] is byte-identical to remote block remote_ids[i]; every
    other local block is still all zeros."""
    untouched = [b for b in range(local[0].shape[0]) if b not in local_ids]
    for layer, (dst, src) in enumerate(zip(local, remote)):
        assert torch.equal(dst[list(local_ids)], src[list(remote_ids)]), f"layer {layer}"
        assert dst[untouched].count_nonzero().item() == 0, f"layer {layer} wrote outside the pulled blocks"


# ---- a training run in seconds ----------------------------------------------------------------
from splitserve.engine.tiny_model import TinyModelSpec  # noqa: E402
from splitserve.engine.tiny_training import TrainingConfig  # noqa: E402

TINY_CORPUS = Path(__file__).parent / "fixtures" / "tiny_corpus"
"""Five small Python files (one held out at heldout_every=3) and a test/ folder the corpus skips."""
TINY_TRAINING = TrainingConfig(
    model=TinyModelSpec(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, vocab_size=300,
                        max_position_embeddings=64, tie_word_embeddings=True, initializer_range=0.02, seed=3),
    context_len=32, batch_size=2, steps=4, peak_lr=1e-2, warmup_steps=1, heldout_every=3, threads=1)
"""Four steps on TINY_CORPUS: what the training and evaluation tests run."""


def write_dequantized_model(model_dir: Path, out_dir: Path, quantization: str, group_size: int = 128) -> Path:
    """The float32 checkpoint a quantized engine stands for: every projection replaced by its dequantized
    weight ((code - zero) * scale, as the engine quantizes or unpacks it), no quantization_config.
    The reference the quantized engine must agree with, runnable by transformers."""
    import json
    import shutil

    from safetensors.torch import save_file

    from splitserve.engine.model_loader import load_hf_config, read_checkpoint
    from splitserve.engine.quantization.formats import QuantizedWeight
    from splitserve.engine.quantization.loader import quantize_float_weight, unpack_checkpoint
    from splitserve.common.quantization_spec import PACKED_METHODS, resolve_quantization

    spec = resolve_quantization(quantization, group_size,
                                getattr(load_hf_config(model_dir), "quantization_config", None))
    checkpoint = read_checkpoint(model_dir)  # names without "model."
    if spec.method in PACKED_METHODS:
        unpack_checkpoint(checkpoint, spec)
    tensors = {}
    for name, tensor in checkpoint.items():
        if not isinstance(tensor, QuantizedWeight) and "_proj.weight" in name:
            tensor = quantize_float_weight(tensor, spec)
        tensor = tensor.dequantize() if isinstance(tensor, QuantizedWeight) else tensor.float()
        tensors[name if name == "lm_head.weight" else f"model.{name}"] = tensor.contiguous()
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy2(path, out_dir / path.name)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    (out_dir / "config.json").write_text(json.dumps({**config, "dtype": "float32"}, indent=2))
    return out_dir


# ---- speculative decoding --------------------------------------------------------------------
import shutil  # noqa: E402


def make_draft_model_dir(target_dir: Path, out_dir: Path, seed: int, vocab_size: int | None = None) -> Path:
    """A random draft model (one layer, other weights) sharing the target's tokenizer, with the target's
    vocab unless `vocab_size` says otherwise (embedding rows padded past the tokenizer, or fewer)."""
    import json

    vocab_size = vocab_size or json.loads((target_dir / "config.json").read_text())["vocab_size"]
    save_random_hf_model(out_dir, "llama", seed=seed, vocab_size=vocab_size, num_hidden_layers=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target_dir / name, out_dir / name)
    return out_dir


def chi_square_p_value(observed: list[int], expected: list[float]) -> float:
    """Pearson's goodness-of-fit p-value of counts against expected counts (same total)."""
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    degrees = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def two_sample_chi_square_p_value(first: list[int], second: list[int]) -> float:
    """p-value that two samples of equal size come from one distribution, over the categories each
    sample sees at least 5 times on average (the rest pooled into one)."""
    categories = sorted(set(first) | set(second))
    counts = [(first.count(c), second.count(c)) for c in categories]
    frequent = [pair for pair in counts if pair[0] + pair[1] >= 10]
    rare = (sum(a for a, b in counts if a + b < 10), sum(b for a, b in counts if a + b < 10))
    table = frequent + ([rare] if sum(rare) else [])
    statistic = sum((a - b) ** 2 / (a + b) for a, b in table)  # equal sizes: expected (a + b) / 2 each
    degrees = len(table) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


# ---- paged attention steps and the GPU suite's skips ---------------------------------------------
needs_kernels = pytest.mark.skipif(not load_cpu_kernels(),
                                   reason="the CPU kernels need a C++ compiler and AVX2+FMA or AVX-512")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (this machine has none)")
NIXL_MISSING = f"NIXL is not installed (none of {', '.join(NIXL_MODULES)} can be imported)"
requires_nixl = pytest.mark.skipif(nixl_module() is None, reason=NIXL_MISSING)
requires_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                                         reason="needs flashinfer: pip install -c constraints.txt '.[gpu]'")


def use_flashinfer_on_cpu(monkeypatch, graphs: bool = False) -> ReferencePagedKernels:
    """Engines built afterwards in the test run the FlashInfer backend over torch kernels that read only
    FlashInfer's metadata; with `graphs`, EngineConfig.cuda_graphs gets a DecodeGraphRunner whose "graphs"
    run eagerly (splitserve.testing.eager_graphs). Returns the eager kernels (their plan counts)."""
    from splitserve.engine import engine_core
    from splitserve.engine.attention.flashinfer import FlashInferAttention
    from splitserve.engine.cuda_graphs import DecodeGraphRunner
    from splitserve.engine.decode_buckets import DecodeBucketTable
    from splitserve.testing.eager_graphs import EagerGraphs

    kernels = ReferencePagedKernels()
    monkeypatch.setattr(engine_core, "select_backend", lambda *args, **kwargs: FlashInferAttention(kernels))

    def eager_graphs(config, model, kv_cache, attention, max_model_len):
        runner = DecodeGraphRunner(model, kv_cache, DecodeBucketTable.up_to(config.max_num_seqs),
                                   -(-max_model_len // kv_cache.spec.block_size), EagerGraphs(),
                                   lambda size, max_pages: ReferencePagedKernels())
        runner.capture()
        return runner

    if graphs:  # as on CUDA: captured wherever EngineConfig.cuda_graphs does not say no
        monkeypatch.setattr(engine_core, "uses_cuda_graphs",
                            lambda requested, device, attention, sparse_moe=False: requested is not False)
        monkeypatch.setattr(engine_core, "build_decode_graphs", eager_graphs)
    return kernels


def random_paged_step(rng: random.Random, block_size: int, num_blocks: int) -> SchedulerOutput:
    """A ragged step: fresh prompts, chunks after a cached prefix and decodes, in random order, over distinct
    random blocks (1-7 chunks, prefixes up to 40 tokens, chunks up to 23)."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    chunks = []
    for index in range(rng.randint(1, 7)):
        kind = rng.choice(("fresh", "continued", "decode"))
        start = 0 if kind == "fresh" else rng.randint(1, 40)
        num_tokens = 1 if kind == "decode" else rng.randint(2, 23)
        table = tuple(free.pop() for _ in range(-(-(start + num_tokens) // block_size)))
        chunks.append(ScheduledChunk(f"r{index}", tuple(range(num_tokens)), start, table, samples=True))
    return SchedulerOutput(tuple(chunks), ())


class MetricsSources:
    """What RouterMetrics' scrape-time collector reads from an orchestrator (RouterMetrics.watch): the workers'
    snapshots, the routing stats and the event loop's lag."""

    def __init__(self, workers, routing, loop_lag):
        self.workers, self.routing = workers, routing
        self.loop_lag = types.SimpleNamespace(stats=lambda: loop_lag)

    def worker_snapshots(self):
        return self.workers

    def routing_stats(self):
        return self.routing


# ---- paged attention cases (random pools and queries for the attention backends) -------------------
from splitserve.engine.attention.base import AttentionMetadata, DecodeBatch, PrefillSpan  # noqa: E402
from splitserve.engine.kv_quant import KVQuantization  # noqa: E402


def _random_pool(generator, dtype, num_blocks, block_size, num_kv_heads, head_dim,
                 quantization: KVQuantization | None) -> torch.Tensor:
    """[num_blocks, 2, block_size, Hkv, D] random values in dtype; with `quantization`, those values (float32)
    quantized: [num_blocks, 2, block_size, Hkv, D + 2] rows of codes and scales."""
    values = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=generator)
    return values.to(dtype) if quantization is None else quantization.quantize(values)


def paged_decode_case(generator, dtype, batch, num_heads, num_kv_heads, head_dim, block_size=16, num_blocks=64,
                      quantization: KVQuantization | None = None):
    """Random queries and pool (quantized with `quantization`); each sequence gets its own random blocks and a
    ragged length."""
    kv_cache = _random_pool(generator, dtype, num_blocks, block_size, num_kv_heads, head_dim, quantization)
    context_lens = torch.randint(1, 6 * block_size, (batch,), generator=generator)
    width = int(-(-context_lens.max() // block_size))
    tables = torch.stack([torch.randperm(num_blocks, generator=generator)[:width] for _ in range(batch)])
    query = torch.randn(batch, num_heads, head_dim, generator=generator).to(dtype)
    decode = DecodeBatch(token_indices=torch.arange(batch), block_tables=tables, context_lens=context_lens)
    return query, kv_cache, decode


def decode_metadata(decode: DecodeBatch, block_size: int = 16) -> AttentionMetadata:
    return AttentionMetadata(positions=None, key_slots=None, value_slots=None, prefills=(), decodes=(decode,),
                             block_size=block_size)


def paged_prefill_case(generator, dtype, num_heads, num_kv_heads, head_dim, start, query_len, block_size=16,
                       num_blocks=64, quantization: KVQuantization | None = None):
    """A chunk of query_len tokens after `start` positions, over random blocks; positions past the
    context in the last block are NaN (never read): with `quantization`, a quantized pool whose rows there are
    0xff bytes (NaN scales). The chunk's keys/values are the pool's rows in dtype (a quantized pool's
    dequantized)."""
    context_len = start + query_len
    table = torch.randperm(num_blocks, generator=generator)[:-(-context_len // block_size)]
    kv_cache = _random_pool(generator, dtype, num_blocks, block_size, num_kv_heads, head_dim, quantization)
    last_block, used = table[-1], context_len - (len(table) - 1) * block_size
    if quantization is None:
        kv_cache[last_block, :, used:] = float("nan")
    else:
        kv_cache.view(torch.uint8)[last_block, :, used:] = 0xff
    plain = kv_cache if quantization is None else quantization.dequantize(kv_cache, dtype)
    positions = torch.arange(start, context_len)
    rows = plain[table[positions // block_size], :, positions % block_size]  # [q, 2, Hkv, D]
    query = torch.randn(query_len, num_heads, head_dim, generator=generator).to(dtype)
    span = PrefillSpan(query_start=0, query_len=query_len, context_len=context_len, block_table=table)
    metadata = AttentionMetadata(positions=positions, key_slots=None, value_slots=None, prefills=(span,),
                                 decodes=(), block_size=block_size)
    return query, rows[:, 0], rows[:, 1], kv_cache, span, metadata
