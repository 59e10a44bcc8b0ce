"""Serving latency through the whole cluster (gRPC -> router -> Ray -> workers, KV over NIXL).

Three parts, on the bench model of engine_throughput.py (31M Llama, fp32, 16-token blocks),
every worker a Ray actor with one torch thread and 0.5 Ray CPUs:

1. TTFT breakdown (disaggregated 1P+1D): one request at a time, fresh random prompts of
   64..2046 tokens (2046 = max_model_len 2048 minus the 2 outputs), max_tokens 2. From the
   final response's timing: queue, prefill, first-token return, KV transfer, and what is left
   until the second token (decode handoff + first decode step + stream back). The first token
   comes from the prefill worker, so the pull sits between the first and second token, not in
   TTFT; transfer is reported against both.
2. Interference: 8 closed-loop streams of short prompts (32-128 tokens, 96-160 outputs) while
   long prompts (1024-1984 tokens, 16 outputs) arrive as a Poisson process (fixed seed), on
   disaggregated 1P+1D and on colocated 2 decode workers, same requests and arrival times.
   Client-side TTFT per class and ITL per token (a message carrying k tokens after a gap g
   counts k tokens of g/k).
3. Streaming overhead at batch 1: per-token latency of one 64-token prompt through the cluster
   vs an in-process EngineCore with the decode pool's engine config, alternating rounds in this
   process.

The load generator runs in a spawned process (its own GIL, like a real client); it imports
only grpc, the generated code and the torch-free client, so heavy imports in this file live
inside the functions that run in the parent.

Writes bench/results/serving_latency.json and .png (a --quick run writes them to the temp
directory instead, so a smoke run never replaces the full results).
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import random
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from serving_common import (MS, Cluster, ForeignCpu, bench_parser, client_sequential, cluster_config,
                            load_recorder, random_prompt, report_header, start_bench, stream_one, summary_ms,
                            token_gaps, ttft_s, warn_noisy_parts, with_stub, write_report)

RESULTS = Path(__file__).parent / "results"

TTFT_PROMPT_LENS = (64, 128, 256, 512, 1024, 2046)
"""2046, not 2048: the bench model's max_model_len is 2048 and a request needs its 2 outputs."""
SHORT_STAGGER_S = 0.25
"""Short stream i starts at i * SHORT_STAGGER_S."""


@dataclass(frozen=True)
class Sizes:
    """How much of each part to run (--quick shrinks everything)."""

    ttft_reps: int
    short_streams: int
    short_per_stream: int
    short_max_tokens: int
    num_long: int
    long_rate_per_s: float
    long_max_tokens: int
    batch1_rounds: int
    batch1_max_tokens: int


FULL = Sizes(ttft_reps=5, short_streams=8, short_per_stream=4, short_max_tokens=128, num_long=8,
             long_rate_per_s=0.35, long_max_tokens=16, batch1_rounds=5, batch1_max_tokens=128)
QUICK = Sizes(ttft_reps=1, short_streams=8, short_per_stream=1, short_max_tokens=64, num_long=3,
              long_rate_per_s=0.8, long_max_tokens=8, batch1_rounds=2, batch1_max_tokens=64)


# ---- the load generator (runs in the spawned client process) -------------------------------
def client_interference(port: int, shorts: list[list[tuple[str, list[int], int]]],
                        longs: list[tuple[float, str, list[int], int]]) -> list[dict]:
    """Each short stream runs its requests back to back; each long one starts at its arrival time."""
    async def short_stream(stub, origin, start_s, requests):
        await asyncio.sleep(start_s)
        return [await stream_one(stub, rid, "short", ids, n, origin) for rid, ids, n in requests]

    async def long_request(stub, origin, arrival_s, rid, ids, n):
        await asyncio.sleep(max(0.0, arrival_s - (time.perf_counter() - origin)))
        return [await stream_one(stub, rid, "long", ids, n, origin)]

    async def body(stub):
        origin = time.perf_counter()
        tasks = [short_stream(stub, origin, SHORT_STAGGER_S * index, s) for index, s in enumerate(shorts)]
        tasks += [long_request(stub, origin, *item) for item in longs]
        return [record for group in await asyncio.gather(*tasks) for record in group]

    return asyncio.run(with_stub(port, body))


# ---- part 1: TTFT breakdown -------------------------------------------------------------
def run_ttft(client: ProcessPoolExecutor, port: int, engine, sizes: Sizes, vocab_size: int,
             seed: int) -> list[dict]:
    """Each prompt goes through the cluster, then through `engine` (an in-process EngineCore with
    the prefill pool's config) for reference: its first step is the prefill, its second the first
    decode step."""
    rng = random.Random(seed)
    warmup = random_prompt(rng, 256, vocab_size)
    client.submit(client_sequential, port, [("warmup", "warmup", warmup, 2)]).result()  # + the NIXL handshake
    engine_arrivals(engine, "warmup", warmup, 2)
    records = []
    for rep in range(sizes.ttft_reps):
        for length in TTFT_PROMPT_LENS:
            prompt = random_prompt(rng, length, vocab_size)
            record = client.submit(client_sequential, port, [(f"ttft-{length}-{rep}", "ttft", prompt, 2)]).result()[0]
            (prefill_s, _), (second_s, _) = engine_arrivals(engine, f"engine-{length}-{rep}", prompt, 2)
            record["in_process"] = {"prefill_s": prefill_s, "decode_step_s": second_s - prefill_s}
            records.append(record)
    return records


def ttft_rows(records: list[dict], kv_bytes_per_block: int, block_size: int) -> list[dict]:
    """Medians per prompt length of the response timings and what is derived from them."""
    rows = []
    for length in TTFT_PROMPT_LENS:
        group = [r for r in records if r["prompt_tokens"] == length]
        timings = [r["timing"] for r in group]
        median = lambda fn: statistics.median(fn(r, t) for r, t in zip(group, timings))  # noqa: E731
        kv_bytes = math.ceil(length / block_size) * kv_bytes_per_block
        row = {"prompt_tokens": length, "n": len(group), **{key: median(lambda r, t: t[key]) for key in timings[0]}}
        row.update({
            "first_token_return_s": median(lambda r, t: t["first_token_s"] - t["queue_s"] - t["prefill_s"]),
            "handoff_decode_stream_s": median(lambda r, t: t["total_s"] - t["first_token_s"] - t["transfer_s"]),
            "client_ttft_s": median(lambda r, t: ttft_s(r)),
            "client_second_token_s": median(lambda r, t: r["arrivals"][1][0] - r["sent_s"]),
            "transfer_share_of_second_token": median(lambda r, t: t["transfer_s"] / t["total_s"]),
            "transfer_over_ttft": median(lambda r, t: t["transfer_s"] / t["first_token_s"]),
            "in_process_prefill_s": median(lambda r, t: r["in_process"]["prefill_s"]),
            "in_process_decode_step_s": median(lambda r, t: r["in_process"]["decode_step_s"]),
            "kv_bytes": kv_bytes, "cached_tokens": sum(r["cached_tokens"] for r in group)})
        row["transfer_gb_per_s"] = kv_bytes / row["transfer_s"] / 1e9
        rows.append(row)
    return rows


# ---- part 2: interference ---------------------------------------------------------------
def interference_workload(sizes: Sizes, vocab_size: int, seed: int) -> tuple[list, list]:
    """Short outputs vary by +-25% around short_max_tokens so the streams drift apart instead of
    arriving in bursts of 8."""
    rng = random.Random(seed)
    low, high = round(0.75 * sizes.short_max_tokens), round(1.25 * sizes.short_max_tokens)
    shorts = [[(f"short-{s}-{i}", random_prompt(rng, rng.randint(32, 128), vocab_size), rng.randint(low, high))
               for i in range(sizes.short_per_stream)] for s in range(sizes.short_streams)]
    longs, arrival = [], 1.0  # the first long prompt comes once the short streams are decoding
    for index in range(sizes.num_long):
        arrival += rng.expovariate(sizes.long_rate_per_s)
        longs.append((arrival, f"long-{index}", random_prompt(rng, rng.randint(1024, 1984), vocab_size),
                      sizes.long_max_tokens))
    return shorts, longs


def prefill_windows(records: list[dict]) -> list[tuple[float, float]]:
    """[sent, first token] of every long request: when a long prompt was being prefilled."""
    return [(r["sent_s"], r["arrivals"][0][0]) for r in records if r["class"] == "long"]


def gaps_during(records: list[dict], windows: list[tuple[float, float]]) -> list[float]:
    """Short-class per-token latencies whose gap overlaps a long prefill window."""
    gaps = []
    for record in (r for r in records if r["class"] == "short"):
        arrivals = record["arrivals"]
        for index in range(1, len(arrivals)):
            start, end, count = arrivals[index - 1][0], arrivals[index][0], arrivals[index][1]
            if any(start < w_end and end > w_start for w_start, w_end in windows):
                gaps += [(end - start) / count] * count
    return gaps


def interference_stats(records: list[dict], seconds: float) -> dict:
    stats = {"makespan_s": seconds, "output_tokens": sum(r["completion_tokens"] for r in records),
             "multi_token_messages": sum(1 for r in records for _, k in r["arrivals"] if k > 1),
             "messages": sum(len(r["arrivals"]) for r in records)}
    stats["output_tokens_per_s"] = stats["output_tokens"] / seconds
    for klass in ("short", "long"):
        group = [r for r in records if r["class"] == klass]
        stats[klass] = {"requests": len(group), "ttft": summary_ms([ttft_s(r) for r in group]),
                        "itl": summary_ms([g for r in group for g in token_gaps(r["arrivals"])]),
                        "itl_after_second_token": summary_ms([g for r in group for g in token_gaps(r["arrivals"], 1)]),
                        "first_to_second_token": summary_ms([r["arrivals"][1][0] - r["arrivals"][0][0]
                                                             for r in group if len(r["arrivals"]) > 1])}
    stats["short"]["itl_during_long_prefill"] = summary_ms(gaps_during(records, prefill_windows(records)))
    return stats


def run_interference(client: ProcessPoolExecutor, port: int, workload: tuple[list, list]) -> tuple[list, float]:
    started = time.perf_counter()
    records = client.submit(client_interference, port, *workload).result()
    return records, time.perf_counter() - started


# ---- part 3: streaming overhead at batch 1 -------------------------------------------------
def engine_arrivals(engine, request_id: str, prompt: list[int], max_tokens: int) -> list[tuple[float, int]]:
    """Token arrival times of one request stepped alone on an in-process EngineCore."""
    from splitserve.common.sampling_params import SamplingParams

    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    origin, arrivals = time.perf_counter(), []
    while engine.has_unfinished_requests():
        deltas = engine.step()
        now = time.perf_counter()
        arrivals += [(now - origin, len(d.new_token_ids)) for d in deltas if d.new_token_ids]
    return arrivals


def run_batch1(client: ProcessPoolExecutor, port: int, engine, sizes: Sizes, vocab_size: int, seed: int) -> dict:
    """Alternating rounds: one request through the cluster, the same prompt on the in-process engine.
    Both skip the first gap (cluster: the decode handoff + KV pull; engine: the first decode step)."""
    rng = random.Random(seed)
    engine_arrivals(engine, "warmup", random_prompt(rng, 64, vocab_size), 4)
    cluster_gaps, engine_gaps, handoffs = [], [], []
    for index in range(sizes.batch1_rounds):
        prompt = random_prompt(rng, 64, vocab_size)
        record = client.submit(client_sequential, port,
                               [(f"batch1-{index}", "batch1", prompt, sizes.batch1_max_tokens)]).result()[0]
        cluster_gaps += token_gaps(record["arrivals"], skip=1)
        handoffs.append(record["arrivals"][1][0] - record["arrivals"][0][0])
        engine_gaps += token_gaps(engine_arrivals(engine, f"engine-{index}", prompt, sizes.batch1_max_tokens), skip=1)
    cluster, local = summary_ms(cluster_gaps), summary_ms(engine_gaps)
    return {"prompt_tokens": 64, "max_tokens": sizes.batch1_max_tokens, "rounds": sizes.batch1_rounds,
            "cluster": cluster, "in_process": local, "cluster_first_to_second_token": summary_ms(handoffs),
            "overhead_p50_ms": cluster["p50_ms"] - local["p50_ms"],
            "overhead_p99_ms": cluster["p99_ms"] - local["p99_ms"],
            "cluster_gaps_ms": [MS * g for g in cluster_gaps], "in_process_gaps_ms": [MS * g for g in engine_gaps]}


# ---- report -----------------------------------------------------------------------------
def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [1.3, 1.2, 1]})
    plot_ttft(axes[0], report["ttft_breakdown"]["rows"])
    plot_interference(axes[1], report["interference"]["modes"])
    plot_batch1(axes[2], report["streaming_overhead"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_ttft(ax, rows: list[dict]) -> None:
    """Each bar is one prompt length's time to the second token (the first decoded one): its phases'
    medians as shares of their sum (the median total is annotated)."""
    parts = [("queue_s", "queue + prefill RPC", "tab:gray"), ("prefill_s", "prefill (to first token)", "tab:blue"),
             ("first_token_return_s", "first token back to router", "tab:cyan"),
             ("transfer_s", "KV transfer (NIXL READ)", "tab:red"),
             ("handoff_decode_stream_s", "decode handoff + 1st decode step + stream", "tab:orange")]
    labels = [str(r["prompt_tokens"]) for r in rows]
    bottom = [0.0] * len(rows)
    sums = [sum(r[key] for key, _, _ in parts) for r in rows]
    for key, label, color in parts:
        values = [100 * r[key] / total for r, total in zip(rows, sums)]
        ax.bar(labels, values, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    for index, row in enumerate(rows):
        ax.annotate(f"TTFT {MS * row['first_token_s']:.0f} ms\n2nd {MS * row['total_s']:.0f} ms\n"
                    f"xfer {MS * row['transfer_s']:.1f} ms", (index, 100), ha="center", va="bottom", fontsize=7)
    ax.set(ylim=(0, 128), xlabel="prompt tokens", ylabel="% of time to 2nd token (phase medians)",
           title="1P+1D: where the time to the first two tokens goes")
    ax.legend(fontsize=7, loc="lower left", framealpha=0.9)


def plot_interference(ax, modes: dict) -> None:
    metrics = [("short", "itl", "p50"), ("short", "itl", "p99"), ("short", "ttft", "p50"), ("short", "ttft", "p99"),
               ("long", "ttft", "p50"), ("long", "ttft", "p99")]
    labels = [f"{k} {m.upper()}\n{p}" for k, m, p in metrics]
    width = 0.38
    modes_colors = (("disaggregated", "tab:red"), ("colocated", "tab:blue"))
    for offset, (mode, color) in zip((-width / 2, width / 2), modes_colors):
        values = [modes[mode][k][m][f"{p}_ms"] for k, m, p in metrics]
        xs = [i + offset for i in range(len(metrics))]
        ax.bar(xs, values, width, label=mode, color=color)
        for x, v in zip(xs, values):
            ax.annotate(f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(metrics)), labels, fontsize=8)
    ax.set(yscale="log", ylabel="ms (log scale)", title="interference: 8 short streams + Poisson long prompts")
    ax.legend(fontsize=8)


def plot_batch1(ax, result: dict) -> None:
    for key, label, color in (("cluster_gaps_ms", "full cluster (gRPC, router, Ray)", "tab:red"),
                              ("in_process_gaps_ms", "in-process EngineCore", "tab:blue")):
        values = sorted(result[key])
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label, color=color)
    ax.set(xlabel="per-token latency (ms)", ylabel="fraction of tokens",
           title=f"batch 1 ITL: +{result['overhead_p50_ms']:.1f} ms p50, +{result['overhead_p99_ms']:.1f} ms p99")
    ax.legend(fontsize=8, loc="lower right")


def print_summary(report: dict) -> None:
    print("\n1) TTFT breakdown, 1P+1D (median ms)")
    print(f"{'prompt':>6} {'queue':>6} {'prefill':>8} {'(local)':>8} {'TTFT':>7} {'xfer':>6} {'GB/s':>5} "
          f"{'handoff':>8} {'(step)':>7} {'2nd tok':>8} {'xfer/2nd':>8} {'xfer/TTFT':>9}")
    for r in report["ttft_breakdown"]["rows"]:
        print(f"{r['prompt_tokens']:6d} {MS * r['queue_s']:6.1f} {MS * r['prefill_s']:8.1f} "
              f"{MS * r['in_process_prefill_s']:8.1f} {MS * r['first_token_s']:7.1f} {MS * r['transfer_s']:6.1f} "
              f"{r['transfer_gb_per_s']:5.2f} {MS * r['handoff_decode_stream_s']:8.1f} "
              f"{MS * r['in_process_decode_step_s']:7.1f} {MS * r['total_s']:8.1f} "
              f"{100 * r['transfer_share_of_second_token']:7.1f}% {100 * r['transfer_over_ttft']:8.1f}%")
    print("  (local) = the same prompt's prefill on an in-process engine; handoff = 2nd token - TTFT - xfer;\n"
          "  (step) = its first decode step in-process")
    print("\n2) interference (ms): short ITL p50/p99, short TTFT p50/p99, long TTFT p50/p99, tokens/s")
    for mode, s in report["interference"]["modes"].items():
        print(f"{mode:14s} {s['short']['itl']['p50_ms']:6.1f} / {s['short']['itl']['p99_ms']:6.1f}  "
              f"{s['short']['ttft']['p50_ms']:6.0f} / {s['short']['ttft']['p99_ms']:6.0f}  "
              f"{s['long']['ttft']['p50_ms']:6.0f} / {s['long']['ttft']['p99_ms']:6.0f}  "
              f"{s['output_tokens_per_s']:6.1f}")
    b = report["streaming_overhead"]
    print(f"\n3) batch-1 ITL: cluster {b['cluster']['p50_ms']:.2f} / {b['cluster']['p99_ms']:.2f} ms, in-process "
          f"{b['in_process']['p50_ms']:.2f} / {b['in_process']['p99_ms']:.2f} ms (p50 / p99): overhead "
          f"{b['overhead_p50_ms']:+.2f} / {b['overhead_p99_ms']:+.2f} ms")
    warn_noisy_parts(report["load"])


# ---- main -------------------------------------------------------------------------------
def run_disaggregated(client, model_dir, sizes, workload, vocab_size, seed, report, part) -> list[dict]:
    from splitserve.engine.engine_core import EngineCore

    # "always": the router's default ("auto") would prefill short prompts on the decode worker,
    # and this part measures the disaggregated path (prefill worker -> NIXL pull -> decode).
    config = cluster_config(model_dir, "disaggregated", **{"router.routing.disaggregation": "always"})
    report["config"]["disaggregated"] = asdict(config)
    with Cluster(config) as (cluster, loop):
        with part("ttft_breakdown"):
            engine = EngineCore(model_dir, config.prefill.engine)
            ttft_records = run_ttft(client, cluster.port, engine, sizes, vocab_size, seed)
            del engine
        loop.run(cluster.wait_idle())
        with part("streaming_overhead"):
            engine = EngineCore(model_dir, config.decode.engine)
            report["model_parameters"] = sum(p.numel() for p in engine.model.parameters())
            report["streaming_overhead"] = run_batch1(client, cluster.port, engine, sizes, vocab_size, seed + 1)
            del engine
        with part("interference_disaggregated"):
            records, seconds = run_interference(client, cluster.port, workload)
        loop.run(cluster.wait_idle())
    report["interference"]["modes"]["disaggregated"] = interference_stats(records, seconds)
    report["interference"]["requests"]["disaggregated"] = records
    return ttft_records


def run_colocated(client, model_dir, workload, report, part) -> None:
    config = cluster_config(model_dir, "colocated", num_decode=2)
    report["config"]["colocated"] = asdict(config)
    with Cluster(config) as (cluster, loop):
        client.submit(client_sequential, cluster.port, [("warmup", "warmup", list(range(3, 259)), 2)]).result()
        with part("interference_colocated"):
            records, seconds = run_interference(client, cluster.port, workload)
        loop.run(cluster.wait_idle())
    report["interference"]["modes"]["colocated"] = interference_stats(records, seconds)
    report["interference"]["requests"]["colocated"] = records


def main() -> None:
    args = bench_parser(__doc__, "a ~2 minute smoke run", RESULTS).parse_args()
    from engine_throughput import BENCH_SPEC, bench_model_dir

    started = start_bench()
    sizes = QUICK if args.quick else FULL
    model_dir = bench_model_dir()
    vocab = BENCH_SPEC.vocab_size
    head_dim = BENCH_SPEC.hidden_size // BENCH_SPEC.num_heads
    kv_bytes_per_block = BENCH_SPEC.num_layers * 2 * 16 * BENCH_SPEC.num_kv_heads * head_dim * 4
    workload = interference_workload(sizes, vocab, args.seed + 2)
    report = {**report_header("bench/serving_latency.py", args), "model": asdict(BENCH_SPEC),
              "sizes": asdict(sizes), "config": {},
              "interference": {"workload": {
                  "short": {"streams": sizes.short_streams, "requests_per_stream": sizes.short_per_stream,
                            "prompt_tokens": [32, 128], "stagger_s": SHORT_STAGGER_S,
                            "max_tokens": [round(0.75 * sizes.short_max_tokens), round(1.25 * sizes.short_max_tokens)]},
                  "long": {"requests": sizes.num_long, "poisson_rate_per_s": sizes.long_rate_per_s,
                           "prompt_tokens": [1024, 1984], "max_tokens": sizes.long_max_tokens,
                           "arrivals_s": [a for a, *_ in workload[1]]}}, "modes": {}, "requests": {}}}
    foreign = ForeignCpu()
    part = load_recorder(report, foreign)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as client:
        ttft_records = run_disaggregated(client, model_dir, sizes, workload, vocab, args.seed, report, part)
        run_colocated(client, model_dir, workload, report, part)
    foreign.stop()
    report["load"]["foreign_cpu_s_whole_run"] = foreign.total_s
    report["ttft_breakdown"] = {"max_tokens": 2, "repetitions": sizes.ttft_reps,
                                "kv_bytes_per_block": kv_bytes_per_block,
                                "rows": ttft_rows(ttft_records, kv_bytes_per_block, 16), "requests": ttft_records}
    report["wall_s"] = time.perf_counter() - started
    out_dir = write_report(report, "serving_latency", args, RESULTS, plot)
    print_summary(report)
    print(f"\nwrote {out_dir}/serving_latency.json and .png in {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
