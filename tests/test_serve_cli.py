"""`splitserve serve`: vLLM's flags parsed into the cluster config, and every mistake the config
and its files show reported as one line, exit status 2, before anything expensive: the launch
(Ray, the workers, the model's load) is never reached and Ray and torch are never imported."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.factories import model_without_tokenizer
from splitserve.common.config import GenerationConfig, SamplingDefaults
from splitserve.deploy.cli import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES, build_parser, human_int, main as cli_main, serve_config
from splitserve.deploy.cluster_config import DEFAULT_DECODE_ENGINE, DEFAULT_PREFILL_ENGINE
from splitserve.deploy.local import BoundPorts, root_cause, serving_banner, splitserve_command
from splitserve.router.reasoning_parsers import REASONING_PARSERS
from splitserve.router.tool_parsers import TOOL_CALL_PARSERS

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def parse(*argv: str):
    return serve_config(build_parser().parse_args(["serve", *argv]))


def test_tool_calling_flags_are_vllms():
    config = parse("/models/m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert (config.router.enable_auto_tool_choice, config.router.auto_tool_call_parser) == (True, "hermes")
    parser_only = parse("/models/m", "--tool-call-parser", "llama3_json").router
    assert (parser_only.tool_call_parser, parser_only.auto_tool_call_parser) == ("llama3_json", None)
    assert TOOL_CALL_PARSER_NAMES == tuple(TOOL_CALL_PARSERS)


def test_the_reasoning_parser_flag_is_vllms():
    assert (parse("/models/m", "--reasoning-parser", "deepseek_r1").router.reasoning_parser,
            parse("/models/m").router.reasoning_parser) == ("deepseek_r1", None)
    assert REASONING_PARSER_NAMES == tuple(REASONING_PARSERS)


def test_chat_template_content_format_sets_the_router_s():
    assert [parse("/models/m", *flag).router.chat_template_content_format
            for flag in ([], ["--chat-template-content-format", "openai"])] == ["auto", "openai"]
    with pytest.raises(SystemExit):
        parse("/models/m", "--chat-template-content-format", "parts")


def test_trust_request_chat_template_is_vllm_s_flag():
    assert [parse("/models/m", *flag).router.trust_request_chat_template
            for flag in ([], ["--trust-request-chat-template"])] == [False, True]


def test_every_vllm_flag_sets_both_pools_engines_and_the_router(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(CHAT_TEMPLATE)
    config = parse("/models/m", "--host", "0.0.0.0", "--port", "8100", "--served-model-name", "m1", "m2",
                   "--max-model-len", "4k", "--dtype", "half", "--api-key", "k", "--chat-template", str(template),
                   "--enforce-eager", "--trust-remote-code", "--max-num-seqs", "7", "--max-num-batched-tokens", "300",
                   "--no-enable-prefix-caching", "--kv-cache-memory", "64M", "--block-size", "32", "--seed", "5",
                   "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1", "--no-enable-chunked-prefill",
                   "--device", "cpu", "--scheduling-policy", "priority", "--generation-config", "vllm",
                   "--override-generation-config",
                   '{"temperature": 0.5, "top_k": 40, "max_new_tokens": 256}')
    assert (config.model, config.served_model_names) == ("/models/m", ("m1", "m2"))
    assert (config.router.host, config.router.http_port, config.router.chat_template) == ("0.0.0.0", 8100,
                                                                                        str(template))
    for engine in (config.prefill.engine, config.decode.engine):
        assert (engine.max_model_len, engine.dtype, engine.max_num_seqs, engine.max_num_batched_tokens) == (
            4000, "float16", 7, 300)
        assert (engine.enable_prefix_caching, engine.enable_chunked_prefill, engine.block_size, engine.seed) == (
            False, False, 32, 5)
        assert (engine.kv_cache_memory_bytes, engine.num_kv_blocks, engine.device) == (64 << 20, None, "cpu")
        assert engine.cuda_graphs is False  # --enforce-eager
        assert engine.scheduling_policy == "priority"
    assert config.router.api_key_env is None  # the key itself never enters the config
    assert config.router.generation_config == GenerationConfig(
        "vllm", SamplingDefaults(temperature=0.5, top_k=40, max_new_tokens=256))


@pytest.mark.parametrize("flag, kv_cache_dtype", [("auto", "auto"), ("int8", "int8"), ("fp8", "fp8_e4m3"),
                                                  ("fp8_e4m3", "fp8_e4m3")])
def test_kv_cache_dtype_sets_both_pools(flag, kv_cache_dtype):
    config = parse("default", "--kv-cache-dtype", flag)
    assert (config.prefill.engine.kv_cache_dtype, config.decode.engine.kv_cache_dtype) == (kv_cache_dtype,) * 2


def test_unset_flags_keep_each_pools_own_defaults():
    config = parse("default")
    assert (config.prefill.engine, config.decode.engine) == (DEFAULT_PREFILL_ENGINE, DEFAULT_DECODE_ENGINE)
    assert config.served_model_names == ("default",)


def test_gpu_memory_utilization_replaces_both_pools_default_kv_sizes():
    config = parse("default", "--gpu-memory-utilization", "0.45")
    for engine in (config.prefill.engine, config.decode.engine):
        assert (engine.gpu_memory_utilization, engine.kv_cache_memory_bytes, engine.num_kv_blocks) == (0.45, None, None)
    shares = parse("default", "--set", "prefill.engine.gpu_memory_utilization=0.2",
                   "--set", "decode.engine.gpu_memory_utilization=0.7")
    assert (shares.prefill.engine.gpu_memory_utilization, shares.decode.engine.gpu_memory_utilization) == (0.2, 0.7)
    one_pool = parse("default", "--set", "decode.engine.gpu_memory_utilization=0.7").prefill.engine
    assert (one_pool.gpu_memory_utilization, one_pool.kv_cache_memory_bytes) == (None, 256 << 20)


def test_an_explicit_kv_cache_size_is_kept_beside_gpu_memory_utilization_and_wins_in_the_engine():
    config = parse("default", "--gpu-memory-utilization", "0.45", "--kv-cache-memory-bytes", "1G")
    for engine in (config.prefill.engine, config.decode.engine):
        assert (engine.gpu_memory_utilization, engine.kv_cache_memory_bytes) == (0.45, 1 << 30)


def test_kv_cache_memory_and_its_vllm_alias_are_one_flag(capsys):
    assert parse("default", "--kv-cache-memory-bytes", "64M").decode.engine.kv_cache_memory_bytes == 64 << 20
    assert parse("default", "--kv-cache-memory", "1G", "--kv-cache-memory-bytes",
                 "1073741824").decode.engine.kv_cache_memory_bytes == 1 << 30
    with pytest.raises(SystemExit) as done:
        parse("default", "--kv-cache-memory", "1G", "--kv-cache-memory-bytes", "2G")
    assert done.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "splitserve serve: error: argument --kv-cache-memory/--kv-cache-memory-bytes: given twice with different "
        "values: 1073741824 and 2147483648 (see splitserve serve --help)")


def test_gpu_memory_utilization_out_of_range_fails_fast():
    assert_fails_fast(["default", "--gpu-memory-utilization", "1.5"],
                      "prefill.engine.gpu_memory_utilization: must be in (0, 1], got 1.5")


def test_speculative_config_flag_sets_the_decode_pool_only():
    from splitserve.common.config import SpeculativeConfig

    config = parse("default", "--speculative-config", '{"method": "draft", "draft_model": "default-draft", '
                                                      '"num_speculative_tokens": 3}')
    assert config.decode.engine.speculative == SpeculativeConfig(method="draft", draft_model="default-draft",
                                                                 num_speculative_tokens=3)
    assert config.prefill.engine.speculative is None


def test_speculative_config_flag_takes_vllms_keys():
    from splitserve.common.config import SpeculativeConfig

    ngram = parse("default", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, '
                                                     '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    assert ngram.decode.engine.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=5, ngram_min=2,
                                                                ngram_max=4)
    draft = parse("default", "--speculative-config", '{"model": "default-draft", "num_speculative_tokens": 3, '
                                                     '"draft_tensor_parallel_size": 1, "disable_by_batch_size": 4}')
    assert draft.decode.engine.speculative == SpeculativeConfig(method="draft", draft_model="default-draft",
                                                                num_speculative_tokens=3, disable_above_batch_size=3)


def test_speculative_config_flag_overlays_the_config_files_speculative_section(tmp_path):
    from splitserve.common.config import SpeculativeConfig

    path = tmp_path / "c.yaml"
    path.write_text("model: default\ndecode:\n  engine:\n    speculative:\n      method: ngram\n      adaptive: false\n")
    config = parse("--config", str(path), "--speculative-config", '{"num_speculative_tokens": 6, "prompt_lookup_max": 2}')
    assert config.decode.engine.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=6, ngram_min=2,
                                                                 ngram_max=2, adaptive=False)


@pytest.mark.parametrize(("value", "why"), [
    ("{method: ngram}", "not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    ('"ngram"', "must be a JSON object, got '\"ngram\"'"),
    ('{"method": "eagle3", "model": "/models/head", "num_speculative_tokens": 3}',
     "speculative.method 'eagle3' is not supported: splitserve runs ngram (prompt lookup; vLLM's ngram, ngram_gpu) "
     "and draft (a draft model; vLLM's draft_model) speculation (docs/speculative.md)"),
    ('{"method": "ngram", "prompt_lookup_max": 4, "ngram_max": 4}',
     "speculative: 'prompt_lookup_max' and 'ngram_max' set the same field (ngram_max); give one of them")])
def test_a_speculative_config_the_flag_cannot_take_is_a_usage_error_naming_why(capsys, value, why):
    with pytest.raises(SystemExit) as done:
        parse("default", "--speculative-config", value)
    assert done.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"splitserve serve: error: argument --speculative-config: {why} (see splitserve serve --help)")


def test_set_for_one_pool_wins_over_the_flag_for_both():
    config = parse("default", "--max-num-seqs", "8", "--set", "decode.engine.max_num_seqs=64")
    assert (config.prefill.engine.max_num_seqs, config.decode.engine.max_num_seqs) == (8, 64)


def test_flags_win_over_the_config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: /from/file\nrouter:\n  http_port: 9000\ndecode:\n  engine:\n    max_num_seqs: 3\n")
    config = parse("--config", str(path), "--max-num-seqs", "9")
    assert (config.model, config.router.http_port, config.decode.engine.max_num_seqs) == ("/from/file", 9000, 9)
    assert parse("/cli/model", "--config", str(path)).model == "/cli/model"


def test_model_as_positional_or_flag_and_tls_flags(tmp_path):
    assert parse("--model", "/m").model == "/m"
    with pytest.raises(ValueError, match="two models given: '/a' .positional. and --model '/b'"):
        parse("/a", "--model", "/b")
    cert, key, ca = tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "ca.pem"
    cert.write_text("x"), key.write_text("x"), ca.write_text("x")
    tls = parse("default", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)).router.tls
    assert (tls.cert_file, tls.key_file, tls.client_ca_file) == (str(cert), str(key), None)
    assert parse("default", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-ca-certs",
                 str(ca)).router.tls.client_ca_file == str(ca)


def test_api_key_reaches_the_launcher_not_the_config(monkeypatch):
    import splitserve.deploy.local as local

    launched = []
    monkeypatch.setattr(local, "serve", lambda config, api_key: launched.append((config, api_key)) or 0)
    assert cli_main(["serve", "default", "--api-key", "k3y", "--port", "0", "--grpc-port", "0",
                     "--metrics-port", "0"]) == 0
    [(config, api_key)] = launched
    assert api_key == "k3y" and config.router.api_key_env is None and "k3y" not in repr(config)


@pytest.mark.parametrize(("value", "expected"), [("2048", 2048), ("32k", 32000), ("32K", 32768), ("1G", 1 << 30),
                                                 ("1.5k", 1500)])
def test_sizes_take_vllms_suffixes(value, expected):
    assert human_int(value) == expected


def test_help_is_grouped_like_vllms(capsys):
    with pytest.raises(SystemExit) as done:
        cli_main(["serve", "--help"])
    text = capsys.readouterr().out
    assert done.value.code == 0
    for title in ("Frontend:", "ModelConfig:", "CacheConfig:", "ParallelConfig:", "SchedulerConfig:",
                  "Cluster (splitserve):"):
        assert title in text
    assert "no CUDA graphs: both pools run every step eagerly" in " ".join(text.split())


# ---- fail fast ------------------------------------------------------------------------------

_PROBE = """
import json, sys, types
# The launcher (Ray, the workers, the model's load) is the first expensive step; this stand-in
# records whether serve() reached it, and keeps Ray and torch out of a run that does.
launcher = types.ModuleType("splitserve.deploy.local")
launched = []
launcher.serve = lambda config, api_key: launched.append(config.model) or 0
sys.modules["splitserve.deploy.local"] = launcher
from splitserve.deploy.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "launched": launched, "ray": "ray" in sys.modules, "torch": "torch" in sys.modules}))
"""


def run_serve(*argv: str, cwd: Path | None = None) -> tuple[dict, list[str]]:
    """`splitserve serve ARGV` in a fresh interpreter: its outcome (exit code, the models the launcher
    was asked to serve, whether Ray or torch were imported at all) and its stderr lines."""
    done = subprocess.run([sys.executable, "-c", _PROBE, "serve", *argv], capture_output=True, text=True,
                          timeout=60, cwd=cwd)
    return json.loads(done.stdout.splitlines()[-1]), done.stderr.splitlines()


def assert_fails_fast(argv: list[str], message: str) -> None:
    """Refused before the launch: Ray was not even imported, let alone started, nor torch (no model load)."""
    outcome, lines = run_serve(*argv)
    assert lines == [f"splitserve: error: {message}"]
    assert outcome == {"code": 2, "launched": [], "ray": False, "torch": False}


def test_a_config_that_passes_the_checks_reaches_the_launch_and_only_then(tiny_llama_dir):
    """The probe's control: the same run with nothing wrong gets to the launcher, without having
    imported Ray or torch on the way (the checks themselves are cheap)."""
    outcome, _ = run_serve(str(tiny_llama_dir), "--port", "0", "--grpc-port", "0", "--metrics-port", "0")
    assert outcome == {"code": 0, "launched": [str(tiny_llama_dir)], "ray": False, "torch": False}


@pytest.fixture()
def model_copy(tiny_llama_dir, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))


def test_a_model_without_tokenizer_files_serves_with_a_tokenizer_dir(tiny_llama_dir, tmp_path):
    model = model_without_tokenizer(tiny_llama_dir, tmp_path / "model")
    outcome, _ = run_serve(str(model), "--tokenizer", str(tiny_llama_dir), "--port", "0", "--grpc-port", "0",
                           "--metrics-port", "0")
    assert outcome == {"code": 0, "launched": [str(model)], "ray": False, "torch": False}


def test_a_missing_tokenizer_dir_names_the_flag(tiny_llama_dir, tmp_path):
    missing = str(tmp_path / "nowhere")
    assert_fails_fast([str(tiny_llama_dir), "--tokenizer", missing],
                      f"--tokenizer {missing!r}: no such tokenizer directory")


def test_unsupported_architecture(model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    assert_fails_fast([str(model_copy)], f"{model_copy}: architecture 'GPT2LMHeadModel' is not supported; "
                                         "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                                         "Qwen3ForCausalLM, Phi3ForCausalLM, GraniteForCausalLM, GemmaForCausalLM, "
                                         "Gemma2ForCausalLM, Gemma3ForCausalLM, SmolLM3ForCausalLM, "
                                         "Olmo2ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, "
                                         "GptOssForCausalLM")


def test_missing_tokenizer_file_is_named(model_copy):
    (model_copy / "tokenizer.json").unlink()
    (model_copy / "tokenizer.model").write_bytes(b"")
    assert_fails_fast([str(model_copy)], f"{model_copy}: missing tokenizer.json (splitserve reads the fast "
                                         "tokenizer file only); it has tokenizer.model: save the tokenizer once "
                                         "with transformers (AutoTokenizer.from_pretrained(dir).save_pretrained("
                                         "dir)) to write tokenizer.json")


def test_not_a_model_directory(tmp_path):
    assert_fails_fast([str(tmp_path)], f"{tmp_path}: not a model directory: missing config.json")


def test_bad_chat_templates(model_copy, tmp_path):
    assert_fails_fast([str(model_copy), "--chat-template", "missing.jinja"],
                      "chat template 'missing.jinja': no such file, and not a template either (no {{ }} or {% %} "
                      "markup)")
    assert_fails_fast([str(model_copy), "--chat-template", "{% for m in messages %}"],
                      "the chat template given does not compile: Unexpected end of template. Jinja was looking "
                      "for the following tags: 'endfor' or 'else'. The innermost block that needs to be closed "
                      "is 'for'. (line 1)")
    (model_copy / "chat_template.jinja").write_text("{{ unclosed")
    assert_fails_fast([str(model_copy)], f"{model_copy}: the chat template does not compile: unexpected end of "
                                         "template, expected 'end of print statement'. (line 1)")


def test_bad_sampling_defaults_in_generation_config_json_are_named(model_copy):
    """A value SamplingParams refuses stops the start (vLLM starts, then fails each request that
    leaves the field unset); `--generation-config vllm` ignores the file, and an override replaces the value."""
    path = model_copy / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "temperature": -1, "top_p": 0.8}))
    assert_fails_fast([str(model_copy)], f"{path}: temperature must be a finite number >= 0, got -1 (fix the file, "
                                         "override the field with --override-generation-config, or ignore the file "
                                         "with --generation-config vllm)")
    assert_fails_fast([str(model_copy), "--generation-config", str(model_copy / "missing")],
                      f"generation config folder '{model_copy / 'missing'}' (--generation-config) is not a directory "
                      "(auto and vllm are the other values)")
    for fix in (["--generation-config", "vllm"], ["--override-generation-config", '{"temperature": 0.7}']):
        outcome, _ = run_serve(str(model_copy), *fix, "--port", "0", "--grpc-port", "0", "--metrics-port", "0")
        assert outcome["code"] == 0 and outcome["launched"] == [str(model_copy)]


def test_bad_dtype_and_parallelism_are_usage_errors():
    for argv, message in ((["--dtype", "float8"], "argument --dtype: invalid choice: 'float8' (choose from 'auto', "
                                                  "'half', 'float16', 'bfloat16', 'float', 'float32')"),
                          (["-tp", "2"], "argument --tensor-parallel-size/-tp: only 1 is supported, got '2': each "
                                         "splitserve worker runs on one device; scale out with --prefill-workers / "
                                         "--decode-workers instead")):
        done = subprocess.run([sys.executable, "-m", "splitserve.deploy.cli", "serve", "default", *argv],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2
        assert done.stderr.splitlines() == [f"splitserve serve: error: {message} (see splitserve serve --help)"]


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_packed_quantization_of_a_float_checkpoint_is_named_before_the_workers_load_it(method):
    assert_fails_fast(["default", "--quantization", method],
                      f"prefill.engine.quantization (--quantization): quantization={method!r} needs a "
                      f"{method.upper()} checkpoint (a quantization_config in config.json); make one with "
                      f"`splitserve quantize MODEL_DIR OUT_DIR --method {method}`")


def test_an_unknown_flag_points_at_the_subcommand_s_help(capsys):
    with pytest.raises(SystemExit) as done:
        cli_main(["serve", "default", "--swap-space", "4"])
    assert done.value.code == 2
    assert capsys.readouterr().err == ("splitserve serve: error: unrecognized arguments: --swap-space 4 (see "
                                       "splitserve serve --help)\n")


def test_ports_in_use_are_named():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for flag, key in (("--port", "http_port"), ("--grpc-port", "grpc_port"), ("--metrics-port", "metrics_port")):
            ports = {"--port": "0", "--grpc-port": "0", "--metrics-port": "0", flag: str(port)}
            assert_fails_fast(["default", *(item for pair in ports.items() for item in pair)],
                              f"router.{key} ({flag}): cannot listen on 127.0.0.1:{port}: Address already in use")


def test_a_max_model_len_longer_than_the_models_positions_is_named(tiny_llama_dir):
    """Before, the workers refused it, once Ray had started and the model had loaded (exit 1)."""
    positions = json.loads((tiny_llama_dir / "config.json").read_text())["max_position_embeddings"]
    assert_fails_fast([str(tiny_llama_dir), "--max-model-len", str(positions + 1)],
                      f"prefill.engine.max_model_len (--max-model-len): {positions + 1} exceeds the model's "
                      f"max_position_embeddings {positions} ({tiny_llama_dir / 'config.json'})")
    assert_fails_fast([str(tiny_llama_dir), "--mode", "colocated", "--set",
                       f"decode.engine.max_model_len={positions + 1}"],
                      f"decode.engine.max_model_len (--max-model-len): {positions + 1} exceeds the model's "
                      f"max_position_embeddings {positions} ({tiny_llama_dir / 'config.json'})")
    outcome, _ = run_serve(str(tiny_llama_dir), "--max-model-len", str(positions), "--port", "0", "--grpc-port", "0",
                           "--metrics-port", "0")
    assert outcome["code"] == 0 and outcome["launched"] == [str(tiny_llama_dir)]


def test_a_host_that_is_not_this_machines_is_named_even_with_every_port_picked():
    """192.0.2.1 is a documentation address (RFC 5737), never a local one. Before, the first fixed
    port took the blame (`router.grpc_port (--grpc-port): cannot listen on ...`), and with every
    port 0 nothing was checked: the servers failed to bind after Ray and the workers had started."""
    assert_fails_fast(["default", "--host", "192.0.2.1", "--port", "0", "--grpc-port", "0", "--metrics-port", "0"],
                      "router.host (--host): cannot listen on 192.0.2.1: Cannot assign requested address")


def test_tls_files_missing_or_not_pem(tmp_path):
    assert_fails_fast(["default", "--ssl-certfile", str(tmp_path / "no.pem"), "--ssl-keyfile", str(tmp_path)],
                      f"router.tls.cert_file: must name an existing file, got '{tmp_path / 'no.pem'}'")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    outcome, lines = run_serve("default", "--ssl-certfile", str(junk), "--ssl-keyfile", str(junk))
    assert outcome == {"code": 2, "launched": [], "ray": False, "torch": False}
    assert len(lines) == 1 and lines[0].startswith(
        f"splitserve: error: TLS: cert_file '{junk}' and key_file '{junk}' are not a PEM certificate chain")


def test_bad_config_files(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: default\nrouter: [\n")
    outcome, lines = run_serve("--config", str(broken))
    assert outcome == {"code": 2, "launched": [], "ray": False, "torch": False} and len(lines) == 1
    assert lines[0].startswith("splitserve: error: (top level): invalid YAML: while parsing a flow node")
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("model: default\ndecode:\n  engine:\n    max_num_seqs: 0\n")
    assert_fails_fast(["--config", str(wrong)], "decode.engine.max_num_seqs: must be >= 1, got 0")
    assert_fails_fast(["--config", str(tmp_path / "none.yaml")],
                      f"--config '{tmp_path / 'none.yaml'}': no such file, and not a packaged config (packaged: "
                      "local)")


@pytest.mark.parametrize("key", ["", "\t"])
def test_an_empty_api_key_is_refused(key):
    """`--api-key "$KEY"` with KEY unset: before, the server started without auth (an empty key
    turns the check off) while its banner asked for the key."""
    done = subprocess.run([sys.executable, "-c", _PROBE, "serve", "default", "--api-key", key], capture_output=True,
                          text=True, timeout=60)  # the launcher stubbed out: before, the probe reached it
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"splitserve serve: error: argument --api-key: must not be empty, got {key!r}: an empty key would leave the "
        "server open (leave --api-key out to serve without a key) (see splitserve serve --help)"]


def test_api_key_variable_unset(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_TEST_NO_SUCH_KEY", raising=False)
    assert_fails_fast(["default", "--set", "router.api_key_env=SPLITSERVE_TEST_NO_SUCH_KEY"],
                      "API key auth is configured with api_key_env='SPLITSERVE_TEST_NO_SUCH_KEY', but the "
                      "environment variable SPLITSERVE_TEST_NO_SUCH_KEY is not set")


@pytest.mark.slow
def test_a_worker_that_fails_to_load_is_reported_once(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"not safetensors")  # passes every file check
    done = subprocess.run([sys.executable, "-m", "splitserve.deploy.cli", "serve", str(model_copy), "--port", "0",
                           "--grpc-port", "0", "--metrics-port", "0"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    ours = [line for line in done.stderr.splitlines() if "splitserve" in line and "error" in line.lower()]
    assert len(ours) == 1 and ours[0].startswith("splitserve: error: worker ")
    assert ours[0].endswith("failed to start: SafetensorError: Error while deserializing header: header too large")
    assert "shutdown failed" not in done.stderr and "Traceback" not in done.stderr
    assert "creation task" not in done.stderr  # Ray printed no copy of its own


# ---- once it serves -------------------------------------------------------------------------

def test_banner_commands_work_as_printed():
    config = parse("default", "--served-model-name", "tiny")
    banner = serving_banner(config, BoundPorts(50051, 8000, 9400), ".venv/bin/splitserve", needs_key=False)
    assert banner.splitlines() == [
        "splitserve: serving default as 'tiny' (disaggregated) on 127.0.0.1:50051 (gRPC)",
        "  OpenAI API: http://127.0.0.1:8000/v1",
        "  try: curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d "
        "'{\"model\": \"tiny\", \"prompt\": \"Tell me about the river.\", \"max_tokens\": 32}'",
        "  metrics: http://127.0.0.1:9400/metrics",
        "  or: .venv/bin/splitserve generate --target 127.0.0.1:50051 \"Tell me about the river.\"",
        "  Ctrl-C stops the cluster."]
    keyed = serving_banner(config, BoundPorts(1, None, None), "splitserve", needs_key=True)
    assert "--api-key-env VARIABLE_HOLDING_THE_KEY" in keyed and "curl" not in keyed


def test_a_pooling_servers_banner_embeds_and_has_no_generate_line():
    """Its completions answer 404 and its gRPC Generate API refuses every request: neither may be suggested."""
    config = parse("default", "--served-model-name", "tiny", "--runner", "pooling")
    banner = serving_banner(config, BoundPorts(50051, 8000, 9400), ".venv/bin/splitserve", needs_key=False)
    assert banner.splitlines() == [
        "splitserve: serving default as 'tiny' (disaggregated) on 127.0.0.1:50051 (gRPC)",
        "  OpenAI API: http://127.0.0.1:8000/v1",
        "  try: curl http://127.0.0.1:8000/v1/embeddings -H 'Content-Type: application/json' -d "
        "'{\"model\": \"tiny\", \"input\": \"Tell me about the river.\"}'",
        "  metrics: http://127.0.0.1:9400/metrics",
        "  Ctrl-C stops the cluster."]


def test_banner_brackets_an_ipv6_host():
    banner = serving_banner(parse("default", "--host", "::1"), BoundPorts(50051, 8000, 9400), "splitserve", False)
    lines = banner.splitlines()
    assert [lines[0], lines[1], lines[3]] == ["splitserve: serving default as 'default' (disaggregated) on "
                                              "[::1]:50051 (gRPC)", "  OpenAI API: http://[::1]:8000/v1",
                                              "  metrics: http://[::1]:9400/metrics"]
    assert lines[2].startswith("  try: curl http://[::1]:8000/v1/completions ")
    assert lines[4] == "  or: splitserve generate --target [::1]:50051 \"Tell me about the river.\""


def test_splitserve_command_is_runnable_from_the_same_shell():
    assert splitserve_command(".venv/bin/splitserve", "/usr/bin/python3") == ".venv/bin/splitserve"
    assert splitserve_command("/x/cli.py", "/v/bin/python") == "/v/bin/python -m splitserve.deploy.cli"


def test_root_cause_is_the_last_line_of_a_remote_traceback():
    remote = RuntimeError(textwrap.dedent("""\
        worker decode-0 was lost: ActorDiedError: The actor died because of an error raised in its creation task
          File "/w/engine/model_loader.py", line 46, in parse_arch
            raise UnsupportedModelError(...)
        splitserve.common.errors.UnsupportedModelError: hidden_act 'gelu' is not supported (only silu / swish)"""))
    assert root_cause(remote) == "UnsupportedModelError: hidden_act 'gelu' is not supported (only silu / swish)"
    assert root_cause(ValueError("plain")) == "ValueError: plain"


def test_make_run_prints_a_runnable_hint():
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    assert "$(VENV)/bin/splitserve serve" in makefile  # so the banner's generate line reads .venv/bin/splitserve


def test_exit_code_convention(capsys):
    assert cli_main(["serve", "default", "--set", "nonsense"]) == 2
    assert capsys.readouterr().err == "splitserve: error: --set 'nonsense': expected KEY=VALUE\n"
