"""The `splitserve` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from splitserve.common.chat_template import CONTENT_FORMAT_OPTIONS
from splitserve.common.config import (QUANTIZATION_GROUP_SIZES, QUANTIZATION_METHODS, SCHEDULING_POLICIES,
                                      VLLM_DTYPE_ALIASES, VLLM_KV_CACHE_DTYPE_ALIASES, speculative_settings)
from splitserve.common.errors import InvalidRequestError, StartupError, UnsupportedModelError
from splitserve.common.pooling import RUNNERS, PoolerConfig
from splitserve.router.http_options import UVICORN_LOG_LEVELS


def _add_make_tiny_model(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("make-tiny-model", help="build a tiny Hugging Face-format model directory")
    parser.add_argument("dir", type=Path, help="output directory: created, or replaced when it is empty or a model "
                                                "directory (anything else is refused)")
    parser.add_argument("--arch", choices=("llama", "qwen2"), default="llama")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default: derived from hidden)")
    parser.add_argument("--max-position", type=int, default=2048)
    parser.add_argument("--tie-embeddings", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(handler=_make_tiny_model)


TOOL_CALL_PARSER_NAMES = ("hermes", "llama3_json", "openai")
"""router.tool_parsers.TOOL_CALL_PARSERS' names, spelled out so building the parser does not import the
grammar engine (a test checks they agree)."""
REASONING_PARSER_NAMES = ("deepseek_r1", "qwen3", "openai_gptoss")
"""router.reasoning_parsers.REASONING_PARSERS' names, spelled out likewise (a test checks they agree)."""
TRAINING_PRESETS = ("draft", "main")
"""tiny_training.PRESETS' names, spelled out so building the parser does not import torch (a test checks)."""


def _add_train_tiny_model(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("train-tiny-model",
                                 help="train a small Llama on this interpreter's standard library (docs/models.md)")
    parser.add_argument("dir", type=Path, help="output model directory: created, or replaced when it is empty or a "
                                                "model directory (anything else is refused before training)")
    parser.add_argument("--preset", choices=TRAINING_PRESETS, default="main",
                        help="shape and schedule of a shipped model (the flags below override it)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps (a preset's warmup longer than that shrinks to steps / 10)")
    parser.add_argument("--batch-size", type=int, default=None, help="windows per step")
    parser.add_argument("--context-len", type=int, default=None, help="tokens per window")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (recorded)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stdlib", type=Path, default=None,
                        help="train on the *.py files under this folder instead of the running stdlib")
    parser.set_defaults(handler=_train_tiny_model)


def _training_config(args: argparse.Namespace):
    """The preset with the given flags replaced."""
    import dataclasses

    from splitserve.engine.tiny_training import PRESETS

    preset = PRESETS[args.preset]
    flags = {"steps": args.steps, "batch_size": args.batch_size, "context_len": args.context_len,
             "peak_lr": args.lr, "threads": args.threads}
    fields = {name: value for name, value in flags.items() if value is not None}
    if args.seed is not None:
        fields["model"] = dataclasses.replace(preset.model, seed=args.seed)
    if fields.get("steps", preset.steps) <= preset.warmup_steps:
        fields["warmup_steps"] = fields["steps"] // 10
    return dataclasses.replace(preset, **fields)


def _train_tiny_model(args: argparse.Namespace) -> int:
    from splitserve.engine.stdlib_corpus import CorpusSplit, stdlib_root
    from splitserve.engine.tiny_training import RECORD_FILE, train

    config = _training_config(args)
    split = CorpusSplit.of(args.stdlib or stdlib_root(), config.heldout_every)
    print(f"training on {len(split.train)} files, holding out {len(split.heldout)} (under {split.root})")
    record = train(config, split, args.dir, show_progress=True)
    print(f"wrote {args.dir} ({record.num_parameters / 1e6:.2f}M parameters, {record.tokens_seen} tokens seen, "
          f"{record.wall_time_s:.0f} s): train loss {record.final_train_loss:.3f}, held-out loss "
          f"{record.heldout_loss:.3f} (perplexity {record.heldout_perplexity:.2f}); record in {RECORD_FILE}")
    return 0


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-k", type=int, default=-1)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (offline generation only)")
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    group.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    group.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    group.add_argument("--num-kv-blocks", type=int, default=None)
    group.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                       help="on CUDA, the device's share the engine may hold; the KV cache gets what the weights "
                            "and a profiling step leave of it (no effect on CPU; the two flags above win over it)")
    group.add_argument("--quantization", "-q", default="auto", choices=QUANTIZATION_METHODS,
                       help="weight-only quantization (docs/quantization.md)")
    group.add_argument("--tokenizer", default=None, metavar="DIR",
                       help="the tokenizer directory when it is not the model's (as serve's --tokenizer; "
                            "vLLM's); EOS ids still come from the model's generation_config.json")


def _add_quantize(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("quantize", help="write a GPTQ or AWQ checkpoint of a model directory "
                                                  "(docs/quantization.md)")
    parser.add_argument("model", help="float model directory, or an embedded model's name (default, ...)")
    parser.add_argument("out", type=Path, help="output model directory (created; files replaced)")
    parser.add_argument("--method", choices=("gptq", "awq"), required=True)
    parser.add_argument("--bits", type=int, choices=(4,), default=4, help="bits per weight (4)")
    parser.add_argument("--group-size", type=int, choices=QUANTIZATION_GROUP_SIZES, default=128)
    parser.add_argument("--act-order", action="store_true", help="GPTQ: desc_act (columns by Hessian diagonal)")
    parser.add_argument("--num-samples", type=int, default=32, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    parser.add_argument("--damp-percent", type=float, default=0.01, help="GPTQ: Hessian damping")
    parser.add_argument("--calibration-dir", type=Path, default=None,
                        help="*.py / *.txt files to calibrate on (default: the trained model's training split)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(handler=_quantize)


def _quantize(args: argparse.Namespace) -> int:
    from splitserve.engine.quantization.quantize import QuantizeConfig, quantize_model
    from splitserve.engine.tiny_model import resolve_model_path

    config = QuantizeConfig(args.method, args.group_size, args.act_order, args.num_samples, args.seq_len,
                            args.damp_percent, args.seed)
    out = quantize_model(resolve_model_path(args.model), args.out, config, args.calibration_dir,
                         show_progress=sys.stderr.isatty())
    print(f"wrote {out} ({args.method}, {args.bits} bits, group size {args.group_size})")
    return 0


def _host_port(value: str) -> str:
    """argparse type for HOST:PORT (IPv6 hosts in brackets: [::1]:50051)."""
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return value


def _add_generate(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("generate", help="generate text, streamed to the terminal (offline or from a server)")
    parser.add_argument("prompt")
    parser.add_argument("--target", type=_host_port, default=None, metavar="HOST:PORT",
                        help="stream from a running `splitserve serve` over gRPC instead of running a model here")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="with --target: deadline for the whole request (default: none)")
    parser.add_argument("--api-key-env", default=None, metavar="NAME",
                        help="with --target: send the API key held by environment variable NAME "
                             "(for a server with router.api_key_env set)")
    parser.add_argument("--tls-ca", default=None, metavar="FILE",
                        help="with --target: connect over TLS, trusting the router's certificate if FILE's CA "
                             "signed it (PEM)")
    parser.add_argument("--tls-cert", default=None, metavar="FILE",
                        help="with --target: connect over TLS and present this client certificate (PEM; for a "
                             "router with router.tls.client_ca_file set); needs --tls-key")
    parser.add_argument("--tls-key", default=None, metavar="FILE", help="the private key of --tls-cert (PEM)")
    parser.add_argument("--model", default=None,
                        help="model directory, or 'default' for the embedded model (the default); with --target, "
                             "the served model's name (default: the one it serves)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--cache-salt", default=None, metavar="SALT",
                        help="with --target: salt the prompt's prefix-cache blocks (vLLM's cache_salt): it reuses "
                             "cached blocks only of requests with the same salt")
    parser.add_argument("--priority", type=int, default=0,
                        help="with --target: the request's priority (vLLM's) on a server started with "
                             "--scheduling-policy priority, lower first (any other server takes only 0)")
    _add_sampling_flags(parser)
    _add_engine_flags(parser)
    parser.set_defaults(handler=_generate)


def _make_tiny_model(args: argparse.Namespace) -> int:
    from splitserve.engine.tiny_model import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(arch=args.arch, num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                         num_kv_heads=args.kv_heads, vocab_size=args.vocab, intermediate_size=args.intermediate,
                         max_position_embeddings=args.max_position, tie_word_embeddings=args.tie_embeddings,
                         seed=args.seed)
    path = build_tiny_model(args.dir, spec)
    print(f"wrote {spec.arch} model to {path}")
    return 0


def _sampling_params(args: argparse.Namespace):
    from splitserve.common.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                          presence_penalty=args.presence_penalty, seed=args.seed, stop=tuple(args.stop),
                          max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)


def _generate(args: argparse.Namespace) -> int:
    return _generate_remote(args) if args.target is not None else _generate_offline(args)


def _generate_offline(args: argparse.Namespace) -> int:
    from splitserve.engine import LLM
    from splitserve.engine.tiny_model import DEFAULT_MODEL_NAME, resolve_model_path

    from splitserve.common.model_dir import check_tokenizer_files

    params = _sampling_params(args)
    model_dir = resolve_model_path(args.model or DEFAULT_MODEL_NAME)
    if args.tokenizer is None:  # LLM checks a --tokenizer directory itself, naming the flag
        check_tokenizer_files(model_dir)  # names the missing file, where transformers would ask for sentencepiece
    llm = LLM(model_dir, tokenizer=args.tokenizer, show_progress=sys.stderr.isatty(), block_size=args.block_size,
              max_model_len=args.max_model_len, dtype=args.dtype, device=args.device,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, num_kv_blocks=args.num_kv_blocks,
              gpu_memory_utilization=args.gpu_memory_utilization, quantization=args.quantization)
    prompt = args.prompt
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        prompt = list(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))
    final = None
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta.text_delta)
        sys.stdout.flush()
        final = delta if delta.finished else final
    sys.stdout.write("\n")
    if final is not None:
        print(f"[finish_reason={final.finish_reason}]", file=sys.stderr)
    return 0


def _remote_request(args: argparse.Namespace):
    from splitserve.deploy.client import build_generate_request

    params = _sampling_params(args)  # validated here: a bad flag exits 2 before anything is sent
    if args.chat:
        return build_generate_request(messages=[{"role": "user", "content": args.prompt}], params=params,
                                      model=args.model or "", cache_salt=args.cache_salt, priority=args.priority)
    return build_generate_request(text=args.prompt, params=params, model=args.model or "", cache_salt=args.cache_salt,
                                  priority=args.priority)


def _summary(final) -> str:
    """The last response's finish reason, usage and server-side timing, as one line."""
    usage, timing = final.usage, final.timing
    return (f"[finish_reason={final.finish_reason} prompt_tokens={usage.prompt_tokens} "
            f"cached_tokens={usage.cached_tokens} completion_tokens={usage.completion_tokens} "
            f"ttft={timing.first_token_s * 1e3:.1f}ms total={timing.total_s * 1e3:.1f}ms]")


def _client_tls(args: argparse.Namespace):
    """TLS when any --tls-* flag is given (without --tls-ca, the system's roots are trusted)."""
    from splitserve.deploy.client import ClientTls

    if args.tls_ca is None and args.tls_cert is None and args.tls_key is None:
        return None
    return ClientTls(args.tls_ca, args.tls_cert, args.tls_key)


def _generate_remote(args: argparse.Namespace) -> int:
    """Stream text to stdout; a gRPC error prints `splitserve: error: CODE: details` and exits 1."""
    import grpc

    from splitserve.deploy.client import GenerationClient

    api_key = None
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env, "").strip()
        if not api_key:
            print(f"splitserve: error: --api-key-env {args.api_key_env}: the environment variable is "
                  f"{'empty' if args.api_key_env in os.environ else 'not set'}", file=sys.stderr)
            return 2
    request = _remote_request(args)
    final = None
    with GenerationClient(args.target, timeout_s=args.timeout, api_key=api_key, tls=_client_tls(args)) as client:
        try:
            for response in client.stream(request):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                final = response if response.finish_reason else final
        except grpc.RpcError as error:
            print(f"splitserve: error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    if final is None:
        print("splitserve: error: the stream ended without a finish reason", file=sys.stderr)
        return 1
    print(_summary(final), file=sys.stderr)
    return 0


VLLM_DTYPES = {name: VLLM_DTYPE_ALIASES.get(name, name)
               for name in ("auto", "half", "float16", "bfloat16", "float", "float32")}
"""vLLM's --dtype spellings -> the engine's dtype names."""
VLLM_KV_CACHE_DTYPES = {name: VLLM_KV_CACHE_DTYPE_ALIASES.get(name, name)
                        for name in ("auto", "fp8", "fp8_e4m3", "int8")}
"""--kv-cache-dtype spellings -> the engine's kv_cache_dtype (vLLM's fp8 is e4m3; int8 is splitserve's own)."""
_SIZE_SUFFIXES = {"k": 1000, "m": 1000**2, "g": 1000**3, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def human_int(value: str) -> int:
    """argparse type: an integer, optionally with vLLM's size suffix (k/m/g: powers of 1000,
    K/M/G: powers of 1024), e.g. 32k = 32000, 1G = 1073741824."""
    digits, suffix = (value[:-1], value[-1]) if value[-1:] in _SIZE_SUFFIXES else (value, "")
    try:
        number = float(digits) if suffix else int(digits)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer (optionally with k/m/g or K/M/G), got {value!r}")
    return int(number * _SIZE_SUFFIXES[suffix]) if suffix else int(number)


def api_key(value: str) -> str:
    """argparse type of --api-key: a key with a character other than whitespace. An empty key (a
    shell variable that was not set: `--api-key "$KEY"`) would start the server open by accident,
    as api_key_from_env refuses for router.api_key_env."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"must not be empty, got {value!r}: an empty key would leave the server "
                                         "open (leave --api-key out to serve without a key)")
    return value


def _json_object(value: str) -> dict[str, object]:
    """argparse type: a JSON object."""
    try:
        data = json.loads(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return data


def _speculative_json(value: str) -> dict[str, object]:
    """argparse type: a speculative config JSON object in our keys or vLLM's, as decode.engine.speculative's
    settings in our keys (common/config.py speculative_settings)."""
    try:
        return speculative_settings(_json_object(value))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _pooler_json(value: str) -> dict[str, object]:
    """argparse type: vLLM's --pooler-config JSON object (PoolerConfig's keys), checked here."""
    data = _json_object(value)
    try:
        PoolerConfig(**data)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(f"{error} (keys: pooling_type, use_activation)") from None
    return data


def _only_one(flag: str) -> Callable[[str], int]:
    """argparse type of a parallelism flag splitserve accepts only as 1 (one device per worker)."""
    def parse(value: str) -> int:
        if value != "1":
            raise argparse.ArgumentTypeError(
                f"only 1 is supported, got {value!r}: each splitserve worker runs on one device; scale out "
                "with --prefill-workers / --decode-workers instead")
        return 1
    parse.__name__ = flag
    return parse


class _OneValue(argparse.Action):
    """Stores the flag's value; a flag given again (or under its alias) with another value is a usage error, not
    silently the last one (--kv-cache-memory 1G --kv-cache-memory-bytes 2G)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        given = getattr(namespace, self.dest)
        if given is not None and given != values:
            raise argparse.ArgumentError(self, f"given twice with different values: {given} and {values}")
        setattr(namespace, self.dest, values)


def _add_serve(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve", help="serve a model over gRPC and the OpenAI HTTP API on a local Ray cluster (Ctrl-C stops it)",
        description="Serve MODEL (a Hugging Face model directory, or 'default' for the embedded model) the way "
                    "`vllm serve` does: the same flag names and meanings wherever splitserve has a counterpart. "
                    "Engine flags apply to both pools; --set prefill.engine.KEY=... / decode.engine.KEY=... sets "
                    "one pool's value and wins over them. Precedence: the --config file, then these flags, then "
                    "--set.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="model directory or 'default' (the config's model when left out)")
    _add_frontend_flags(parser.add_argument_group("Frontend", "the router's listeners and the OpenAI API"))
    _add_model_flags(parser.add_argument_group("ModelConfig"))
    _add_cache_flags(parser.add_argument_group("CacheConfig", "the paged KV cache of every worker"))
    _add_parallel_flags(parser.add_argument_group("ParallelConfig"))
    _add_scheduler_flags(parser.add_argument_group("SchedulerConfig", "each worker's batch"))
    _add_cluster_flags(parser.add_argument_group("Cluster (splitserve)", "the pools, Ray and the config file"))
    _add_http_flags(parser.add_argument_group("HTTP server", "how the OpenAI HTTP API is served (vLLM's "
                                                             "frontend flags)"))
    _add_unsupported_flags(parser.add_argument_group("Not supported", "vLLM flags splitserve refuses, saying why"))
    parser.set_defaults(handler=_serve)


def _add_frontend_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--host", default=None,
                       help="address the HTTP, gRPC and /metrics servers bind (default 127.0.0.1: unlike vLLM, "
                            "splitserve stays on loopback until told 0.0.0.0)")
    group.add_argument("--port", "--http-port", dest="port", type=int, default=None,
                       help="OpenAI-compatible HTTP API port (default 8000; 0 picks a free port)")
    group.add_argument("--grpc-port", type=int, default=None, help="gRPC API port (default 50051; 0 picks one)")
    group.add_argument("--metrics-port", type=int, default=None,
                       help="Prometheus /metrics port (default 9400; 0 picks one); /metrics is also on --port")
    group.add_argument("--api-key", type=api_key, default=None,
                       help="require `Authorization: Bearer KEY` on /v1/* and on the gRPC API (the key stays in "
                            "this process; router.api_key_env names a variable instead)")
    group.add_argument("--chat-template", default=None,
                       help="chat template replacing the model's: a file's path, or the template itself")
    group.add_argument("--chat-template-content-format", choices=CONTENT_FORMAT_OPTIONS, default=None,
                       help="message content as the template sees it: string (text parts joined with newlines), "
                            "openai (a list of text parts), or auto (default: openai when the template loops "
                            "over a message's content)")
    group.add_argument("--trust-request-chat-template", action="store_true", default=None,
                       help="render the chat_template a chat or /tokenize request brings (else refused with 400)")
    group.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                       help="serve tool_choice \"auto\" (the default when a chat sends tools); needs "
                            "--tool-call-parser")
    group.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSER_NAMES, default=None,
                       help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>: Hermes, Qwen) "
                            "llama3_json (Llama 3.1+) or openai (GPT-OSS's harmony calls)")
    group.add_argument("--reasoning-parser", choices=REASONING_PARSER_NAMES, default=None,
                       help="split chat outputs' <think>...</think> block into a separate `reasoning` field: "
                            "deepseek_r1 or qwen3; openai_gptoss: GPT-OSS's harmony analysis channel")
    group.add_argument("--ssl-certfile", default=None, help="PEM certificate chain: serve HTTPS and gRPC over TLS")
    group.add_argument("--ssl-keyfile", default=None, help="PEM private key of --ssl-certfile")
    group.add_argument("--ssl-ca-certs", default=None,
                       help="PEM CA certificates; clients must present a certificate they signed (mutual TLS)")


def _json_strings(value: str) -> list[str]:
    """argparse type of vLLM's list flags (--allowed-origins ...): a JSON list of strings, as vLLM parses
    them, e.g. '["https://chat.example"]'."""
    try:
        data = json.loads(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON: {error}") from None
    if not isinstance(data, list) or not all(isinstance(item, str) for item in data):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, e.g. '[\"*\"]', got {value!r}")
    return data


def _add_http_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--allowed-origins", type=_json_strings, default=None, metavar="JSON",
                       help="origins whose web pages may call the HTTP API from a browser (CORS), e.g. "
                            "'[\"https://chat.example\"]', '[\"*\"]' for any (default [] as vLLM: none)")
    group.add_argument("--allowed-methods", type=_json_strings, default=None, metavar="JSON",
                       help="HTTP methods a CORS preflight allows (default '[\"*\"]')")
    group.add_argument("--allowed-headers", type=_json_strings, default=None, metavar="JSON",
                       help="request headers a CORS preflight allows (default '[\"*\"]')")
    group.add_argument("--allow-credentials", action="store_true", default=None,
                       help="let browsers send cookies / HTTP auth on cross-origin calls")
    group.add_argument("--enable-request-id-headers", action="store_true", default=None,
                       help="every HTTP answer carries X-Request-Id: the request's own, else a fresh uuid4 hex")
    group.add_argument("--root-path", default=None, metavar="PREFIX",
                       help="the path prefix a proxy in front serves the API under and strips, e.g. /llm")
    group.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default=None,
                       help="level of the HTTP server's (uvicorn's) log lines (default info)")
    group.add_argument("--response-role", default=None, metavar="ROLE",
                       help="the role of a chat completion's message when add_generation_prompt is true "
                            "(default assistant)")
    group.add_argument("--return-tokens-as-token-ids", action="store_true", default=None,
                       help="logprob tokens read token_id:<id> unless a request says otherwise")
    group.add_argument("--enable-prompt-tokens-details", action="store_true", default=None,
                       help="completion and chat usage reports prompt_tokens_details.cached_tokens")
    group.add_argument("--enable-log-requests", dest="log_requests", action=argparse.BooleanOptionalAction,
                       default=None, help="the access log: one line per request when it ends, on logger "
                                          "splitserve.access (default: on)")
    group.add_argument("--disable-log-requests", dest="log_requests", action="store_false", default=None,
                       help="no access log (older vLLM's spelling of --no-enable-log-requests)")
    group.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="accepted for vLLM compatibility; nothing to disable: uvicorn writes no access log here "
                            "(router.access_log is splitserve's, one line per request)")
    group.add_argument("--disable-fastapi-docs", action="store_true",
                       help="accepted for vLLM compatibility; nothing to disable: splitserve serves no /docs, /redoc "
                            "or /openapi.json")
    group.add_argument("--disable-log-stats", action="store_true",
                       help="accepted for vLLM compatibility; nothing to disable: splitserve logs no periodic engine "
                            "statistics (they are on /metrics)")


_HTTP_FLAGS = {"allowed_origins": "router.cors_allowed_origins", "allowed_methods": "router.cors_allowed_methods",
               "allowed_headers": "router.cors_allowed_headers", "allow_credentials": "router.cors_allow_credentials",
               "enable_request_id_headers": "router.enable_request_id_headers", "root_path": "router.root_path",
               "uvicorn_log_level": "router.uvicorn_log_level", "log_requests": "router.access_log",
               "response_role": "router.response_role",
               "return_tokens_as_token_ids": "router.return_tokens_as_token_ids",
               "enable_prompt_tokens_details": "router.enable_prompt_tokens_details"}
"""HTTP server flags -> the cluster config key they set."""


def _add_model_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--model", default=None, help="the model, when not given as the positional MODEL")
    group.add_argument("--tokenizer", default=None, metavar="DIR",
                       help="the tokenizer directory when it is not the model's (tokenizer.json, "
                            "tokenizer_config.json, the chat template); EOS ids still come from the model's "
                            "generation_config.json")
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="names clients may use for the model; the first is what /v1/models reports "
                            "(default: MODEL as given)")
    group.add_argument("--dtype", choices=tuple(VLLM_DTYPES), default=None,
                       help="weights, activations and KV cache dtype; auto takes the model's (float16 is widened "
                            "to float32 on CPU); half = float16, float = float32")
    group.add_argument("--quantization", "-q", choices=QUANTIZATION_METHODS, default=None,
                       help="weight-only quantization of both pools: int8 / int4 quantize a float checkpoint at "
                            "load, gptq / awq load such a checkpoint, auto (default) follows the checkpoint's "
                            "quantization_config (docs/quantization.md); per pool: --set decode.engine.quantization=int4")
    group.add_argument("--runner", choices=RUNNERS, default=None,
                       help="generate (default): the model generates; pooling: it pools prompts and the HTTP API "
                            "serves the pooling endpoints (/v1/embeddings, /score, /rerank, /pooling; /classify on a "
                            "sequence-classification model) instead of the generation ones "
                            "(docs/engine.md#pooling-requests)")
    group.add_argument("--task", choices=("generate", "embed", "classify", "score"), default=None,
                       help="older vLLM's spelling of --runner: embed, classify and score are --runner pooling")
    group.add_argument("--pooler-config", type=_pooler_json, default=None, metavar="JSON",
                       help="with --runner pooling: override the model's pooling, e.g. '{\"pooling_type\": \"MEAN\", "
                            "\"use_activation\": false}' (default: the model's sentence-transformers files, else LAST "
                            "pooling, normalized)")
    group.add_argument("--enable-lora", action="store_true", default=None,
                       help="serve LoRA adapters in both pools (engine.enable_lora; docs/lora.md)")
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT directories) requests may name as `model`; needs --enable-lora")
    group.add_argument("--max-loras", type=int, default=None,
                       help="adapters loaded at once per worker, least recently used evicted, and the most in one "
                            "batch (default 1)")
    group.add_argument("--max-lora-rank", type=int, default=None, help="the highest adapter rank accepted (default 16)")
    group.add_argument("--max-model-len", type=human_int, default=None,
                       help="longest prompt + output in tokens (default: the model's max_position_embeddings; a "
                            "longrope model's original_max_position_embeddings); "
                            "accepts 32k / 32K")
    group.add_argument("--seed", type=int, default=None,
                       help="seed of the random draws of requests that bring no seed of their own (default 0)")
    group.add_argument("--enforce-eager", action="store_true",
                       help="no CUDA graphs: both pools run every step eagerly (engine.cuda_graphs: false); by "
                            "default a pool captures its decode steps wherever it runs FlashInfer on CUDA")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM compatibility; no effect: splitserve runs its own implementation of "
                            "the supported architectures and never runs code from the model directory")
    group.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                       help="where the workers run the model (default: the config's, auto = cuda when available)")
    group.add_argument("--generation-config", default=None, metavar="{auto,vllm,FOLDER}",
                       help="default sampling values of requests that leave them unset: auto (default) takes the "
                            "model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                            "presence/frequency_penalty, max_new_tokens), vllm none, FOLDER the file in that folder")
    group.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                       help="most top logprobs per token a request may ask for (default 20; -1: the vocabulary)")
    group.add_argument("--override-generation-config", type=_json_object, default=None, metavar="JSON",
                       help="defaults that win over the file's, e.g. '{\"temperature\": 0.5}'; a max_new_tokens "
                            "here also limits every request's max_tokens")


def _refused(reason: str, accepted: str | None = None) -> Callable[[str], str]:
    """argparse type of a vLLM flag splitserve cannot honour: any value (other than `accepted`, the one
    that asks for nothing vLLM's default does not) is a usage error saying why, never silently ignored."""
    def parse(value: str) -> str:
        if value != accepted:
            raise argparse.ArgumentTypeError(f"not supported, got {value!r}: {reason}")
        return value
    return parse


def _add_unsupported_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--long-prefill-token-threshold", type=_refused(
        "the scheduler has no cap on a long prompt's chunk besides --max-num-batched-tokens", accepted="0"),
        default=None, metavar="0", help="only 0 (vLLM's default: no cap)")
    for flag in ("--max-num-partial-prefills", "--max-long-partial-prefills"):
        group.add_argument(flag, type=_refused(
            "vLLM 0.32 dropped it with its V0 scheduler, and splitserve's scheduler has no limit on prompts "
            "prefilled in chunks at once besides --max-num-batched-tokens"), default=None, metavar="N",
            help="not supported")


def _add_cache_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 16)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                       help="reuse the KV blocks of identical prompt prefixes across requests (default: on)")
    group.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory", type=human_int,
                       action=_OneValue, default=None, metavar="BYTES",
                       help="KV cache size of each worker in bytes, e.g. 2G (default: 256 MiB per prefill "
                            "worker, 2 GiB per decode worker); wins over --gpu-memory-utilization")
    group.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                       help="on CUDA, the share of its device's memory, in (0, 1], each worker may hold for weights, "
                            "activations and KV cache: its KV cache gets what the weights and a profiling step "
                            "leave of it (replaces the default sizes; workers sharing a device need shares that add "
                            "up to at most 1, e.g. --set prefill.engine.gpu_memory_utilization=0.3). On CPU it has "
                            "no effect, as in vLLM: each KV cache is then --kv-cache-memory, else 1 GiB")
    group.add_argument("--kv-cache-dtype", choices=tuple(VLLM_KV_CACHE_DTYPES), default=None,
                       help="KV cache element type of both pools: auto (the model's dtype), or int8 / fp8 (= fp8_e4m3) "
                            "codes with a scale per token per KV head: about half of bf16's bytes to hold and to "
                            "move from prefill to decode")


def _add_parallel_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--tensor-parallel-size", "-tp", type=_only_one("--tensor-parallel-size"), default=None,
                       help="only 1: each worker runs on one device")
    group.add_argument("--pipeline-parallel-size", "-pp", type=_only_one("--pipeline-parallel-size"),
                       default=None, help="only 1: each worker runs on one device")


def _add_scheduler_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--max-num-seqs", type=int, default=None,
                       help="most requests in a worker's running batch (default: prefill 16, decode 256)")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="token budget of one engine step (default: prefill 8192, decode 512)")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                       help="split long prompts across steps to fit the token budget (default: on)")
    group.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=None,
                       help="fcfs (default): requests run in arrival order, and one with a priority other than 0 "
                            "is refused; priority: by each request's priority (lower first, ties by arrival), and "
                            "when KV blocks run out the running request with the largest (priority, arrival) is "
                            "preempted")
    group.add_argument("--speculative-config", type=_speculative_json, default=None, metavar="JSON",
                       help="speculative decoding on the decode pool, e.g. '{\"method\": \"ngram\", "
                            "\"num_speculative_tokens\": 4}', in splitserve's keys or vLLM's (prompt_lookup_max, "
                            "\"model\" for a draft model, ...; docs/speculative.md); sets decode.engine.speculative")


def _add_cluster_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--config", default=None,
                       help="cluster config: a YAML file, or the name of one that ships with splitserve "
                            "(`splitserve config --list`; docs/configuration.md)")
    group.add_argument("--mode", choices=("disaggregated", "colocated"), default=None)
    group.add_argument("--prefill-workers", type=int, default=None)
    group.add_argument("--decode-workers", type=int, default=None)
    group.add_argument("--kv-transfer-backend", choices=("nixl", "inprocess"), default=None)
    group.add_argument("--log-format", choices=("text", "json"), default=None,
                       help="log lines as text (default) or one JSON object per line")
    group.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="any config key in dotted form, e.g. decode.engine.max_num_seqs=64 (YAML value)")


_CLUSTER_FLAGS = {"mode": "mode", "prefill_workers": "prefill.replicas", "decode_workers": "decode.replicas",
                  "host": "router.host", "grpc_port": "router.grpc_port", "metrics_port": "router.metrics_port",
                  "port": "router.http_port", "kv_transfer_backend": "kv_transfer_backend",
                  "log_format": "log_format", "chat_template": "router.chat_template",
                  "chat_template_content_format": "router.chat_template_content_format",
                  "trust_request_chat_template": "router.trust_request_chat_template",
                  "enable_auto_tool_choice": "router.enable_auto_tool_choice",
                  "tool_call_parser": "router.tool_call_parser", "reasoning_parser": "router.reasoning_parser",
                  "ssl_certfile": "router.tls.cert_file", "ssl_keyfile": "router.tls.key_file",
                  "ssl_ca_certs": "router.tls.client_ca_file", "served_model_name": "served_model_name",
                  "lora_modules": "lora_modules", "max_logprobs": "router.max_logprobs", "tokenizer": "tokenizer"}
"""serve flags -> the cluster config key they set."""
_ENGINE_FLAGS = {"max_model_len": "max_model_len", "seed": "seed", "block_size": "block_size",
                 "enable_prefix_caching": "enable_prefix_caching", "kv_cache_memory": "kv_cache_memory_bytes",
                 "gpu_memory_utilization": "gpu_memory_utilization",
                 "max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
                 "enable_chunked_prefill": "enable_chunked_prefill", "device": "device",
                 "quantization": "quantization", "scheduling_policy": "scheduling_policy",
                 "enable_lora": "enable_lora", "max_loras": "max_loras", "max_lora_rank": "max_lora_rank"}
"""serve flags -> the EngineConfig field they set in both pools."""


def _runner_overrides(args: argparse.Namespace) -> dict[str, object]:
    """--runner (or --task's older spelling) and --pooler-config, in both pools."""
    runner = args.runner
    if args.task is not None:
        from_task = "generate" if args.task == "generate" else "pooling"
        if runner not in (None, from_task):
            raise SystemExit(f"--task {args.task} contradicts --runner {runner}; pass one of them")
        runner = from_task
    overrides: dict[str, object] = {}
    for pool in ("prefill", "decode"):
        if runner is not None:
            overrides[f"{pool}.engine.runner"] = runner
        if args.pooler_config is not None:
            overrides[f"{pool}.engine.pooler_config"] = args.pooler_config
    return overrides


def serve_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The dotted config keys the flags set: engine flags in both pools, then --set (which wins,
    so `--set decode.engine.max_num_seqs=64` beats --max-num-seqs for the decode pool)."""
    import yaml

    overrides: dict[str, object] = {}
    for flag, key in _ENGINE_FLAGS.items():
        if getattr(args, flag) is not None:
            overrides.update({f"prefill.engine.{key}": getattr(args, flag), f"decode.engine.{key}": getattr(args, flag)})
    if args.dtype is not None:
        overrides.update({"prefill.engine.dtype": VLLM_DTYPES[args.dtype], "decode.engine.dtype": VLLM_DTYPES[args.dtype]})
    if args.enforce_eager:
        overrides.update({"prefill.engine.cuda_graphs": False, "decode.engine.cuda_graphs": False})
    if args.kv_cache_dtype is not None:
        kv_cache_dtype = VLLM_KV_CACHE_DTYPES[args.kv_cache_dtype]
        overrides.update({"prefill.engine.kv_cache_dtype": kv_cache_dtype, "decode.engine.kv_cache_dtype": kv_cache_dtype})
    overrides.update({key: getattr(args, flag) for flag, key in _CLUSTER_FLAGS.items() if getattr(args, flag) is not None})
    overrides.update({key: getattr(args, flag) for flag, key in _HTTP_FLAGS.items() if getattr(args, flag) is not None})
    if args.speculative_config is not None:
        overrides["decode.engine.speculative"] = args.speculative_config
    overrides.update(_runner_overrides(args))
    if args.generation_config is not None:
        overrides["router.generation_config.source"] = args.generation_config
    for name, value in (args.override_generation_config or {}).items():
        overrides[f"router.generation_config.overrides.{name}"] = value
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        overrides[key] = yaml.safe_load(value)
    if overrides.get("mode") == "colocated" and "prefill.replicas" not in overrides:
        overrides["prefill.replicas"] = 0
    return overrides


def serve_config(args: argparse.Namespace):
    """The cluster config: the file (or the defaults), then the flags, then --set (serve_overrides)."""
    from splitserve.deploy.cluster_config import apply_overrides, default_cluster_config, load_cluster_config
    from splitserve.deploy.packaged import resolve_config

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} (positional) and --model {args.model!r}")
    model = args.model_tag or args.model
    config = (load_cluster_config(resolve_config(args.config)) if args.config
              else default_cluster_config(model or "default"))
    overrides = serve_overrides(args)
    if model is not None:
        overrides["model"] = model
    config = apply_overrides(config, overrides)
    return config


def _serve(args: argparse.Namespace) -> int:
    from splitserve.common.log_format import configure_logging
    from splitserve.deploy.preflight import preflight

    config = serve_config(args)
    preflight(config, args.api_key)  # every mistake the files show, before Ray and the workers start
    configure_logging(config.log_format)
    try:
        from splitserve.deploy.local import serve  # imports Ray and torch: seconds
    except KeyboardInterrupt:  # Ctrl-C before anything started; serve() handles the signals from Ray's start on
        print("splitserve: stopped before serving", flush=True)
        return 0
    try:
        return serve(config, args.api_key)
    except (StartupError, OSError) as error:  # a worker's load, or a port taken since the preflight
        print(f"splitserve: error: {one_line(str(error))}", file=sys.stderr)
        return 1


def _add_config(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("config", help="print a cluster config: the defaults, or one that ships with "
                                                "splitserve (docs/configuration.md)")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--print", dest="print_name", nargs="?", const="", metavar="NAME",
                        help="write the default config (every key) to stdout, or the packaged config NAME")
    action.add_argument("--list", action="store_true", help="list the packaged configs and where they are")
    parser.add_argument("--model", default="default", help="the model of the default config (default: default)")
    parser.set_defaults(handler=_config)


def _config(args: argparse.Namespace) -> int:
    from splitserve.deploy.cluster_config import default_cluster_config, dump_cluster_config
    from splitserve.deploy.packaged import packaged_configs, resolve_config

    if args.list:
        for name, path in packaged_configs().items():
            print(f"{name}\t{path}")
    elif args.print_name:
        sys.stdout.write(resolve_config(args.print_name, "config --print").read_text(encoding="utf-8"))
    else:
        sys.stdout.write(dump_cluster_config(default_cluster_config(args.model)))
    return 0


def _add_simulate(commands: argparse._SubParsersAction) -> None:
    from splitserve.planner.sim.scenario import POLICY_NAMES
    from splitserve.planner.sim.traces import TRACE_NAMES

    parser = commands.add_parser("simulate", help="run a traffic trace through the simulated cluster under an "
                                                  "autoscaling policy (docs/planner.md); writes JSON + PNG")
    parser.add_argument("--trace", choices=TRACE_NAMES, default="bursty",
                        help="the synthetic arrival pattern (docs/planner.md, 'The simulator')")
    parser.add_argument("--devices", type=int, default=128,
                        help=f"devices the trace's peak load is sized to, 2 to {MAX_SIMULATED_DEVICES:,} (the "
                             "arrivals grow with it: an hour at 1,000 devices takes 17-50 s)")
    parser.add_argument("--policy", choices=(*POLICY_NAMES, "all"), default="all",
                        help="planner (ours), static, dynamo (averages, no queueing), rayserve (p99 TTFT +/-1)")
    parser.add_argument("--duration", type=float, default=3600.0, help="seconds of arrivals")
    parser.add_argument("--seed", type=int, default=0, help="seed of the trace's arrivals and lengths (>= 0)")
    parser.add_argument("--out", type=Path, default=Path("simulation"), help="output folder (created)")
    parser.set_defaults(handler=_simulate)


MAX_SIMULATED_DEVICES = 100_000
"""The largest cluster `simulate` sizes a trace to (its requests grow with the devices: an hour at 1,000 devices
takes 17-50 s, docs/planner.md)."""


def _simulate(args: argparse.Namespace) -> int:
    from splitserve.planner.sim.plot import write_png
    from splitserve.planner.sim.report import write_json
    from splitserve.planner.sim.scenario import POLICY_NAMES, run_simulation

    if args.devices < 2 or args.duration <= 0:
        raise ValueError(f"need --devices >= 2 and --duration > 0, got {args.devices} and {args.duration}")
    if args.devices > MAX_SIMULATED_DEVICES:  # the trace's arrivals grow with it: 10**8 ran for hours, silent
        raise ValueError(f"--devices must be at most {MAX_SIMULATED_DEVICES:,}, got {args.devices:,}")
    if args.out.exists() and not args.out.is_dir():  # before the simulation, not after it
        raise ValueError(f"--out {str(args.out)!r} exists and is not a folder")
    policies = POLICY_NAMES if args.policy == "all" else (args.policy,)
    results = [run_simulation(args.trace, args.devices, policy, args.seed, args.duration) for policy in policies]
    print(f"{'policy':<10} {'attainment':>10} {'goodput/device':>15} {'device-hours':>13} {'TTFT p99':>9} {'TPOT p99':>9}")
    for r in results:
        print(f"{r.policy:<10} {r.attainment:>10.3f} {r.goodput_per_device:>15.4f} {r.device_hours:>13.1f} "
              f"{r.ttft.p99_s:>8.2f}s {r.tpot.p99_s:>8.3f}s")
    name = f"{args.trace}-{args.devices}"
    print(f"wrote {write_json(results, args.out / f'{name}.json')} and "
          f"{write_png(results, args.out / f'{name}.png', f'{args.devices} devices: ')}")
    return 0


class _OneLineErrors(argparse.ArgumentParser):
    """Usage errors as one line (`splitserve serve: error: argument --dtype: invalid choice ...`),
    exit status 2 as argparse's; --help still shows the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(prog="splitserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineErrors)
    _add_make_tiny_model(commands)
    _add_train_tiny_model(commands)
    _add_generate(commands)
    _add_serve(commands)
    _add_config(commands)
    _add_simulate(commands)
    _add_quantize(commands)
    return parser


def one_line(message: str) -> str:
    """A message as one line (YAML and jinja errors span several)."""
    return " ".join(message.split())


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parser.parse_args, except that flags no subcommand knows are the subcommand's usage error
    (`splitserve serve: error: unrecognized arguments: ... (see splitserve serve --help)`), where its
    flags are listed, not the top-level parser's."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    try:
        return args.handler(args)
    except (InvalidRequestError, UnsupportedModelError, OSError, ValueError) as error:  # OSError: a path's fault
        print(f"splitserve: error: {one_line(str(error))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
