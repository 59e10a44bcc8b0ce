"""What structured output costs: output tokens/s and inter-token latency of requests constrained by
a JSON schema against the same requests unconstrained, at batch 1 and 32, on the embedded default
model in an in-process EngineCore (the colocated bench cluster's engine config: one torch thread),
where the whole cost lives (grammar compile on admission, the batched bitmask fill, the mask
applied to the logits, the matcher advanced per token).

Each request: a distinct random 32-token prompt, greedy, exactly MAX_TOKENS output tokens. Plain
requests run with ignore_eos; constrained ones follow SCHEMA (an array of at least 20 objects with
strings, integers, booleans and enums), which needs more than MAX_TOKENS tokens, so both end by
length after the same number of tokens. A run admits the batch at once and steps the engine
until it is empty; tok/s is output tokens / wall time of the run, ITL the mean gap between a
request's consecutive tokens (p50 / p90 over requests). Runs alternate plain / json_schema in
rounds (the machine is shared and its speed drifts): values are medians over rounds, overheads
the median over rounds of each round's json_schema / plain ratio. The router's grammar
check (llguidance without a tokenizer, once per request) is timed apart.

Writes bench/results/structured_output.json and .png. Run: .venv/bin/python bench/structured_output.py
(a few minutes; --quick: 2 rounds, written to the temp directory).
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from serving_common import bench_parser, cluster_config, percentile, positive_int, random_prompt, report_header, \
    start_bench, write_report

from splitserve.common.model_dir import DEFAULT_MODEL_NAME
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_output import StructuredOutput
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.tiny_model import resolve_model_path
from splitserve.router.structured_output import check_grammar

RESULTS = Path(__file__).resolve().parent / "results"
BATCH_SIZES = (1, 32)
MAX_TOKENS = 64
PROMPT_TOKENS = 32
ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
    "required": ["name", "age", "ok", "color", "tags"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 20}
VARIANTS = ("plain", "json_schema")


def params(variant: str) -> SamplingParams:
    if variant == "plain":
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_output=StructuredOutput.json_schema(SCHEMA))


def run(engine: EngineCore, prompts: list[list[int]], variant: str, tag: str) -> dict:
    """One batch through the engine: tok/s and per-request mean ITL (ms)."""
    arrivals: dict[str, list[float]] = {}
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", prompt, params(variant))
        arrivals[f"{tag}-{index}"] = []
    while engine.has_unfinished_requests():
        deltas = engine.step()
        now = time.perf_counter()
        for delta in deltas:
            arrivals[delta.request_id].extend([now] * len(delta.new_token_ids))
    wall_s = time.perf_counter() - started
    counts = [len(times) for times in arrivals.values()]
    assert counts == [MAX_TOKENS] * len(prompts), counts  # same work in both variants
    itls = [(times[-1] - times[0]) / (len(times) - 1) * 1e3 for times in arrivals.values()]
    return {"tok_s": sum(counts) / wall_s, "itl_ms_p50": percentile(itls, 50), "itl_ms_p90": percentile(itls, 90)}


def measure(engine: EngineCore, rounds: int, seed: int) -> dict:
    rng = random.Random(seed)
    samples = {(batch, variant): [] for batch in BATCH_SIZES for variant in VARIANTS}
    for round_index in range(rounds):
        for batch in BATCH_SIZES:
            prompts = [random_prompt(rng, PROMPT_TOKENS, engine.vocab_size) for _ in range(batch)]
            for variant in VARIANTS:  # the same prompts, one variant right after the other
                samples[batch, variant].append(run(engine, prompts, variant, f"{variant}-{batch}-{round_index}"))
    return {f"batch_{batch}": {variant: _medians(samples[batch, variant]) for variant in VARIANTS}
            for batch in BATCH_SIZES}


def _medians(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]} | {"runs": runs}


def router_check_ms(repeats: int = 200) -> float:
    """The router's per-request grammar check of SCHEMA (median ms)."""
    constraint = StructuredOutput.json_schema(SCHEMA)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        check_grammar(constraint)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def overheads(results: dict) -> dict:
    """json_schema relative to plain per batch, as the median over rounds of the two adjacent runs'
    ratio (robust to the machine's drift between rounds): tok/s slowdown (1 - ratio) and ITL ratio."""
    def median_ratio(r: dict, key: str) -> float:
        return statistics.median(c[key] / p[key] for c, p in zip(r["json_schema"]["runs"], r["plain"]["runs"]))

    return {name: {"tok_s_slowdown": 1 - median_ratio(r, "tok_s"), "itl_p50_ratio": median_ratio(r, "itl_ms_p50")}
            for name, r in results.items()}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = list(report["results"])
    for ax, key, unit in ((axes[0], "tok_s", "output tokens/s"), (axes[1], "itl_ms_p50", "ITL p50 (ms)")):
        for offset, variant in enumerate(VARIANTS):
            values = [report["results"][name][variant][key] for name in names]
            ax.bar([i + 0.4 * offset for i in range(len(names))], values, width=0.4, label=variant)
        ax.set_xticks([i + 0.2 for i in range(len(names))], names)
        ax.set_ylabel(unit)
        ax.legend()
    figure.suptitle("structured output (json_schema) vs plain, default model, in-process engine")
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = bench_parser(__doc__, "2 rounds, written to the temp directory", RESULTS)
    parser.add_argument("--rounds", type=positive_int, default=9)
    args = parser.parse_args()
    start_bench()
    model = resolve_model_path(DEFAULT_MODEL_NAME)
    engine = EngineCore(model, cluster_config(model, "colocated").decode.engine)
    report = report_header("bench/structured_output.py", args)
    run(engine, [random_prompt(random.Random(-1), PROMPT_TOKENS, engine.vocab_size)] * 2, "json_schema", "warm")
    report["results"] = measure(engine, 2 if args.quick else args.rounds, args.seed)
    report["overhead"] = overheads(report["results"])
    report["router_check_ms"] = router_check_ms()
    out_dir = write_report(report, "structured_output", args, RESULTS, plot)
    for name, overhead in report["overhead"].items():
        plain, constrained = report["results"][name]["plain"], report["results"][name]["json_schema"]
        print(f"{name}: plain {plain['tok_s']:.0f} tok/s, ITL p50 {plain['itl_ms_p50']:.2f} ms; json_schema "
              f"{constrained['tok_s']:.0f} tok/s, ITL p50 {constrained['itl_ms_p50']:.2f} ms; "
              f"slowdown {overhead['tok_s_slowdown']:+.1%} (median of per-round ratios)")
    print(f"router grammar check: {report['router_check_ms']:.3f} ms; wrote {out_dir}/structured_output.json")


if __name__ == "__main__":
    main()
