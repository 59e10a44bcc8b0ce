"""The `splitserve` command line."""

from __future__ import annotations

import argparse
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
    group = parser.add_argument_group("engine")
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    group.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    group.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    group.add_argument("--num-kv-blocks", type=int, default=None)


def _add_generate(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("generate", help="offline generation, streamed to the terminal")
    parser.add_argument("prompt")
    parser.add_argument("--model", default="default", help="model directory, or 'default' for the embedded model")
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
    from splitserve.engine import LLM
    from splitserve.engine.tiny_model import resolve_model_path

    params = _sampling_params(args)
    model_dir = resolve_model_path(args.model)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_make_tiny_model(commands)
    _add_generate(commands)
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
