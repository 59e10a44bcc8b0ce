"""What the cluster adds to what the engine costs: one stream through the whole serving path
(gRPC client in its own process -> router -> Ray workers -> streamed back) against the same
requests stepped on an in-process EngineCore with the same engine config, in this process.

Setups: colocated (one worker prefills and decodes) and 1P+1D (`disaggregation: always`: every
prompt is prefilled on the prefill worker and its KV pulled over NIXL), both the bench cluster of
serving_common.cluster_config (one torch thread per worker, fp32, 16-token blocks), and the
in-process engine with one torch thread. Requests: `--requests` prompts of `--prompt-tokens` random
token ids, `--max-tokens` outputs each (greedy, ignore_eos), one at a time, after a warm-up.

Reported: client-side TTFT and per-token latency (ITL; a message of k tokens after a gap g counts
k tokens of g / k) p50 / p90 per setup, the in-process engine's (TTFT: add_request to the step
that returns the first token; ITL: the gaps between the steps that return tokens), and the
overhead = cluster p50 - in-process p50 (issue targets: <= 2 ms TTFT, <= 0.5 ms ITL).

Writes bench/results/serve_overhead.json and .png (--quick: 5 requests, to the temp directory).
"""

from __future__ import annotations

import functools
import multiprocessing
import random
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from serving_common import (Cluster, bench_parser, client_sequential, cluster_config, positive_int, random_prompt,
                            report_header,
                            start_bench, summary_ms, token_gaps, ttft_s, write_report)

RESULTS = Path(__file__).parent / "results"


@functools.cache
def serving_model() -> str:
    """The random-weight serving model (the embedded default before it was trained), so results stay comparable."""
    from splitserve.testing.tiny_models import RANDOM_SERVING_SPEC, cached_tiny_model

    return str(cached_tiny_model(RANDOM_SERVING_SPEC))


SETUPS = {"colocated": ("colocated", {}),
          "1P+1D": ("disaggregated", {"router.routing.disaggregation": "always"})}


def run_cluster(mode: str, overrides: dict, prompts: list[list[int]], max_tokens: int) -> dict:
    with Cluster(cluster_config(serving_model(), mode, **overrides)) as (cluster, _):
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as client:
            client.submit(client_sequential, cluster.port, [("warmup", "warmup", prompts[0], 4)]).result()
            records = client.submit(client_sequential, cluster.port,
                                    [(f"r{i}", "r", p, max_tokens) for i, p in enumerate(prompts)]).result()
    return {"ttft": summary_ms([ttft_s(r) for r in records]),
            "itl": summary_ms([g for r in records for g in token_gaps(r["arrivals"])]),
            "server_first_token": summary_ms([r["timing"]["first_token_s"] for r in records])}


def run_in_process(prompts: list[list[int]], max_tokens: int) -> dict:
    from splitserve.common.sampling_params import SamplingParams
    from splitserve.engine.engine_core import EngineCore
    engine = EngineCore(serving_model(), cluster_config(serving_model(), "colocated").decode.engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ttfts, gaps = [], []
    for index, prompt in enumerate([prompts[0], *prompts]):  # the first is the warm-up
        engine.add_request(f"e{index}", prompt, params)
        started, last = time.perf_counter(), None
        while engine.has_work():
            deltas = engine.step()
            now = time.perf_counter()
            if not any(delta.new_token_ids for delta in deltas):
                continue
            if last is None and index:
                ttfts.append(now - started)
            elif index:
                gaps.append(now - last)
            last = now
    return {"ttft": summary_ms(ttfts), "itl": summary_ms(gaps)}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["in-process", *SETUPS]
    runs = {"in-process": report["in_process"], **report["cluster"]}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, title in ((axes[0], "ttft", "TTFT"), (axes[1], "itl", "per-token latency")):
        values = [runs[name][metric]["p50_ms"] for name in names]
        bars = ax.bar(names, values, color=["tab:gray", "tab:blue", "tab:red"])
        for bar, name in zip(bars, names):
            extra = "" if name == "in-process" else f"\n+{report['overhead_ms'][name][metric]:.2f}"
            ax.annotate(f"{bar.get_height():.2f}{extra}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=9)
        ax.set(ylabel="p50 ms", title=f"{title}: cluster vs in-process engine (one stream)",
               ylim=(0, 1.3 * max(values)))
    workload = report["workload"]
    fig.suptitle(f"model '{Path(serving_model()).name}', fp32, {workload['requests']} requests of {workload['prompt_tokens']} prompt "
                 f"tokens / {workload['max_tokens']} outputs, one at a time; 2 CPU cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = bench_parser(__doc__, "5 requests per setup, written to the temp directory", RESULTS)
    parser.add_argument("--requests", type=positive_int, default=30)
    parser.add_argument("--prompt-tokens", type=positive_int, default=128)
    parser.add_argument("--max-tokens", type=positive_int, default=64)
    args = parser.parse_args()
    from transformers import AutoConfig

    started = start_bench()
    vocab_size = AutoConfig.from_pretrained(serving_model()).vocab_size
    rng = random.Random(args.seed)
    num_requests = 5 if args.quick else args.requests
    prompts = [random_prompt(rng, args.prompt_tokens, vocab_size) for _ in range(num_requests)]
    report = {**report_header("bench/serve_overhead.py", args),
              "workload": {"requests": num_requests, "prompt_tokens": args.prompt_tokens,
                           "max_tokens": args.max_tokens}}
    report["in_process"] = run_in_process(prompts, args.max_tokens)
    report["cluster"] = {name: run_cluster(mode, overrides, prompts, args.max_tokens)
                         for name, (mode, overrides) in SETUPS.items()}
    report["overhead_ms"] = {name: {metric: run[metric]["p50_ms"] - report["in_process"][metric]["p50_ms"]
                                    for metric in ("ttft", "itl")} for name, run in report["cluster"].items()}
    report["wall_s"] = time.perf_counter() - started
    out_dir = write_report(report, "serve_overhead", args, RESULTS, plot)
    local = report["in_process"]
    print(f"\nin-process: TTFT p50 {local['ttft']['p50_ms']:.2f} ms, ITL p50 {local['itl']['p50_ms']:.2f} ms")
    for name, run in report["cluster"].items():
        overhead = report["overhead_ms"][name]
        print(f"{name:10s}: TTFT p50 {run['ttft']['p50_ms']:.2f} ms (+{overhead['ttft']:.2f}), "
              f"ITL p50 {run['itl']['p50_ms']:.2f} ms (+{overhead['itl']:.2f})")
    print(f"wrote {out_dir}/serve_overhead.json and .png in {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
