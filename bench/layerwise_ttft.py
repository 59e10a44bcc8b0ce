"""Layer-wise vs whole-request KV transfer: TTFT, the time until the decode side's KV is ready,
and the first two tokens through the cluster's request path.

Two parts (`--parts`), on one model, the two modes alternating in one process.

pair: one prefill engine (the producer) and one consumer pool with its own transfer agent and thread
(splitserve.testing.layerwise_pair), in one process, for the in-process and the NIXL (UCX) backends.
Whole-request: the pull starts when the prompt's first token exists. Layer-wise: the blocks are
held as the final chunk's forward starts, each layer is announced as the forward writes it, and
the consumer thread READs it while the forward goes on. Per request:

- TTFT: admission -> the first token (the prefill step returned). The router streams this token
  from the prefill worker, so layer-wise transfer cannot change it (only overhead would show).
- KV ready: admission -> the consumer's pull is DONE (every layer READ and the generation check
  passed): from then on the decode worker can decode, so it bounds the second token.
- exposed pull: KV ready - first token, the part of the transfer the forward did not hide.

cluster: the real request path, an InProcessCluster (router orchestrator + 1 prefill + 1 decode
worker in this process, no Ray) per mode, `layerwise` (kv_transfer_layerwise) off and on, for the
in-process and the NIXL (UCX) backends; both clusters of a backend live for its whole part. Each
round sends every prompt length once to each cluster, the same new prompt to both (no prefix-cache
hit; the modes' greedy token ids must be equal, and every request of the layer-wise cluster must
have been pulled layer-wise). Per request, timed as the chunks come out of the router's
generate (this process's clock; the router's record would split a chunk of k tokens into k equal gaps):

- TTFT: router arrival -> the first token streamed (from the prefill worker).
- second token: router arrival -> the second token streamed (from the decode worker); with
  whole-request transfer it waits for the whole pull after the prefill, with layer-wise for what
  the forward did not hide plus the router's relay of the first token.
- first -> second: the gap between the two, which holds the decode worker's wait after the
  prefill ended and its first decode step. The prefill's end and the decode step's start are
  on two workers' threads and no record has them as instants, so they are not split.
- pull: the decode worker's pull time, from the router's RequestRecord (in layer-wise mode it
  spans the part of the forward it overlapped).

The model has a lot of KV per FLOP (16 layers, 8 KV heads of 32, fp32: 32 KiB per token) so the
transfer is a visible share of the prefill; the whole prompt is one chunk (layer-wise transfer
follows only the final chunk's forward). Modes alternate per prompt, every prompt is new (no
prefix-cache hit), the first round is a warm-up. Numbers from a shared 2-core machine are noisy:
compare the modes within one run only.

`--device cuda` puts both engines and their KV pools on the GPU (the NIXL backend registers them as VRAM, and
every layer announcement waits for a CUDA event recorded after the layer).

Writes bench/results/layerwise_ttft.json and .png (`--device cuda`: layerwise_ttft_cuda.*).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from serving_common import bench_parser, positive_int, report_header, start_bench, write_report
from splitserve.common.config import EngineConfig
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.stats import RequestRecord
from splitserve.engine.tiny_model import TinyModelSpec
from splitserve.kv_transfer import nixl_module
from splitserve.router.api_types import GenerationInput
from splitserve.testing.in_process_cluster import InProcessCluster
from splitserve.testing.layerwise_pair import LayerwisePair, PulledPrompt
from splitserve.testing.tiny_models import cached_tiny_model

SPEC = TinyModelSpec(arch="llama", num_layers=16, hidden_size=256, num_heads=8, num_kv_heads=8, vocab_size=2048,
                     seed=0)
BLOCK_SIZE = 16
RESULTS = Path(__file__).parent / "results"
MODES = ("whole", "layerwise")
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
"""Greedy, so the two modes' token ids must be equal; the first two tokens are timed."""


def engine_config(threads: int, max_prompt: int, device: str) -> EngineConfig:
    """fp32; the whole prompt in one chunk (the final chunk is the whole forward)."""
    max_model_len = min(max_prompt + 64, SPEC.max_position_embeddings)
    return EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=2 * -(-max_model_len // BLOCK_SIZE),
                        max_num_batched_tokens=max_model_len, max_model_len=max_model_len, dtype="float32",
                        device=device, num_threads=threads)


def _ms(values: list[float]) -> float:
    return round(1e3 * statistics.median(values), 3)


def _rounds(repeats: int, lengths: list[int]):
    """(round, length, modes in the order they run): the first round warms up, the order flips each round."""
    for index in range(repeats + 1):
        for length in lengths:
            yield index, length, MODES if index % 2 else MODES[::-1]


# ---- the transfer pair ----------------------------------------------------------------------
def run_pair(model_dir: Path, config: EngineConfig, backend: str, lengths: list[int], repeats: int,
             rng: random.Random) -> dict:
    samples: dict[str, dict[int, list[PulledPrompt]]] = {mode: {n: [] for n in lengths} for mode in MODES}
    pairs = {mode: LayerwisePair(model_dir, config, backend, layerwise=mode == "layerwise", threaded=True,
                                 consumer_blocks=config.num_kv_blocks) for mode in MODES}
    try:
        for index, length, modes in _rounds(repeats, lengths):
            for mode in modes:
                prompt = [rng.randrange(3, SPEC.vocab_size) for _ in range(length)]
                pulled = pairs[mode].prefill(f"{mode}-{length}-{index}", prompt, PARAMS)
                pairs[mode].forget(pulled)
                if index:
                    samples[mode][length].append(pulled)
    finally:
        for pair in pairs.values():
            pair.close()
    return {mode: [_pair_row(length, samples[mode][length]) for length in lengths] for mode in MODES}


def _pair_row(length: int, pulled: list[PulledPrompt]) -> dict:
    return {"prompt_tokens": length, "repeats": len(pulled),
            "ttft_ms": _ms([p.first_token_at - p.admitted_at for p in pulled]),
            "kv_ready_ms": _ms([p.kv_ready_at - p.admitted_at for p in pulled]),
            "exposed_pull_ms": _ms([p.kv_ready_at - p.first_token_at for p in pulled]),
            "kv_bytes": pulled[0].outcome.num_bytes}


# ---- the cluster's request path ---------------------------------------------------------------
@dataclass(frozen=True)
class ClusterSample:
    """One request through a cluster: its token ids, when its first two tokens came out of the router
    (seconds after it went in) and its pull as the router's record has it."""

    token_ids: tuple[int, ...]
    ttft_s: float
    second_token_s: float
    pull_s: float
    kv_bytes: int


class ClusterBench:
    """One InProcessCluster per mode on one transfer backend, live for the whole part; requests one at a
    time, each on idle workers."""

    def __init__(self, model_dir: Path, config: EngineConfig, backend: str) -> None:
        self.model_dir, self.config, self.backend = model_dir, config, backend
        self.records: dict[str, RequestRecord] = {}

    def _observe(self, record: RequestRecord) -> None:
        self.records[record.request_id] = record

    def cluster(self, mode: str) -> InProcessCluster:
        return InProcessCluster(self.model_dir, layerwise=mode == "layerwise", engine_config=self.config,
                                transfer_backend=self.backend, observer=self._observe)

    async def send(self, cluster: InProcessCluster, request_id: str, prompt: list[int]) -> ClusterSample:
        """The request through the router, timed as its chunks come out (the router's record counts a chunk
        of k tokens as k equal gaps, so the second token's time is taken here)."""
        token_ids, arrivals = [], []
        sent = time.monotonic()
        async for chunk in cluster.orchestrator.generate(GenerationInput(request_id, tuple(prompt), PARAMS)):
            arrivals += [time.monotonic() - sent] * len(chunk.token_ids)
            token_ids += chunk.token_ids
        await cluster.wait_idle(timeout_s=60.0)
        record = self.records.pop(request_id)
        if record.finish_reason != "length" or record.prefill_worker is None or record.kv_transfer is None \
                or record.kv_transfer.failed:
            raise AssertionError(f"{request_id} did not go prefill -> pull -> decode: {record}")
        return ClusterSample(tuple(token_ids), arrivals[0], arrivals[1], record.kv_transfer.seconds,
                             record.kv_transfer.num_bytes)

    async def run(self, lengths: list[int], repeats: int, rng: random.Random) -> dict:
        samples: dict[str, dict[int, list[ClusterSample]]] = {mode: {n: [] for n in lengths} for mode in MODES}
        async with self.cluster("whole") as whole, self.cluster("layerwise") as layerwise:
            clusters = {"whole": whole, "layerwise": layerwise}
            for index, length, modes in _rounds(repeats, lengths):
                prompt = [rng.randrange(3, SPEC.vocab_size) for _ in range(length)]
                sent = {mode: await self.send(clusters[mode], f"{mode}-{length}-{index}", prompt) for mode in modes}
                if sent["whole"].token_ids != sent["layerwise"].token_ids:
                    raise AssertionError(f"{self.backend}, {length} tokens, round {index}: whole-request output "
                                         f"{sent['whole'].token_ids} != layer-wise {sent['layerwise'].token_ids}")
                if index:
                    for mode in MODES:
                        samples[mode][length].append(sent[mode])
            pulls = {mode: (await clusters[mode].decode_workers[0].stats()).num_layerwise_pulls for mode in MODES}
        num_requests = (repeats + 1) * len(lengths)
        if pulls != {"whole": 0, "layerwise": num_requests}:
            raise AssertionError(f"{self.backend}: layer-wise pulls {pulls}, expected 0 and {num_requests}")
        return {mode: [_cluster_row(length, samples[mode][length]) for length in lengths] for mode in MODES}


def _cluster_row(length: int, sent: list[ClusterSample]) -> dict:
    return {"prompt_tokens": length, "repeats": len(sent),
            "ttft_ms": _ms([s.ttft_s for s in sent]),
            "second_token_ms": _ms([s.second_token_s for s in sent]),
            "first_to_second_ms": _ms([s.second_token_s - s.ttft_s for s in sent]),
            "pull_ms": _ms([s.pull_s for s in sent]),
            "kv_bytes": sent[0].kv_bytes}


# ---- report -------------------------------------------------------------------------------------
def plot(report: dict, path: Path) -> None:
    """One column per pair backend (TTFT and KV ready; the pull left after the first token) and one per
    cluster backend (TTFT and second token; first -> second token)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f"pair, {backend} backend", modes, ("kv_ready_ms", "KV ready"),
               ("exposed_pull_ms", "KV ready - first token")) for backend, modes in report.get("pair", {}).items()]
    panels += [(f"cluster (router + 1P + 1D), {backend} backend", modes, ("second_token_ms", "second token"),
                ("first_to_second_ms", "second token - first token"))
               for backend, modes in report.get("cluster", {}).items()]
    fig, axes = plt.subplots(2, len(panels), figsize=(5.5 * len(panels), 7), squeeze=False)
    for column, (title, modes, (late_key, late_label), (gap_key, gap_label)) in enumerate(panels):
        top, bottom = axes[0][column], axes[1][column]
        for mode, style in zip(MODES, ("s--", "o-")):
            rows = modes[mode]
            lengths = [row["prompt_tokens"] for row in rows]
            top.plot(lengths, [row[late_key] for row in rows], style, label=f"{mode}: {late_label}")
            top.plot(lengths, [row["ttft_ms"] for row in rows], style, alpha=0.4, label=f"{mode}: TTFT")
            bottom.plot(lengths, [row[gap_key] for row in rows], style, label=mode)
        top.set(xlabel="prompt tokens", ylabel="ms (median)", title=title)
        top.set_ylim(bottom=0)
        top.legend(fontsize=8)
        bottom.axhline(0.0, color="tab:gray", linewidth=0.8)
        bottom.set(xlabel="prompt tokens", ylabel=f"{gap_label}, ms (median)")
        bottom.legend(fontsize=8)
    fig.suptitle(f"layer-wise vs whole-request KV transfer ({report.get('device', 'cpu')})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_rows(report: dict) -> None:
    for backend, modes in report.get("pair", {}).items():
        for mode, rows in modes.items():
            for row in rows:
                print(f"pair {backend:9s} {mode:9s} {row['prompt_tokens']:5d} tokens: TTFT {row['ttft_ms']:8.2f} ms, "
                      f"KV ready {row['kv_ready_ms']:8.2f} ms, exposed pull {row['exposed_pull_ms']:7.2f} ms")
    for backend, modes in report.get("cluster", {}).items():
        for mode, rows in modes.items():
            for row in rows:
                print(f"cluster {backend:9s} {mode:9s} {row['prompt_tokens']:5d} tokens: "
                      f"TTFT {row['ttft_ms']:8.2f} ms, second token {row['second_token_ms']:8.2f} ms, "
                      f"first->second {row['first_to_second_ms']:7.2f} ms, pull {row['pull_ms']:7.2f} ms")


def main() -> None:
    parser = bench_parser(__doc__, "lengths 256 and 1024, 1 repeat, written to the temp directory", RESULTS)
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=[256, 1024, 2000])
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads of each engine")
    parser.add_argument("--backends", nargs="+", default=["inprocess", "nixl"], help="KV transfer backends")
    parser.add_argument("--parts", nargs="+", choices=["pair", "cluster"], default=["pair", "cluster"])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both engines run")
    args = parser.parse_args()
    lengths, repeats = ([256, 1024], 1) if args.quick else (args.lengths, args.repeats)
    start_bench()
    backends = [b for b in args.backends if b != "nixl" or nixl_module() is not None]
    model_dir = cached_tiny_model(SPEC)
    rng = random.Random(args.seed)
    report = report_header("bench/layerwise_ttft.py", args)
    report["model"] = {"num_layers": SPEC.num_layers, "hidden_size": SPEC.hidden_size,
                       "num_kv_heads": SPEC.num_kv_heads, "head_dim": SPEC.hidden_size // SPEC.num_heads,
                       "dtype": "float32", "block_size": BLOCK_SIZE}
    report["threads"], report["lengths"], report["repeats"] = args.threads, lengths, repeats
    report["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    config = engine_config(args.threads, max(lengths), args.device)
    if "pair" in args.parts:
        report["pair"] = {backend: run_pair(model_dir, config, backend, lengths, repeats, rng) for backend in backends}
    if "cluster" in args.parts:
        report["cluster"] = {backend: asyncio.run(ClusterBench(model_dir, config, backend).run(lengths, repeats, rng))
                             for backend in backends}
    name = "layerwise_ttft" if args.device == "cpu" else f"layerwise_ttft_{args.device}"
    out_dir = write_report(report, name, args, RESULTS, plot)
    print_rows(report)
    print(f"wrote {out_dir}/{name}.json and .png")


if __name__ == "__main__":
    main()
