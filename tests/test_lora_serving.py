"""LoRA adapters over the OpenAI HTTP API (vLLM's --lora-modules): the `model` field selects an adapter, the router
hands it to the prefill and decode workers (remote prefill, KV transfer), and the output is transformers' greedy
output of the base model with that adapter merged; /v1/models lists the adapters; prefix caching keeps each
adapter's blocks apart at the workers and in the router's index; the config and CLI fields."""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace

import openai
import pytest

from splitserve.common.block_hash import BlockHasher
from splitserve.common.errors import InvalidRequestError
from splitserve.common.lora import parse_lora_modules
from splitserve.deploy.cli import build_parser, serve_config
from splitserve.deploy.preflight import PreflightError, check_lora_modules
from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.deploy.cluster_config import ClusterConfigError, default_cluster_config, parse_cluster_config
from splitserve.router.lora_adapters import AdapterRegistry, runtime_updating_allowed
from splitserve.testing.in_process_cluster import worker_engine_config
from splitserve.testing.workloads import GreedyCase
from tests.factories import (ServedApis, hf_greedy, http_request, merge_lora_adapter, save_random_lora_adapter,
                             served_apis, stream_tokens)

MODEL = "tiny-llama"
PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 31, 8, 77, 300, 12, 9, 81, 45, 2, 190]  # 2 full blocks of 8, 3 more
MAX_TOKENS = 10


class Served(ServedApis):
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key="none", max_retries=0,
                             timeout=60)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("served-adapters")
    return {"sql": save_random_lora_adapter(tiny_llama_dir, root / "sql", seed=1),
            "poet": save_random_lora_adapter(tiny_llama_dir, root / "poet", seed=2, rank=4,
                                             targets=("q_proj", "v_proj", "down_proj"))}


@pytest.fixture(scope="module")
def served(tiny_llama_dir, adapter_dirs):
    """Remote prefill for every request (InProcessCluster's default): prefill worker -> KV pull -> decode worker;
    usage reports cached tokens."""
    adapters = parse_lora_modules((*(f"{name}={path}" for name, path in adapter_dirs.items()),
                                   f"broken={adapter_dirs['sql'].parent}"))  # no adapter_config.json there
    engine = replace(worker_engine_config(), enable_lora=True, max_loras=2)
    with served_apis(tiny_llama_dir, MODEL, served_class=Served, adapters=adapters, engine_config=engine,
                     router_options={"enable_prompt_tokens_details": True}) as served:
        yield served


def completion(served: Served, model: str, prompt: list[int] = PROMPT):
    return served.client().completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True, "return_token_ids": True})


def test_the_model_field_selects_an_adapter_through_remote_prefill(served, adapter_dirs, tiny_llama_dir, tmp_path):
    """Each adapter's greedy token ids over HTTP (prefilled on the prefill worker, decoded on the decode worker
    after the KV pull) are transformers' with that adapter merged; the base model's are the base's."""
    outputs = {model: completion(served, model) for model in ("sql", MODEL, "poet")}
    case = GreedyCase(tuple(PROMPT), MAX_TOKENS, True)
    expected = {name: hf_greedy(merge_lora_adapter(tiny_llama_dir, path, tmp_path / name), case)
                for name, path in adapter_dirs.items()}
    expected[MODEL] = hf_greedy(tiny_llama_dir, case)
    assert {model: output.choices[0].token_ids for model, output in outputs.items()} == expected
    assert len({tuple(tokens) for tokens in expected.values()}) == 3  # the adapters change the output
    assert {model: output.model for model, output in outputs.items()} == {"sql": "sql", MODEL: MODEL, "poet": "poet"}
    chat = served.client().chat.completions.create(model="poet", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, temperature=0)
    assert chat.model == "poet"
    status, _, body = http_request(served.http_port, "POST", "/v1/responses",
                                   json.dumps({"model": "sql", "input": "hi", "max_output_tokens": 2}).encode())
    assert (status, json.loads(body)["model"]) == (200, "sql")


def test_the_grpc_api_selects_adapters_by_model_too(served, tiny_llama_dir, adapter_dirs, tmp_path):
    case = GreedyCase(tuple(PROMPT), MAX_TOKENS, True)
    request = pb.GenerateRequest(model="poet", token_ids=pb.TokenIds(ids=PROMPT),
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    token_ids, _, _ = stream_tokens(served.grpc_port, request)
    assert token_ids == hf_greedy(merge_lora_adapter(tiny_llama_dir, adapter_dirs["poet"], tmp_path / "poet"), case)


def test_adapters_keep_their_prefix_cache_blocks_apart(served):
    """The same prompt under the base model, "sql" twice and "poet": only the second "sql" request hits the cache,
    and the router's prefix index holds the prompt's blocks under each adapter's hashes (the workers' rule)."""
    prompt = list(range(200, 219))
    cached = [completion(served, model, prompt).usage.prompt_tokens_details.cached_tokens
              for model in (MODEL, "sql", "sql", "poet")]
    assert cached == [0, 0, 16, 0]
    hasher = BlockHasher(8, seed=0)
    index = served.cluster.orchestrator.index
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        matched = {name: index.matched_blocks(hasher.hash_prefix(prompt, lora_name=name)).get("prefill-0", 0)
                   for name in (None, "sql", "poet", "other")}
        if matched == {None: 2, "sql": 2, "poet": 2, "other": 0}:
            break
        time.sleep(0.05)
    assert matched == {None: 2, "sql": 2, "poet": 2, "other": 0}


def _lora_requests_info(served: Served) -> dict[str, tuple[str, str, str]]:
    """lora_requests_info from GET /metrics: worker -> (running adapters, waiting adapters, max_lora), value 1."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, body = http_request(served.http_port, "GET", "/metrics")
    assert status == 200
    samples = [s for family in text_string_to_metric_families(body.decode()) for s in family.samples
               if s.name == "splitserve_lora_requests_info"]
    assert {s.value for s in samples} <= {1.0}
    return {s.labels["worker"]: (s.labels["running_lora_adapters"], s.labels["waiting_lora_adapters"],
                                 s.labels["max_lora"]) for s in samples}


def _until(read, expected, timeout_s: float = 10.0):
    """read() until it returns `expected` (the router's view trails the workers by a report poll) or time is up;
    the last value read."""
    deadline = time.monotonic() + timeout_s
    while (value := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


def test_lora_requests_info_names_the_adapters_of_the_running_requests(served):
    """Two long streams, under "sql" and "poet", decoding on the decode worker: its series names both (sorted,
    comma-joined), none waiting, and its max_loras; once they ended, no adapter on either worker. Queued
    requests' adapters (waiting_lora_adapters) are test_lora's LoraLoad test."""
    streams = [served.client().completions.create(model=model, prompt=PROMPT, max_tokens=400, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
               for model in ("sql", "poet")]
    for stream in streams:
        next(iter(stream))  # prefilled: decoding from now on
    running = _until(lambda: _lora_requests_info(served)["decode-0"], ("poet,sql", "", "2"))
    for stream in streams:
        list(stream)  # to the end
    idle = {"prefill-0": ("", "", "2"), "decode-0": ("", "", "2")}
    assert (running, _until(lambda: _lora_requests_info(served), idle)) == (("poet,sql", "", "2"), idle)


def test_models_lists_the_adapters_with_the_model_as_parent(served, adapter_dirs, tiny_llama_dir):
    cards = served.client().models.list().data
    assert [(card.id, card.parent, card.root) for card in cards] == [
        (MODEL, None, str(tiny_llama_dir)), ("sql", MODEL, str(adapter_dirs["sql"])), ("poet", MODEL, str(adapter_dirs["poet"])),
        ("broken", MODEL, str(adapter_dirs["sql"].parent))]
    assert served.client().models.retrieve("sql").parent == MODEL
    status, _, body = http_request(served.http_port, "GET", "/v1/models/nope")
    assert status == 404 and b"model_not_found" in body
    status, _, body = http_request(served.http_port, "POST", "/v1/completions",
                                   b'{"model": "nope", "prompt": "hi", "max_tokens": 1}')
    assert status == 404 and b"The model `nope` does not exist" in body


def test_an_adapter_the_workers_cannot_load_is_a_400_naming_lora_request(served, adapter_dirs):
    status, _, body = http_request(served.http_port, "POST", "/v1/completions",
                                   json.dumps({"model": "broken", "prompt": PROMPT, "max_tokens": 2}).encode())
    error = json.loads(body)["error"]
    assert (status, error["param"]) == (400, "lora_request")
    assert f"LoRA adapter '{adapter_dirs['sql'].parent}': no adapter_config.json" in error["message"]
    assert completion(served, "sql").choices[0].token_ids  # the workers serve on


# ---- configuration ---------------------------------------------------------------------------------------------
def test_lora_modules_in_the_config_file_and_on_the_command_line(tmp_path):
    config = parse_cluster_config(f"""
model: m
lora_modules: [sql=/adapters/sql, poet=/adapters/poet]
prefill: {{engine: {{enable_lora: true, max_loras: 2}}}}
decode: {{engine: {{enable_lora: true, max_lora_rank: 64}}}}
""")
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in config.lora_requests] == [
        ("sql", 1, "/adapters/sql"), ("poet", 2, "/adapters/poet")]
    assert (config.prefill.engine.max_loras, config.decode.engine.max_lora_rank) == (2, 64)
    args = build_parser().parse_args(["serve", "m", "--enable-lora", "--lora-modules", "a=/x", "b=/y",
                                      "--max-loras", "3", "--max-lora-rank", "32"])
    config = serve_config(args)
    assert config.lora_modules == ("a=/x", "b=/y")
    for engine in (config.prefill.engine, config.decode.engine):
        assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank) == (True, 3, 32)


def test_serve_preflight_refuses_adapters_the_engines_would_refuse(tiny_llama_dir, adapter_dirs, tmp_path):
    """Before Ray starts: a directory without adapter_config.json, a rank above max_lora_rank, no weight file."""
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    base = f"model: {tiny_llama_dir}\nprefill: {{engine: {{enable_lora: true}}}}\n"
    cases = [(f"lora_modules: [sql={adapter_dirs['sql']}, x={tmp_path}]\n" + base,
              f"lora_modules (--lora-modules) x: LoRA adapter '{tmp_path}': no adapter_config.json"),
             (f"lora_modules: [sql={adapter_dirs['sql']}]\n" + base + "decode: {engine: {enable_lora: true, "
              "max_lora_rank: 4}}\n", "lora_modules (--lora-modules) sql: LoRA adapter "
              f"'{adapter_dirs['sql']}': rank 8 exceeds max_lora_rank 4"),
             (f"lora_modules: [w={tmp_path / 'no-weights'}]\n" + base,
              "no adapter_model.safetensors or adapter_model.bin")]
    for text, message in cases:
        text += "" if "decode:" in text else "decode: {engine: {enable_lora: true}}\n"
        with pytest.raises(PreflightError, match=re.escape(message)):
            check_lora_modules(parse_cluster_config(text))
    check_lora_modules(parse_cluster_config(f"lora_modules: [sql={adapter_dirs['sql']}]\n" + base
                                            + "decode: {engine: {enable_lora: true}}\n"))


def test_lora_modules_take_vllms_json_form_too():
    """vLLM's --lora-modules also takes '{"name": ..., "path": ..., "base_model_name": ...}' (the base model named
    is the one served: a request naming the adapter runs on it)."""
    from splitserve.common.lora import LoRARequest

    config = serve_config(build_parser().parse_args([
        "serve", "/models/m", "--served-model-name", "m", "mm", "--enable-lora", "--lora-modules",
        '{"name": "sql", "path": "/a/sql", "base_model_name": "mm"}', '{"name": "poet", "path": "/a/poet"}', "c=/a/c"]))
    assert config.lora_requests == (LoRARequest("sql", 1, "/a/sql"), LoRARequest("poet", 2, "/a/poet"),
                                    LoRARequest("c", 3, "/a/c"))


@pytest.mark.parametrize("item, message", [
    ('{"name": "sql"}', "lora_modules item '{\"name\": \"sql\"}' must be NAME=PATH or a JSON object with "
                        "string name and path (and base_model_name)"),
    ('{"name": "sql", "path": "/a", "scale": 2}', "lora_modules item '{\"name\": \"sql\", \"path\": \"/a\", "
                                                  "\"scale\": 2}': unknown key 'scale' (known: base_model_name, "
                                                  "name, path)"),
    ('{"name": "sql", "path": "/a", "base_model_name": "other"}', "lora_modules item '{\"name\": \"sql\", "
                                                                  "\"path\": \"/a\", \"base_model_name\": "
                                                                  "\"other\"}': base_model_name 'other' is not a "
                                                                  "served model name ['m']"),
])
def test_a_bad_json_lora_module_is_refused_saying_why(item, message):
    with pytest.raises(ClusterConfigError) as raised:
        serve_config(build_parser().parse_args(["serve", "/models/m", "--served-model-name", "m", "--enable-lora",
                                                "--lora-modules", item]))
    assert (raised.value.path, raised.value.reason) == ("lora_modules", message)


@pytest.mark.parametrize("text, key, message", [
    ("lora_modules: [sql=/a]", "prefill.engine.enable_lora", "must be true to serve lora_modules"),
    ("lora_modules: [sql]\nprefill: {engine: {enable_lora: true}}\ndecode: {engine: {enable_lora: true}}",
     "lora_modules", "must be NAME=PATH"),
    ("lora_modules: [a=/x, a=/y]\nprefill: {engine: {enable_lora: true}}\ndecode: {engine: {enable_lora: true}}",
     "lora_modules", "names adapter 'a' twice"),
    ("lora_modules: [m=/x]\nprefill: {engine: {enable_lora: true}}\ndecode: {engine: {enable_lora: true}}",
     "lora_modules", "adapter names ['m'] are the model's own names"),
])
def test_bad_lora_modules_are_refused_naming_the_key(text, key, message):
    with pytest.raises(ClusterConfigError, match=re.escape(message)) as raised:
        parse_cluster_config(f"model: m\n{text}\n")
    assert raised.value.path == key
    assert default_cluster_config("m").lora_requests == ()


# ---- runtime loading (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter) ------------------------------------
def test_runtime_loading_endpoints_exist_only_when_the_environment_allows_them(served, adapter_dirs):
    body = json.dumps({"lora_name": "x", "lora_path": str(adapter_dirs["sql"])}).encode()
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        status, _, response = http_request(served.http_port, "POST", path, body)
        assert status == 404 and b"unknown_url" in response
    assert runtime_updating_allowed({}) is False
    assert runtime_updating_allowed({"SPLITSERVE_ALLOW_RUNTIME_LORA_UPDATING": "true"}) is True
    assert runtime_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) is True


def test_adapters_load_and_unload_at_runtime(tiny_llama_dir, adapter_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_ALLOW_RUNTIME_LORA_UPDATING", "true")
    engine = replace(worker_engine_config(), enable_lora=True, max_loras=2)

    def post(path: str, **fields) -> tuple[int, bytes]:
        status, _, body = http_request(served.http_port, "POST", path, json.dumps(fields).encode())
        return status, body

    with served_apis(tiny_llama_dir, MODEL, served_class=Served, engine_config=engine,
                     router_options={"enable_prompt_tokens_details": True}) as served:
        sql = str(adapter_dirs["sql"])
        assert post("/v1/load_lora_adapter", lora_name="sql", lora_path=sql) == (
            200, b"Success: LoRA adapter 'sql' added successfully.")
        first = completion(served, "sql")
        expected = hf_greedy(merge_lora_adapter(tiny_llama_dir, adapter_dirs["sql"], tmp_path / "sql"),
                             GreedyCase(tuple(PROMPT), MAX_TOKENS, True))
        assert first.choices[0].token_ids == expected and first.model == "sql"
        assert [card.id for card in served.client().models.list().data] == [MODEL, "sql"]
        refusals = [post("/v1/load_lora_adapter", lora_name="sql", lora_path=sql),
                    post("/v1/load_lora_adapter", lora_name="empty", lora_path=str(tmp_path)),
                    post("/v1/load_lora_adapter", lora_name=MODEL, lora_path=sql),
                    post("/v1/load_lora_adapter", lora_path=sql),
                    post("/v1/load_lora_adapter", lora_name="sq\ud800l", lora_path=sql)]
        assert [(status, json.loads(body)["error"]["param"]) for status, body in refusals] == [
            (400, "lora_name"), (400, "lora_path"), (400, "lora_name"), (400, "lora_name"), (400, "lora_name")]
        assert b"has already been loaded" in refusals[0][1]
        # a name no response can echo (it was loaded: every /v1/models and each request naming it was a 500)
        assert [card.id for card in served.client().models.list().data] == [MODEL, "sql"]
        assert post("/v1/unload_lora_adapter", lora_name="sql") == (
            200, b"Success: LoRA adapter 'sql' removed successfully.")
        status, _, body = http_request(served.http_port, "POST", "/v1/completions",
                                       json.dumps({"model": "sql", "prompt": PROMPT, "max_tokens": 1}).encode())
        assert status == 404 and b"model_not_found" in body
        status, body = post("/v1/unload_lora_adapter", lora_name="sql")
        assert status == 404 and b"The lora adapter 'sql' cannot be found." in body
        # the same name from another directory would meet the old adapter's weights and KV: refused
        status, body = post("/v1/load_lora_adapter", lora_name="sql", lora_path=str(adapter_dirs["poet"]))
        assert status == 400 and b"choose another name" in body
        # from the same directory it is the same adapter again: its blocks are still cached
        assert post("/v1/load_lora_adapter", lora_name="sql", lora_path=sql)[0] == 200
        again = completion(served, "sql")
        assert again.choices[0].token_ids == expected and again.usage.prompt_tokens_details.cached_tokens == 16


def test_the_registry_refuses_a_name_without_a_utf8_form(adapter_dirs):
    """A JSON body can carry a lone surrogate ("\\ud800"): no answer that names the adapter could be encoded."""
    registry = AdapterRegistry((), frozenset({MODEL}))
    with pytest.raises(InvalidRequestError) as caught:
        registry.load("sq\ud800l", str(adapter_dirs["sql"]))
    assert str(caught.value) == "lora_name: is not valid Unicode (lone surrogate '\\ud800' at index 2)"
    assert registry.loaded() == ()


def test_the_registry_never_reuses_an_id_for_another_adapter(tmp_path, adapter_dirs):
    registry = AdapterRegistry(parse_lora_modules((f"a={adapter_dirs['sql']}",)), frozenset({MODEL}))
    b = registry.load("b", str(adapter_dirs["poet"]))
    registry.unload("a")
    a = registry.load("a", str(adapter_dirs["sql"]))
    c = registry.load("c", str(adapter_dirs["poet"]))
    assert [(r.lora_name, r.lora_int_id) for r in (a, b, c)] == [("a", 1), ("b", 2), ("c", 3)]
    assert [r.lora_name for r in registry.loaded()] == ["b", "a", "c"]
