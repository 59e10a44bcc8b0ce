"""Speculative decoding on the trained `default` model, offline (EngineCore): off / ngram / draft.

Workloads (greedy, ignore_eos, OUTPUT_TOKENS new tokens each):
  code  prompts of PROMPT_TOKENS tokens cut from the model's held-out stdlib files
        (splitserve.eval.heldout_windows: files the model never trained on): code continuation
  chat  chat-template prompts (user questions about Python) through the model's ChatML template
At batch 1, 8 and 32 (one wave of that many requests), each method runs in the same process,
alternating in rounds (the machine's speed drifts); medians over rounds. The engine runs one torch
thread and time is the process's CPU time (time.process_time): the development machine is shared
(load average 10-16 on 2 cores while this was measured), which makes wall time meaningless, while
a one-thread process's CPU time is what its wall time would be on an idle core. Per run: ITL (a
request's decode time / (its tokens - 1), averaged over requests; tokens of a verified run arrive
together, so this is vLLM's mean TPOT), output tok/s (all tokens / time), acceptance rate
(accepted / draft tokens) and mean accepted length (tokens emitted per verification, vLLM's
definition).
Every run's token ids must equal `off`'s (greedy identity): the bench stops if not.

`--crossover` also runs ngram and draft with no batch threshold on code at batch 2, 4, 16 and 32, to
find where speculation stops paying (config.DEFAULT_BATCH_LIMITS, the default of
SpeculativeConfig.disable_above_batch_size).

Writes bench/results/speculative.json and .png. Run: .venv/bin/python bench/speculative.py
(--quick: batch 1 and 8, 1 round, to the temp directory).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from splitserve.common.config import EngineConfig, SpeculativeConfig
from splitserve.common.model_dir import DEFAULT_MODEL_NAME, DRAFT_MODEL_NAME
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.llm import load_tokenizer
from splitserve.engine.tiny_model import resolve_model_path
from splitserve.eval import heldout_windows

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
PROMPT_TOKENS, OUTPUT_TOKENS = 192, 64
BATCH_SIZES = (1, 8, 32)
CROSSOVER_BATCH_SIZES = (2, 4, 16, 32)
CHAT_QUESTIONS = (
    "How do I read a file line by line in Python?", "Write a function that reverses a list.",
    "What does the with statement do?", "Explain list comprehensions with an example.",
    "How do I parse command line arguments?", "Write a class for a stack with push and pop.",
    "How can I sort a dictionary by value?", "What is a generator in Python?",
)
ENGINE = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, num_kv_blocks=2048, device="cpu", num_threads=1)
"""One torch thread: the process's CPU time is then its compute time, whatever else runs on the machine."""
METHODS = {
    "off": None,
    "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=4),
    "draft": SpeculativeConfig(method="draft", draft_model=DRAFT_MODEL_NAME, num_speculative_tokens=4),
}


@dataclass(frozen=True)
class Run:
    workload: str
    method: str
    batch_size: int
    threshold: int | None
    """The run's effective disable_above_batch_size (None: off; 1024: always speculating)."""
    itl_ms: float
    output_tokens_per_s: float
    acceptance_rate: float
    mean_accepted_length: float
    identical_to_off: bool


def code_prompts(model_dir: Path, count: int) -> list[list[int]]:
    windows = heldout_windows(model_dir)  # [N, context_len + 1]
    step = max(1, len(windows) // count)
    return [windows[i * step % len(windows), :PROMPT_TOKENS].tolist() for i in range(count)]


def chat_prompts(model_dir: Path, count: int) -> list[list[int]]:
    tokenizer = load_tokenizer(model_dir)
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False))
            for i in range(count)]


def generate(engine: EngineCore, prompts: list[list[int]]) -> tuple[list[list[int]], list[float], float]:
    """(token ids per prompt, ITL seconds per request, seconds) of one wave, on the process's CPU clock."""
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"b{index}", prompt, params)
    tokens: dict[str, list[int]] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    started = time.process_time()
    while engine.has_unfinished_requests():
        deltas = engine.step()
        now = time.process_time()
        for delta in deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            first.setdefault(delta.request_id, now)
            last[delta.request_id] = now
    wall = time.process_time() - started
    ids = [f"b{i}" for i in range(len(prompts))]
    itls = [(last[r] - first[r]) / (len(tokens[r]) - 1) for r in ids]
    return [tokens[r] for r in ids], itls, wall


def measure(engines: dict[str, EngineCore], workload: str, prompts: list[list[int]], rounds: int,
            thresholds: dict[str, int | None]) -> list[Run]:
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    before = {name: engine.stats().spec_decode for name, engine in engines.items()}
    for round_index in range(rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for name in order:
            tokens, itls, wall = generate(engines[name], prompts)
            outputs[name] = tokens
            samples[name].append((statistics.mean(itls), sum(map(len, tokens)) / wall))
    runs = []
    for name, engine in engines.items():
        rate, length = _acceptance(before[name], engine.stats().spec_decode)
        runs.append(Run(workload, name, len(prompts), thresholds[name],
                        statistics.median(s[0] for s in samples[name]) * 1e3,
                        statistics.median(s[1] for s in samples[name]), rate, length,
                        outputs[name] == outputs["off"]))
    return runs


def _acceptance(before, after) -> tuple[float, float]:
    """(acceptance rate, mean accepted length) between two SpecDecodeStats snapshots (0, 0 when off)."""
    if after is None or after.num_drafts == before.num_drafts:
        return 0.0, 0.0
    drafts = after.num_drafts - before.num_drafts
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return accepted / (after.num_draft_tokens - before.num_draft_tokens), 1.0 + accepted / drafts


def build_engines(model_dir: Path, threshold: int | None, use_default_threshold: bool) -> dict[str, EngineCore]:
    engines = {}
    for name, speculative in METHODS.items():
        if speculative is not None and not use_default_threshold:
            speculative = replace(speculative, disable_above_batch_size=threshold)
        engines[name] = EngineCore(model_dir, replace(ENGINE, speculative=speculative))
    return engines


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r.workload for r in runs})
    figure, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for axis, workload in zip(axes[0], workloads):
        for method in METHODS:
            points = sorted((r.batch_size, r.itl_ms) for r in runs if r.workload == workload and r.method == method)
            if points:
                axis.plot(*zip(*points), marker="o", label=method)
        axis.set(title=workload, xlabel="batch size", ylabel="ITL (ms)", xscale="log")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--crossover", action="store_true")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    batch_sizes = (1, 8) if args.quick else BATCH_SIZES
    model_dir = resolve_model_path(DEFAULT_MODEL_NAME)
    runs: list[Run] = []
    engines = build_engines(model_dir, None, use_default_threshold=True)
    thresholds = {name: (None if s is None else s.batch_limit) for name, s in METHODS.items()}
    for workload, make in (("code", code_prompts), ("chat", chat_prompts)):
        for batch_size in batch_sizes:
            runs.extend(measure(engines, workload, make(model_dir, batch_size), rounds, thresholds))
            print(*(f"{r.workload} b{r.batch_size} {r.method}: ITL {r.itl_ms:.2f} ms, {r.output_tokens_per_s:.0f} tok/s,"
                    f" accept {r.acceptance_rate:.2f}, len {r.mean_accepted_length:.2f}, same {r.identical_to_off}"
                    for r in runs[-len(engines):]), sep="\n", flush=True)
    if args.crossover:
        engines = build_engines(model_dir, 1024, use_default_threshold=False)
        no_threshold = dict.fromkeys(engines)
        for batch_size in CROSSOVER_BATCH_SIZES:
            for run in measure(engines, "code", code_prompts(model_dir, batch_size), rounds, no_threshold):
                runs.append(replace(run, workload="code, no threshold"))
                print(f"crossover b{batch_size} {run.method}: ITL {run.itl_ms:.2f} ms", flush=True)
    assert all(r.identical_to_off for r in runs), "speculative greedy output differs from off"
    out_dir = Path(tempfile.mkdtemp()) if args.quick else RESULTS
    result = {"machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                          "torch": torch.__version__, "threads": torch.get_num_threads()},
              "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, "rounds": rounds,
              "methods": {name: (None if s is None else asdict(s)) for name, s in METHODS.items()},
              "runs": [asdict(r) for r in runs]}
    (out_dir / "speculative.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(runs, out_dir / "speculative.png")
    print(f"wrote {out_dir / 'speculative.json'}")


if __name__ == "__main__":
    main()
