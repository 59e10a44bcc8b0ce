"""Quality of the embedded models through the engine (splitserve.eval): held-out perplexity, and
top-1 agreement and KL divergence of next-token distributions against the reference (the same
model in float32 through transformers), one row per (model, engine configuration).

Models: `default` (main) and `default-draft`, each under the engine in float32 and bfloat16, plus
a random-weight twin of each (same shape, tokenizer and initialization as its training started
from) for contrast. All are scored on the main model's held-out windows (the draft shares its
tokenizer, context length and held-out files). A configuration for quantization or speculative
decoding is one more EngineVariant in VARIANTS.

Writes bench/results/quality.json and .png. Run: .venv/bin/python bench/quality.py (about 2 minutes
on one thread; --max-windows N for a quick look, written to the temp directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

from splitserve.common.model_dir import DEFAULT_MODEL_NAME, DRAFT_MODEL_NAME
from splitserve.engine.tiny_model import resolve_model_path
from splitserve.engine.tiny_training import read_record
from splitserve.eval import EngineVariant, QualityResult, evaluate, heldout_windows, random_twin
from splitserve.eval.quality import corpus_matches_record

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
VARIANTS = (EngineVariant("engine-float32", dtype="float32"), EngineVariant("engine-bfloat16", dtype="bfloat16"))


def _rows(model_dir: Path, windows: torch.Tensor, label: str) -> list[dict]:
    results: list[QualityResult] = evaluate(model_dir, list(VARIANTS), windows, show_progress=sys.stderr.isatty())
    return [{**dataclasses.asdict(r), "model": label, "perplexity": r.perplexity} for r in results]


def measure(max_windows: int | None) -> dict:
    main_dir = resolve_model_path(DEFAULT_MODEL_NAME)
    windows = heldout_windows(main_dir, max_windows)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in (DEFAULT_MODEL_NAME, DRAFT_MODEL_NAME):
            model_dir = resolve_model_path(name)
            rows += _rows(model_dir, windows, name)
            rows += _rows(random_twin(model_dir, Path(scratch) / name), windows, f"{name} (random weights)")
    records = {name: read_record(resolve_model_path(name)) for name in (DEFAULT_MODEL_NAME, DRAFT_MODEL_NAME)}
    return {"rows": rows, "num_windows": len(windows), "context_len": windows.shape[1] - 1,
            "corpus_matches_training": corpus_matches_record(main_dir),
            "models": {name: {"num_parameters": r.num_parameters, "tokens_seen": r.tokens_seen,
                              "recorded_heldout_loss": r.heldout_loss, "train_time_s": r.train_time_s,
                              "threads": r.threads} for name, r in records.items()},
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()}}


def write_png(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    labels = [f"{r['model']}\n{r['variant']}" for r in rows]
    fig, (ppl_ax, kl_ax) = plt.subplots(1, 2, figsize=(15, 7))
    bars = ppl_ax.barh(labels, [r["perplexity"] for r in rows], color="tab:blue")
    ppl_ax.set_xscale("log")
    ppl_ax.bar_label(bars, [f"{r['perplexity']:.2f}" for r in rows], padding=3, fontsize=8)
    ppl_ax.set_xlabel("held-out perplexity (log scale; lower is better)")
    ppl_ax.invert_yaxis()
    bars = kl_ax.barh(labels, [r["kl_divergence"] for r in rows], color="tab:orange")
    kl_ax.bar_label(bars, [f"KL {r['kl_divergence']:.2e}, top-1 {r['top1_agreement']:.4f}" for r in rows],
                    padding=3, fontsize=8)
    kl_ax.set_xlabel("mean KL(reference || configuration), nats per token")
    kl_ax.set_yticks([])
    kl_ax.invert_yaxis()
    fig.suptitle(f"Embedded models on {report['num_windows']} held-out stdlib windows of "
                 f"{report['context_len']} tokens (reference: the model in float32 through transformers)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-windows", type=int, default=None, help="score only the first N windows (quick look)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the recorded run: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = measure(args.max_windows)
    out = RESULTS if args.max_windows is None else Path(tempfile.mkdtemp(prefix="quality-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps(report, indent=1) + "\n")
    write_png(report, out / "quality.png")
    for r in report["rows"]:
        print(f"{r['model']:<32} {r['variant']:<22} ppl {r['perplexity']:9.3f}  top-1 {r['top1_agreement']:.4f}  "
              f"KL {r['kl_divergence']:.2e}")
    print(f"wrote {out / 'quality.json'} and {out / 'quality.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
