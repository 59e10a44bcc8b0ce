"""Sampling defaults from the model's generation_config.json (vLLM's --generation-config and
--override-generation-config): the SamplingParams the router builds for a request that leaves
fields unset carry the file's values, a request's own values win, `vllm` ignores the file, the
overrides win over it, bad values stop the server at start, and over the real servers a seeded
request under the defaults samples the same tokens as one that passes them."""

from __future__ import annotations

import json
import logging

import pytest

from splitserve.common.config import GenerationConfig, SamplingDefaults
from splitserve.common.generation_config import GenerationConfigError, RequestDefaults
from splitserve.deploy.cli import build_parser, serve_config
from splitserve.deploy.cluster_config import RouterConfig
from splitserve.deploy.router_app import request_defaults
from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.router.openai_protocol import parse_chat_request, parse_completion_request
from splitserve.router.responses_protocol import parse_responses_request
from splitserve.router.server import sampling_params_from_proto
from splitserve.router.tokenizer import RouterTokenizer
from tests.factories import (copy_with_config_fields, copy_with_generation_config, http_request, make_request_limits,
                             served_apis, stream_tokens)

MODEL = "tiny-llama"
QWEN_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
"""What Qwen2.5-7B-Instruct's generation_config.json sets (besides do_sample and the token ids)."""
CHAT = [{"role": "user", "content": "Tell me about the river."}]
LIMITS = make_request_limits()


@pytest.fixture(scope="module")
def qwen_like_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with a Qwen2.5-Instruct-like generation_config.json (do_sample is ignored, as in vLLM)."""
    return copy_with_generation_config(tiny_llama_dir, tmp_path_factory.mktemp("model") / "qwen-like",
                                       do_sample=True, **QWEN_DEFAULTS)


def _defaults(model_dir, generation_config: GenerationConfig = GenerationConfig()) -> RequestDefaults:
    """What the router resolves at start (deploy/router_app.py), from the tokenizer's one read of the file."""
    return request_defaults(RouterConfig(generation_config=generation_config),
                            RouterTokenizer.from_model_dir(model_dir))


def _sampled(sampling) -> dict:
    return {name: getattr(sampling, name) for name in ("temperature", "top_p", "top_k", "min_p",
                                                       "repetition_penalty", "presence_penalty",
                                                       "frequency_penalty")}


NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
           "presence_penalty": 0.0, "frequency_penalty": 0.0}
"""SamplingParams' own defaults."""
FROM_FILE = {**NEUTRAL, **QWEN_DEFAULTS}


def test_a_request_that_sets_nothing_gets_the_files_values_on_every_api_but_triton(qwen_like_dir):
    defaults = _defaults(qwen_like_dir)
    assert defaults == RequestDefaults(SamplingDefaults(**QWEN_DEFAULTS), None,
                                       str(qwen_like_dir / "generation_config.json"))
    chat = parse_chat_request({"messages": CHAT}, LIMITS, defaults)
    completion = parse_completion_request({"prompt": "x"}, LIMITS, defaults)
    responses = parse_responses_request({"input": "x"}, LIMITS, defaults)
    grpc = sampling_params_from_proto(pb.SamplingParams(), defaults)
    assert _sampled(chat.sampling) == _sampled(completion.sampling) == _sampled(responses.chat.sampling) == \
        _sampled(grpc) == FROM_FILE
    # no max_new_tokens in the file: a chat runs to the context's end, a completion and gRPC keep 16
    assert (chat.sampling.max_tokens, completion.sampling.max_tokens, grpc.max_tokens) == (LIMITS.max_model_len, 16,
                                                                                          16)


def test_a_requests_own_values_win_explicit_temperature_0_and_neutral_values_included(qwen_like_dir):
    defaults = _defaults(qwen_like_dir)
    own = {"temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}
    chat = parse_chat_request({"messages": CHAT, **own, "min_p": 0.1}, LIMITS, defaults)
    assert _sampled(chat.sampling) == {**NEUTRAL, **own, "min_p": 0.1}
    grpc = sampling_params_from_proto(pb.SamplingParams(temperature=0, top_k=5), defaults)
    assert _sampled(grpc) == {**FROM_FILE, "temperature": 0.0, "top_k": 5}
    # an explicit null is unset (vLLM's reading of the OpenAI schema)
    assert parse_completion_request({"prompt": "x", "temperature": None}, LIMITS, defaults).sampling.temperature == 0.7


def test_vllm_mode_ignores_the_file_even_a_bad_one(qwen_like_dir, tmp_path):
    vllm = GenerationConfig(source="vllm")
    assert _defaults(qwen_like_dir, vllm) == RequestDefaults()
    assert _sampled(parse_chat_request({"messages": CHAT}, LIMITS, _defaults(qwen_like_dir, vllm)).sampling) == NEUTRAL
    bad = copy_with_generation_config(qwen_like_dir, tmp_path / "bad", temperature=-1)
    assert _defaults(bad, vllm) == RequestDefaults()


def test_overrides_win_over_the_file_and_their_max_new_tokens_limits_every_request(qwen_like_dir, tmp_path):
    config = GenerationConfig(overrides=SamplingDefaults(temperature=0.3, min_p=0.05, max_new_tokens=5))
    defaults = _defaults(qwen_like_dir, config)
    assert defaults.origin == f"{qwen_like_dir / 'generation_config.json'} and the overrides"
    chat = parse_chat_request({"messages": CHAT, "max_tokens": 100}, LIMITS, defaults)
    assert _sampled(chat.sampling) == {**FROM_FILE, "temperature": 0.3, "min_p": 0.05}
    assert chat.sampling.max_tokens == 5  # the request's 100, limited
    assert parse_chat_request({"messages": CHAT}, LIMITS, defaults).sampling.max_tokens == 5  # the default
    assert parse_completion_request({"prompt": "x"}, LIMITS, defaults).sampling.max_tokens == 5  # 16, limited
    only = _defaults(qwen_like_dir, GenerationConfig(source="vllm", overrides=SamplingDefaults(top_k=3)))
    assert _sampled(parse_chat_request({"messages": CHAT}, LIMITS, only).sampling) == {**NEUTRAL, "top_k": 3}
    bad = copy_with_generation_config(qwen_like_dir, tmp_path / "bad", temperature=-1)  # the override replaces it
    fixed = _defaults(bad, GenerationConfig(overrides=SamplingDefaults(temperature=0.3)))
    assert fixed.sampling == SamplingDefaults(**{**QWEN_DEFAULTS, "temperature": 0.3})


def test_the_files_max_new_tokens_is_a_chat_default_not_a_limit(qwen_like_dir, tmp_path):
    model_dir = copy_with_generation_config(qwen_like_dir, tmp_path / "m", max_new_tokens=7)
    defaults = _defaults(model_dir)
    assert parse_chat_request({"messages": CHAT}, LIMITS, defaults).sampling.max_tokens == 7
    assert parse_responses_request({"input": "x"}, LIMITS, defaults).chat.sampling.max_tokens == 7
    assert parse_chat_request({"messages": CHAT, "max_tokens": 100}, LIMITS, defaults).sampling.max_tokens == 100
    assert parse_completion_request({"prompt": "x"}, LIMITS, defaults).sampling.max_tokens == 16  # as in vLLM


def test_a_folder_is_read_instead_and_its_max_new_tokens_limits(tiny_llama_dir, qwen_like_dir, tmp_path):
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "max_new_tokens": 9}))
    defaults = _defaults(qwen_like_dir, GenerationConfig(source=str(folder)))
    assert defaults == RequestDefaults(SamplingDefaults(temperature=0.2, max_new_tokens=9), 9,
                                       str(folder / "generation_config.json"))
    assert parse_chat_request({"messages": CHAT, "max_tokens": 100}, LIMITS, defaults).sampling.max_tokens == 9
    with pytest.raises(GenerationConfigError, match=f"^generation config folder '{tmp_path}' .* holds no "
                                                    "generation_config.json$"):
        _defaults(tiny_llama_dir, GenerationConfig(source=str(tmp_path)))
    with pytest.raises(GenerationConfigError, match="is not a directory"):
        _defaults(tiny_llama_dir, GenerationConfig(source=str(tmp_path / "missing")))


def test_a_legacy_model_without_the_file_has_its_config_jsons_generation_fields_read(tiny_llama_dir, tmp_path):
    """transformers' GenerationConfig.from_model_config, which vLLM falls back to."""
    model_dir = copy_with_config_fields(tiny_llama_dir, tmp_path / "legacy", temperature=0.6, top_k=30)
    (model_dir / "generation_config.json").unlink()
    assert _defaults(model_dir).sampling == SamplingDefaults(temperature=0.6, top_k=30)


def test_the_defaults_are_logged_once_with_their_file(qwen_like_dir, tiny_llama_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="splitserve.deploy.router_app"):
        _defaults(qwen_like_dir)
        _defaults(tiny_llama_dir)  # its file sets no sampling value: nothing to say
    assert [record.getMessage() for record in caplog.records] == [
        f"default sampling parameters from {qwen_like_dir / 'generation_config.json'}: temperature=0.7, "
        "top_p=0.8, top_k=20, repetition_penalty=1.05 (a request's own values win; serve with "
        "--generation-config vllm to ignore the model's file)"]


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("temperature", -1, "must be a finite number >= 0, got -1"),
    ("top_p", 2, "must be in (0, 1], got 2"),
    ("top_k", "20", "must be -1, 0 or >= 1, got '20'"),
    ("max_new_tokens", 0, "must be an integer >= 1, got 0"),
])
def test_bad_values_refuse_to_start_naming_the_file_and_field(qwen_like_dir, tmp_path, field, value, reason):
    """What the router (and `splitserve serve`'s checks before Ray, tests/test_serve_cli.py) refuses."""
    model_dir = copy_with_generation_config(qwen_like_dir, tmp_path / "bad", **{field: value})
    expected = (f"{model_dir / 'generation_config.json'}: {field} {reason} (fix the file, override the field with "
                "--override-generation-config, or ignore the file with --generation-config vllm)")
    with pytest.raises(GenerationConfigError) as error:
        _defaults(model_dir)
    assert str(error.value) == expected


def test_a_bad_override_names_its_key():
    for value, message in (('{"temprature": 0.5}', "router.generation_config.overrides.temprature: unknown key "
                                                   "(known: frequency_penalty, max_new_tokens, min_p, "
                                                   "presence_penalty, repetition_penalty, temperature, top_k, top_p)"),
                           ('{"top_p": 0}', "router.generation_config.overrides.top_p: must be in (0, 1], got 0.0")):
        with pytest.raises(ValueError) as error:
            serve_config(build_parser().parse_args(["serve", "default", "--override-generation-config", value]))
        assert str(error.value) == message


# ---- through the real servers ---------------------------------------------------------------

def _token_ids(port: int, path: str, body: dict) -> list[int]:
    status, _, raw = http_request(port, "POST", path, json.dumps(body).encode())
    assert status == 200, raw
    (choice,) = json.loads(raw)["choices"]
    return choice["token_ids"]


def test_seeded_sampling_under_the_defaults_equals_passing_them(qwen_like_dir):
    """Same seed, same token ids: a request leaving the fields to the file's defaults, and one
    passing the same values, on the OpenAI API and gRPC Generate; the neutral values sample others."""
    request = {"model": MODEL, "max_tokens": 24, "seed": 5, "ignore_eos": True, "return_token_ids": True}
    with served_apis(qwen_like_dir, MODEL) as served:
        for path, prompt in (("/v1/completions", {"prompt": "The river runs"}), ("/v1/chat/completions",
                                                                                {"messages": CHAT})):
            defaulted = _token_ids(served.http_port, path, {**request, **prompt})
            assert defaulted == _token_ids(served.http_port, path, {**request, **prompt, **QWEN_DEFAULTS})
            assert defaulted != _token_ids(served.http_port, path, {**request, **prompt, **NEUTRAL})
        grpc = pb.GenerateRequest(text=b"The river runs", sampling=pb.SamplingParams(seed=5, max_tokens=24,
                                                                                    ignore_eos=True))
        explicit = pb.GenerateRequest(text=b"The river runs", sampling=pb.SamplingParams(
            seed=5, max_tokens=24, ignore_eos=True, **QWEN_DEFAULTS))
        assert stream_tokens(served.grpc_port, grpc)[0] == stream_tokens(served.grpc_port, explicit)[0]
        assert len(stream_tokens(served.grpc_port, grpc)[0]) == 24
