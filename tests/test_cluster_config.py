"""Cluster config: per-pool defaults, YAML loading, dotted overrides, exact error messages."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.common.config import EngineConfig, SpeculativeConfig
from splitserve.deploy.cluster_config import (
    ClusterConfig,
    ClusterConfigError,
    PoolConfig,
    RayResources,
    RouterConfig,
    apply_overrides,
    default_cluster_config,
    dump_cluster_config,
    load_cluster_config,
    parse_cluster_config,
)

EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "configs" / "local.yaml"
ROOT_KEYS = ("decode, kv_transfer_backend, kv_transfer_failure_policy, kv_transfer_layerwise, log_format, lora_modules, "
             "mode, model, planner, prefill, ray_address, router, served_model_name, tokenizer, worker_start_timeout_s")
POOL_KEYS = "engine, max_restarts, replicas, resources, transfer_poll_s"


def test_defaults_tune_each_pool_for_its_phase():
    config = default_cluster_config("m")
    assert config == ClusterConfig(
        model="m", mode="disaggregated",
        prefill=PoolConfig(1, EngineConfig(max_num_seqs=16, max_num_batched_tokens=8192,
                                           kv_cache_memory_bytes=256 << 20), RayResources(1.0, 0.0)),
        decode=PoolConfig(1, EngineConfig(max_num_seqs=256, max_num_batched_tokens=512,
                                          kv_cache_memory_bytes=2 << 30), RayResources(1.0, 0.0)),
        router=RouterConfig(host="127.0.0.1", grpc_port=50051, request_timeout_s=None, lease_ttl_s=30.0),
        kv_transfer_backend="nixl", ray_address=None)


def test_a_file_with_only_the_model_gives_the_defaults():
    assert parse_cluster_config("model: some/dir\n") == default_cluster_config("some/dir")


def test_a_file_changes_only_the_keys_it_names():
    config = parse_cluster_config("model: m\nprefill:\n  replicas: 3\n  engine: {max_num_seqs: 4}\n"
                                  "decode:\n  resources: {num_cpus: 2}\n")
    default = default_cluster_config("m")
    assert config.prefill == dataclasses.replace(
        default.prefill, replicas=3, engine=dataclasses.replace(default.prefill.engine, max_num_seqs=4))
    assert config.decode == dataclasses.replace(default.decode, resources=RayResources(num_cpus=2.0))
    assert config.decode.resources.num_cpus == 2.0 and isinstance(config.decode.resources.num_cpus, float)
    assert config.router == default.router


def test_the_local_example_loads_as_documented():
    default = default_cluster_config("default")
    cpu = {"device": "cpu", "num_threads": 1}
    assert load_cluster_config(EXAMPLE) == dataclasses.replace(
        default,
        prefill=dataclasses.replace(default.prefill, engine=dataclasses.replace(default.prefill.engine, **cpu)),
        decode=dataclasses.replace(default.decode, engine=dataclasses.replace(
            default.decode.engine, kv_cache_memory_bytes=1 << 30, **cpu)))


@pytest.mark.parametrize("config", [default_cluster_config("m"), load_cluster_config(EXAMPLE)],
                         ids=["defaults", "example"])
def test_dump_round_trips(config, tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(dump_cluster_config(config))
    assert load_cluster_config(path) == config


def test_setting_one_kv_sizing_field_replaces_the_pools_default_sizing():
    config = parse_cluster_config("model: m\ndecode:\n  engine: {num_kv_blocks: 100}\n")
    assert (config.decode.engine.num_kv_blocks, config.decode.engine.kv_cache_memory_bytes) == (100, None)
    assert config.prefill.engine.kv_cache_memory_bytes == 256 << 20


def test_gpu_memory_utilization_replaces_the_pools_default_sizing_and_explicit_sizes_stay_beside_it():
    config = parse_cluster_config("model: m\ndecode:\n  engine: {gpu_memory_utilization: 0.6}\n")
    decode, prefill = config.decode.engine, config.prefill.engine
    assert (decode.gpu_memory_utilization, decode.kv_cache_memory_bytes, decode.num_kv_blocks) == (0.6, None, None)
    assert (prefill.gpu_memory_utilization, prefill.kv_cache_memory_bytes) == (None, 256 << 20)
    both = parse_cluster_config("model: m\ndecode:\n  engine: {gpu_memory_utilization: 0.6, num_kv_blocks: 64}\n")
    assert (both.decode.engine.gpu_memory_utilization, both.decode.engine.num_kv_blocks) == (0.6, 64)


def test_colocated_mode_needs_no_prefill_pool():
    config = parse_cluster_config("model: m\nmode: colocated\nprefill: {replicas: 0}\ndecode: {replicas: 2}\n")
    assert (config.mode, config.prefill.replicas, config.decode.replicas) == ("colocated", 0, 2)


def test_a_colocated_file_needs_no_prefill_section():
    """`mode: colocated` alone was refused (prefill.replicas: must be 0 ..., got 1: the default's pool), where
    `--mode colocated` on the command line empties the prefill pool itself."""
    config = parse_cluster_config("model: m\nmode: colocated\n")
    assert (config.mode, config.prefill.replicas, config.decode.replicas) == ("colocated", 0, 1)


def test_colocated_pools_may_differ_in_block_size():
    config = parse_cluster_config("model: m\nmode: colocated\nprefill: {replicas: 0}\n"
                                  "decode: {engine: {block_size: 32}}\n")
    assert config.decode.engine.block_size == 32


def test_cuda_pool_with_a_gpu_per_actor():
    config = parse_cluster_config("model: m\nprefill: {engine: {device: cuda}, resources: {num_gpus: 0.5}}\n")
    assert (config.prefill.engine.device, config.prefill.resources.num_gpus) == ("cuda", 0.5)


BAD_FILES = [
    ("decode: {engine: {max_num_seqs: 0}}", "decode.engine.max_num_seqs: must be >= 1, got 0"),
    ("router: {worker_link: {report_timeout_s: 0}}", "router.worker_link.report_timeout_s: must be > 0, got 0.0"),
    ("decode: {transfer_poll_s: 0}", "decode.transfer_poll_s: must be > 0 or null, got 0.0"),
    ("prefill: {engin: {}}", f"prefill.engin: unknown key (known: {POOL_KEYS})"),
    ("prefill: {1: x}", f"prefill.1: unknown key (known: {POOL_KEYS})"),
    ("router: {'': x}", "router.'': unknown key (known: access_log, api_key_env, chat_template, chat_template_content_format, cors_allow_credentials, cors_allowed_headers, cors_allowed_methods, cors_allowed_origins, drain_timeout_s, enable_auto_tool_choice, enable_prompt_tokens_details, enable_request_id_headers, generation_config, grpc_port, host, http_acceptor_process, http_port, lease_ttl_s, max_logprobs, max_pending_tokenizations, max_prompt_bytes, metrics_port, reasoning_parser, replicas, request_timeout_s, resources, response_role, return_tokens_as_token_ids, root_path, routing, slo, tls, tokenizer_threads, tool_call_parser, trust_request_chat_template, uvicorn_log_level, worker_link)"),
    ("null: x", f"None: unknown key (known: {ROOT_KEYS})"),
    ("router_port: 1", f"router_port: unknown key (known: {ROOT_KEYS})"),
    ("router: {port: 1}", "router.port: unknown key (known: access_log, api_key_env, chat_template, chat_template_content_format, cors_allow_credentials, cors_allowed_headers, cors_allowed_methods, cors_allowed_origins, drain_timeout_s, enable_auto_tool_choice, enable_prompt_tokens_details, enable_request_id_headers, generation_config, grpc_port, host, http_acceptor_process, http_port, lease_ttl_s, max_logprobs, max_pending_tokenizations, max_prompt_bytes, metrics_port, reasoning_parser, replicas, request_timeout_s, resources, response_role, return_tokens_as_token_ids, root_path, routing, slo, tls, tokenizer_threads, tool_call_parser, trust_request_chat_template, uvicorn_log_level, worker_link)"),
    ("prefill: {resources: {gpus: 1}}", "prefill.resources.gpus: unknown key (known: node_labels, num_cpus, num_gpus)"),
    ("planner: {attainment: 1}", "planner.attainment: must be in (0, 1), got 1.0"),
    ("log_format: yaml", "log_format: must be one of ('text', 'json'), got 'yaml'"),
    ("planner: {tick_s: 0}", "planner.tick_s: must be > 0, got 0.0"),
    ("planner: {decode: {min_replicas: 3, max_replicas: 2}}",
     "planner.decode: need 0 <= min_replicas <= max_replicas, got 3, 2"),
    ("planner: {enabled: true, decode: {min_replicas: 2}}", "decode.replicas: must be within planner.decode's [2, 8], got 1"),
    ("planner: {enabled: true, prefill: {min_replicas: 0}}", "planner.prefill.min_replicas: must be >= 1, got 0"),
    ("mode: colocated\nprefill: {replicas: 0}\nplanner: {enabled: true}",
     "planner.enabled: needs mode: disaggregated"),
    ("planner: {profile: {decode_fixed_s: -1}}", "planner.profile.decode_fixed_s: must be a finite number >= 0, got -1.0"),
    ("planner: {profile: {max_batch_size: 0}}", "planner.profile.max_batch_size: must be >= 1, got 0"),
    ("planner: {profile: {prefill_token_budget: 0}}", "planner.profile.prefill_token_budget: must be >= 1, got 0"),
    ("planner: {scale_down_ticks: 0}", "planner.scale_down_ticks: must be >= 1, got 0"),
    ("planner: {scale_down_margin: 1}", "planner.scale_down_margin: must be in [0, 1), got 1.0"),
    ("prefill: {resources: {node_labels: 'a=b,c'}}",
     "prefill.resources.node_labels: must be comma-separated key=value pairs, got 'a=b,c'"),
    ("prefill: {resources: {node_labels: 'pool=p'}}\ndecode: {resources: {node_labels: 'pool=d'}}",
     "decode.resources.node_labels: cannot differ from prefill's on ['pool'] when ray_address is null (a local Ray "
     "is one node)"),
    ("kv_transfer_failure_policy: retry",
     "kv_transfer_failure_policy: must be one of ('recompute', 'fail'), got 'retry'"),
    ("kv_transfer_layerwise: 1", "kv_transfer_layerwise: must be a boolean, got 1"),
    ("mode: colocated\nprefill: {replicas: 0}\nkv_transfer_layerwise: true",
     "kv_transfer_layerwise: needs mode: disaggregated (a colocated cluster moves no KV)"),
    ("worker_start_timeout_s: 0", "worker_start_timeout_s: must be > 0, got 0.0"),
    ("router: {reasoning_parser: granite}",
     "router.reasoning_parser: must be one of deepseek_r1, qwen3, openai_gptoss or null, got 'granite'"),
    ("router: {chat_template_content_format: parts}",
     "router.chat_template_content_format: must be one of auto, string, openai, got 'parts'"),
    ("router: {tool_call_parser: mistral}",
     "router.tool_call_parser: must be one of hermes, llama3_json, openai or null, got 'mistral'"),
    ("router: {enable_auto_tool_choice: true}",
     "router.enable_auto_tool_choice: needs tool_call_parser (how the model writes its calls)"),
    ("decode: {engine: {max_num_seqs: '8'}}", "decode.engine.max_num_seqs: must be an integer, got '8'"),
    ("prefill: {replicas: true}", "prefill.replicas: must be an integer, got True"),
    ("router: {grpc_port: 1.5}", "router.grpc_port: must be an integer, got 1.5"),
    ("router: {drain_timeout_s: -1}", "router.drain_timeout_s: must be >= 0, got -1.0"),
    ("router: {max_prompt_bytes: 0}", "router.max_prompt_bytes: must be >= 1 or null, got 0"),
    ("router: {tokenizer_threads: 0}", "router.tokenizer_threads: must be >= 1, got 0"),
    ("router: {replicas: 0}", "router.replicas: must be >= 1, got 0"),
    ("router: {replicas: 2}\nplanner: {enabled: true}",
     "router.replicas: must be 1 with planner.enabled (the planner runs in the one router), got 2"),
    ("router: {resources: {node_labels: ray.io/node-group=router}}\n"
     "prefill: {resources: {node_labels: ray.io/node-group=prefill}}",
     "router.resources.node_labels: cannot differ from the pools' on ['ray.io/node-group'] when ray_address is "
     "null (a local Ray is one node)"),
    ("router: {max_pending_tokenizations: 0}", "router.max_pending_tokenizations: must be >= 1, got 0"),
    ("decode: {engine: {max_model_len: [1]}}", "decode.engine.max_model_len: must be an integer or null, got [1]"),
    ("prefill: {engine: {enable_prefix_caching: 1}}",
     "prefill.engine.enable_prefix_caching: must be a boolean, got 1"),
    ("prefill: {resources: {num_cpus: two}}", "prefill.resources.num_cpus: must be a finite number, got 'two'"),
    ("prefill: {resources: {num_cpus: false}}", "prefill.resources.num_cpus: must be a finite number, got False"),
    ("decode: {resources: {num_gpus: .inf}}", "decode.resources.num_gpus: must be a finite number, got inf"),
    ("decode: {resources: {num_gpus: .nan}}", "decode.resources.num_gpus: must be a finite number, got nan"),
    ("prefill: {resources: {num_cpus: 1.0e+400}}", "prefill.resources.num_cpus: must be a finite number, got inf"),
    (f"decode: {{resources: {{num_gpus: {10 ** 400}}}}}",
     "decode.resources.num_gpus: must be a finite number, got 100000000000000000...0000000000000000000"),
    ("router: {lease_ttl_s: null}", "router.lease_ttl_s: must be a finite number, got None"),
    ("router: {request_timeout_s: fast}", "router.request_timeout_s: must be a finite number or null, got 'fast'"),
    ("prefill: {engine: {dtype: 16}}", "prefill.engine.dtype: must be a string, got 16"),
    ("prefill: 3", "prefill: must be a mapping, got 3"),
    ("router: [a]", "router: must be a mapping, got ['a']"),
    ("prefill: {engine: null}", "prefill.engine: must be a mapping, got None"),
    ("mode: split", "mode: must be one of ('disaggregated', 'colocated'), got 'split'"),
    ("kv_transfer_backend: rdma", "kv_transfer_backend: must be one of ('nixl', 'inprocess'), got 'rdma'"),
    ("kv_transfer_backend: inprocess", "kv_transfer_backend: inprocess moves KV only between workers in one process "
                                       "(the tests' clusters), and each worker here is a Ray actor in a process of its "
                                       "own: use nixl"),
    ("ray_address: ''", "ray_address: must not be empty (null starts a local Ray)"),
    ("router: {host: ''}", "router.host: must not be empty"),
    ("router: {grpc_port: 65536}", "router.grpc_port: must be in [0, 65535], got 65536"),
    ("router: {grpc_port: -1}", "router.grpc_port: must be in [0, 65535], got -1"),
    ("router: {metrics_port: 70000}", "router.metrics_port: must be in [0, 65535] or null, got 70000"),
    ("router: {metrics_port: '9400'}", "router.metrics_port: must be an integer or null, got '9400'"),
    ("router: {grpc_port: 9000, metrics_port: 9000}", "router.metrics_port: must differ from grpc_port (9000)"),
    ("router: {http_port: 70000}", "router.http_port: must be in [0, 65535] or null, got 70000"),
    ("router: {http_port: 9400}", "router.http_port: must differ from grpc_port (50051) and metrics_port (9400)"),
    ("router: {request_timeout_s: 0}", "router.request_timeout_s: must be > 0, got 0.0"),
    ("router: {lease_ttl_s: -2}", "router.lease_ttl_s: must be > 0, got -2.0"),
    ("router: {slo: {ttft_s: 0}}", "router.slo.ttft_s: must be a finite number > 0, got 0.0"),
    ("router: {routing: {policy: random}}",
     "router.routing.policy: must be one of ('prefix_aware', 'least_loaded', 'round_robin'), got 'random'"),
    ("router: {routing: {disaggregation: sometimes}}",
     "router.routing.disaggregation: must be one of ('auto', 'always', 'never'), got 'sometimes'"),
    ("router: {routing: {max_local_prefill_tokens: -1}}", "router.routing.max_local_prefill_tokens: must be >= 0, got -1"),
    ("router: {routing: {ttft_slo: 1}}", "router.routing.ttft_slo: unknown key (known: admission_ttft_factor, "
     "default_prefill_s_per_token, disaggregation, max_in_flight_requests, max_local_prefill_tokens, max_migrations, "
     "max_queued_prefill_tokens, policy, transfer_s_per_token)"),
    ("router: {routing: {max_in_flight_requests: 0}}",
     "router.routing.max_in_flight_requests: must be >= 1, got 0"),
    ("router: {routing: {max_migrations: -1}}", "router.routing.max_migrations: must be >= 0, got -1"),
    ("prefill: {resources: {num_cpus: -1}}", "prefill.resources.num_cpus: must be >= 0, got -1.0"),
    ("decode: {resources: {num_gpus: -0.5}}", "decode.resources.num_gpus: must be >= 0, got -0.5"),
    ("prefill: {replicas: -1}", "prefill.replicas: must be >= 0, got -1"),
    ("prefill: {replicas: 0}", "prefill.replicas: must be >= 1 in disaggregated mode, got 0"),
    ("decode: {replicas: 0}", "decode.replicas: must be >= 1, got 0"),
    ("mode: colocated\nprefill: {replicas: 1}",
     "prefill.replicas: must be 0 in colocated mode (decode workers do both phases), got 1"),
    ("mode: colocated\nprefill: {replicas: 0}\ndecode: {replicas: 0}", "decode.replicas: must be >= 1, got 0"),
    ("decode: {engine: {block_size: 32}}",
     "decode.engine.block_size: must equal prefill.engine.block_size (16) in disaggregated mode, got 32"),
    ("prefill: {engine: {dtype: float32}}",
     "decode.engine.dtype: must equal prefill.engine.dtype ('float32') in disaggregated mode, got 'auto'"),
    ("decode: {engine: {hash_seed: 7}}",
     "decode.engine.hash_seed: must equal prefill.engine.hash_seed (0) in disaggregated mode, got 7"),
    ("decode: {engine: {scheduling_policy: priority}}",
     "decode.engine.scheduling_policy: must equal prefill.engine.scheduling_policy ('fcfs') in disaggregated mode, "
     "got 'priority'"),
    ("prefill: {engine: {scheduling_policy: lifo}}",
     "prefill.engine.scheduling_policy: must be one of ('fcfs', 'priority'), got 'lifo'"),
    ("decode: {engine: {device: cuda}}",
     "decode.resources.num_gpus: must be > 0 when engine.device is 'cuda', got 0.0"),
    ("prefill: {engine: {dtype: fp8}}",
     "prefill.engine.dtype: must be one of ('auto', 'float32', 'bfloat16', 'float16'), got 'fp8'"),
    ("prefill: {engine: {num_threads: 0}}", "prefill.engine.num_threads: must be >= 1, got 0"),
    ("decode: {engine: {kv_cache_memory_fraction: 1.5}}",
     "decode.engine.kv_cache_memory_fraction: must be in (0, 1], got 1.5"),
    ("decode: {engine: {gpu_memory_utilization: 0}}",
     "decode.engine.gpu_memory_utilization: must be in (0, 1], got 0.0"),
    ("prefill: {engine: {gpu_memory_utilization: '0.9'}}",
     "prefill.engine.gpu_memory_utilization: must be a finite number or null, got '0.9'"),
    ("decode: {engine: {num_kv_blocks: 10, kv_cache_memory_fraction: 0.5}}",
     "decode.engine: set at most one of num_kv_blocks, kv_cache_memory_bytes, kv_cache_memory_fraction; "
     "got ['num_kv_blocks', 'kv_cache_memory_fraction']"),
]


@pytest.mark.parametrize(("body", "message"), BAD_FILES, ids=[message for _, message in BAD_FILES])
def test_bad_values_name_the_full_key_path(body, message):
    with pytest.raises(ClusterConfigError) as caught:
        parse_cluster_config("model: m\n" + body + "\n")
    assert str(caught.value) == message


@pytest.mark.parametrize(("text", "message"), [
    ("", "(top level): must be a mapping, got None"),
    ("- model: m", "(top level): must be a mapping, got [{'model': 'm'}]"),
    ("mode: colocated", "model: required key is missing"),
    ("model: 7", "model: must be a string, got 7"),
    ("model: ''", "model: must not be empty"),
])
def test_bad_documents(text, message):
    with pytest.raises(ClusterConfigError) as caught:
        parse_cluster_config(text)
    assert str(caught.value) == message


def test_invalid_yaml_is_a_config_error():
    with pytest.raises(ClusterConfigError) as caught:
        parse_cluster_config("model: [m\n")
    assert str(caught.value).startswith("(top level): invalid YAML: ")
    assert caught.value.path == ""


def test_the_error_carries_path_and_reason_and_is_a_value_error():
    with pytest.raises(ValueError) as caught:
        parse_cluster_config("model: m\ndecode: {engine: {max_num_seqs: 0}}\n")
    assert (caught.value.path, caught.value.reason) == ("decode.engine.max_num_seqs", "must be >= 1, got 0")


def test_direct_construction_is_validated_too():
    default = default_cluster_config("m")
    with pytest.raises(ClusterConfigError, match=r"^prefill\.replicas: must be 0 in colocated mode"):
        dataclasses.replace(default, mode="colocated")
    with pytest.raises(ClusterConfigError, match=r"^num_gpus: must be >= 0, got -1$"):
        RayResources(num_gpus=-1)


@pytest.mark.parametrize(("config", "changes", "message"), [
    (EngineConfig, {"block_size": "16"}, "block_size must be an integer, got '16'"),
    (EngineConfig, {"enable_prefix_caching": "yes"}, "enable_prefix_caching must be a boolean, got 'yes'"),
    (EngineConfig, {"num_threads": True}, "num_threads must be an integer or null, got True"),
    (EngineConfig, {"kv_cache_memory_bytes": 1e9}, "kv_cache_memory_bytes must be an integer or null, got 1000000000.0"),
    (EngineConfig, {"kv_cache_memory_fraction": math.nan}, "kv_cache_memory_fraction must be a finite number or null, got nan"),
    (SpeculativeConfig, {"num_speculative_tokens": 2.0}, "num_speculative_tokens must be an integer, got 2.0"),
    (SpeculativeConfig, {"adaptive": 1}, "adaptive must be a boolean, got 1"),
])
def test_engine_configs_built_in_python_are_type_checked_as_files_are(config, changes, message):
    with pytest.raises(ValueError) as caught:
        config(**changes)
    assert str(caught.value) == message


def test_engine_configs_take_ints_for_floats_and_none_where_optional():
    assert EngineConfig(kv_cache_memory_fraction=1, max_model_len=None).kv_cache_memory_fraction == 1
    assert SpeculativeConfig(draft_model=None).draft_model is None


def test_overrides_apply_dotted_keys():
    config = apply_overrides(default_cluster_config("m"),
                             {"prefill.replicas": 2, "decode.engine.max_num_seqs": 64, "router.grpc_port": 0})
    default = default_cluster_config("m")
    assert config == dataclasses.replace(
        default, prefill=dataclasses.replace(default.prefill, replicas=2),
        decode=dataclasses.replace(default.decode, engine=dataclasses.replace(default.decode.engine, max_num_seqs=64)),
        router=dataclasses.replace(default.router, grpc_port=0))


@pytest.mark.parametrize("overrides", [
    {"mode": "colocated", "prefill.replicas": 0, "decode.replicas": 2},
    {"decode.replicas": 2, "prefill.replicas": 0, "mode": "colocated"},
], ids=["mode-first", "mode-last"])
def test_overrides_are_validated_together_in_any_order(overrides):
    config = apply_overrides(default_cluster_config("m"), overrides)
    assert (config.mode, config.prefill.replicas, config.decode.replicas) == ("colocated", 0, 2)


def test_overrides_on_a_loaded_file_keep_its_other_settings():
    config = apply_overrides(load_cluster_config(EXAMPLE), {"decode.resources.num_cpus": 2, "model": "/models/x"})
    assert (config.model, config.decode.resources.num_cpus, config.decode.engine.num_threads) == ("/models/x", 2.0, 1)


def test_no_overrides_is_the_same_config():
    config = load_cluster_config(EXAMPLE)
    assert apply_overrides(config, {}) == config


@pytest.mark.parametrize(("overrides", "message"), [
    ({"decode.engine.max_num_seqs": 0}, "decode.engine.max_num_seqs: must be >= 1, got 0"),
    ({"prefill.replicas": "2"}, "prefill.replicas: must be an integer, got '2'"),
    ({"router.grpc_port": True}, "router.grpc_port: must be an integer, got True"),
    ({"prefil.replicas": 1}, f"prefil: unknown key (known: {ROOT_KEYS})"),
    ({"prefill.": 1}, f"prefill.'': unknown key (known: {POOL_KEYS})"),
    ({"prefill.replicas.x": 1}, "prefill.replicas: must be an integer, got {'x': 1}"),
    ({"mode": "colocated"},
     "prefill.replicas: must be 0 in colocated mode (decode workers do both phases), got 1"),
    ({"prefill": 1, "prefill.replicas": 2}, "prefill.replicas: conflicts with another override"),
    ({"prefill.replicas": 2, "prefill": 1}, "prefill: conflicts with another override"),
])
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(ClusterConfigError) as caught:
        apply_overrides(default_cluster_config("m"), overrides)
    assert str(caught.value) == message


def test_overrides_never_modify_the_callers_mapping():
    section = {"replicas": 2}
    with pytest.raises(ClusterConfigError, match=r"^prefill\.engine\.max_num_seqs: conflicts with another override$"):
        apply_overrides(default_cluster_config("m"), {"prefill": section, "prefill.engine.max_num_seqs": 4})
    assert section == {"replicas": 2}


# ---- junk never escapes as anything but ClusterConfigError ---------------------------------------

_EDGE_NUMBERS = st.sampled_from([10 ** 400, -(2 ** 1024), math.inf, math.nan, -0.0, 2 ** 63])
_keys = st.text(max_size=4) | st.integers(-2, 2) | st.none()
_scalars = (st.none() | st.booleans() | st.integers(-2, 70000) | st.integers() | st.floats(-2, 100) | st.floats()
            | _EDGE_NUMBERS | st.text(max_size=6)
            | st.sampled_from(["m", "cpu", "cuda", "colocated", "disaggregated", "nixl", "inprocess", "auto", ""]))
_values = st.recursive(_scalars, lambda children: st.lists(children, max_size=3)
                       | st.dictionaries(_keys, children, max_size=4), max_leaves=12)
_DELETE = object()


def _key_paths(tree: dict, prefix: tuple = ()) -> list[tuple]:
    """Every key's path in a nested mapping, sections included."""
    paths = []
    for key, value in tree.items():
        paths.append(prefix + (key,))
        if isinstance(value, dict):
            paths += _key_paths(value, prefix + (key,))
    return paths


_VALID = dataclasses.asdict(default_cluster_config("m"))
_PATHS = _key_paths(_VALID)
_new_key_paths = st.tuples(st.sampled_from([()] + _PATHS), _keys).map(lambda pair: pair[0] + (pair[1],))
_new_values = _EDGE_NUMBERS | _scalars | _values | st.just(_DELETE)
_mutations = st.lists(st.tuples(st.sampled_from(_PATHS) | _new_key_paths, _new_values), min_size=1, max_size=4)
"""(key path, new value or _DELETE) pairs: an existing key (a setting or a section) or a new key anywhere."""


def _mutated(mutations: list[tuple[tuple, object]]) -> dict:
    """A valid document with a few keys replaced, added or deleted (a non-mapping on the way is replaced)."""
    document = copy.deepcopy(_VALID)
    for (*sections, leaf), value in mutations:
        node = document
        for section in sections:
            node[section] = node[section] if isinstance(node.get(section), dict) else {}
            node = node[section]
        if value is _DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return document


@settings(max_examples=400, deadline=None)
@given(_mutations.map(_mutated))
def test_junk_documents_only_raise_cluster_config_errors(document):
    try:
        config = parse_cluster_config(yaml.safe_dump(document))
    except ClusterConfigError:
        return
    assert parse_cluster_config(dump_cluster_config(config)) == config


@settings(max_examples=400, deadline=None)
@given(_mutations)
def test_junk_overrides_only_raise_cluster_config_errors(mutations):
    overrides = {".".join(map(str, path)): value for path, value in mutations if value is not _DELETE}
    try:
        config = apply_overrides(default_cluster_config("m"), overrides)
    except ClusterConfigError:
        return
    assert apply_overrides(config, overrides) == config


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_junk_text_only_raises_cluster_config_errors(text):
    try:
        parse_cluster_config(text)
    except ClusterConfigError:
        pass
