"""The `splitserve` command line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from splitserve.common.errors import InvalidRequestError, UnsupportedModelError


def _add_make_tiny_model(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("make-tiny-model", help="build a tiny Hugging Face-format model directory")
    parser.add_argument("dir", type=Path, help="output directory (created)")
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

    params = _sampling_params(args)
    model_dir = resolve_model_path(args.model or DEFAULT_MODEL_NAME)
    llm = LLM(model_dir, show_progress=sys.stderr.isatty(), block_size=args.block_size,
              max_model_len=args.max_model_len, dtype=args.dtype, device=args.device,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, num_kv_blocks=args.num_kv_blocks)
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
                                      model=args.model or "")
    return build_generate_request(text=args.prompt, params=params, model=args.model or "")


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


def _add_serve(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("serve", help="serve a model over gRPC and the OpenAI HTTP API on a local Ray "
                                                   "cluster (Ctrl-C stops it)")
    parser.add_argument("--config", type=Path, default=None, help="cluster config YAML (docs/configuration.md)")
    parser.add_argument("--model", default=None, help="model directory or 'default' (overrides the config's)")
    parser.add_argument("--mode", choices=("disaggregated", "colocated"), default=None)
    parser.add_argument("--prefill-workers", type=int, default=None)
    parser.add_argument("--decode-workers", type=int, default=None)
    parser.add_argument("--host", default=None, help="gRPC, HTTP and /metrics listen address (default 127.0.0.1)")
    parser.add_argument("--grpc-port", type=int, default=None, help="default 50051; 0 picks a free port")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="Prometheus /metrics port on --host (default 9400); 0 picks a free port")
    parser.add_argument("--http-port", type=int, default=None,
                        help="OpenAI-compatible HTTP API port on --host (default 8000); 0 picks a free port")
    parser.add_argument("--kv-transfer-backend", choices=("nixl", "inprocess"), default=None)
    parser.add_argument("--log-format", choices=("text", "json"), default=None,
                        help="log lines as text (default) or one JSON object per line")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any config key in dotted form, e.g. decode.engine.max_num_seqs=64 (YAML value)")
    parser.set_defaults(handler=_serve)


_SERVE_FLAGS = {"model": "model", "mode": "mode", "prefill_workers": "prefill.replicas",
                "decode_workers": "decode.replicas", "host": "router.host", "grpc_port": "router.grpc_port",
                "metrics_port": "router.metrics_port", "http_port": "router.http_port",
                "kv_transfer_backend": "kv_transfer_backend", "log_format": "log_format"}


def serve_config(args: argparse.Namespace):
    """The cluster config: the file (or the defaults), then --set, then the dedicated flags."""
    import yaml

    from splitserve.deploy.cluster_config import apply_overrides, default_cluster_config, load_cluster_config

    config = load_cluster_config(args.config) if args.config else default_cluster_config(args.model or "default")
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        overrides[key] = yaml.safe_load(value)
    overrides.update({key: getattr(args, flag) for flag, key in _SERVE_FLAGS.items()
                      if getattr(args, flag) is not None})
    if overrides.get("mode") == "colocated" and "prefill.replicas" not in overrides:
        overrides["prefill.replicas"] = 0
    return apply_overrides(config, overrides)


def _serve(args: argparse.Namespace) -> int:
    from splitserve.common.log_format import configure_logging
    from splitserve.deploy.local import serve

    config = serve_config(args)
    configure_logging(config.log_format)
    return serve(config)


def _add_simulate(commands: argparse._SubParsersAction) -> None:
    from splitserve.planner.sim.scenario import POLICY_NAMES
    from splitserve.planner.sim.traces import TRACE_NAMES

    parser = commands.add_parser("simulate", help="run a traffic trace through the simulated cluster under an "
                                                  "autoscaling policy (docs/planner.md); writes JSON + PNG")
    parser.add_argument("--trace", choices=TRACE_NAMES, default="bursty")
    parser.add_argument("--devices", type=int, default=128, help="devices the trace's peak load is sized to")
    parser.add_argument("--policy", choices=(*POLICY_NAMES, "all"), default="all",
                        help="planner (ours), static, dynamo (averages, no queueing), rayserve (p99 TTFT +/-1)")
    parser.add_argument("--duration", type=float, default=3600.0, help="seconds of arrivals")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("simulation"), help="output folder (created)")
    parser.set_defaults(handler=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    from splitserve.planner.sim.plot import write_png
    from splitserve.planner.sim.report import write_json
    from splitserve.planner.sim.scenario import POLICY_NAMES, run_simulation

    if args.devices < 2 or args.duration <= 0:
        raise ValueError(f"need --devices >= 2 and --duration > 0, got {args.devices} and {args.duration}")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_make_tiny_model(commands)
    _add_generate(commands)
    _add_serve(commands)
    _add_simulate(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (InvalidRequestError, UnsupportedModelError, FileNotFoundError, ValueError) as error:
        print(f"splitserve: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
