"""bench/serve_compare.py's reading of aiperf's JSON export (profile_export_aiperf.json).

The fixtures are trimmed copies of real exports of aiperf 0.13.0 against splitserve's OpenAI API
(streamed chat, --use-server-token-count, --goodput): one from the benchmark's run, one where two of
twelve requests were rejected with 400 (prompts over max_model_len)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(REPO / "bench"))

from serve_compare import AiperfResult, parse_export  # noqa: E402


def load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_parse_export_of_the_benchmark_run():
    """bench/results/serve_compare.json's disaggregated run: no request failed, so the export has
    no error_request_count."""
    assert parse_export(load("aiperf_export_splitserve.json")) == AiperfResult(
        ttft_p50_ms=419.5371295, ttft_p99_ms=751.5466959499998, itl_p50_ms=18.623380944444442,
        itl_p99_ms=21.967060515238085, chunk_gap_p50_ms=17.988201999999998, chunk_gap_p99_ms=48.55235571999998,
        output_tokens_per_s=333.9722322240477, requests_per_s=5.218316128500745,
        goodput_requests_per_s=1.878593806260268, good_fraction=0.36, successful_requests=200, failed_requests=0,
        input_tokens_mean=269.0, output_tokens_mean=64.0, duration_s=38.321530112000005,
        ttft_percentiles_ms=((1, 70.5126664), (5, 96.40161205), (10, 119.17090110000001), (25, 160.494995),
                             (50, 419.5371295), (75, 525.92832425), (90, 623.2447562), (95, 673.4634756499988),
                             (99, 751.5466959499998)),
        started_at="2026-11-23T13:59:39.137181", ended_at="2026-11-23T14:00:17.463720")


def test_parse_export_with_failed_requests():
    assert parse_export(load("aiperf_export_with_errors.json")) == AiperfResult(
        ttft_p50_ms=2019.4681355, ttft_p99_ms=2729.63240765, itl_p50_ms=31.137443700000002, itl_p99_ms=148.2995205,
        chunk_gap_p50_ms=28.039498, chunk_gap_p99_ms=98.91314942000001, output_tokens_per_s=23.889495773657938,
        requests_per_s=1.4930934858536211, goodput_requests_per_s=0.5972373943414484,
        good_fraction=0.3333333333333333, successful_requests=10, failed_requests=2, input_tokens_mean=1974.5,
        output_tokens_mean=16.0, duration_s=6.689303552,
        ttft_percentiles_ms=((1, 628.31396918), (5, 653.8294738999999), (10, 685.7238547999999),
                             (25, 988.0204897499999), (50, 2019.4681355), (75, 2555.5527522499997),
                             (90, 2729.6187065), (95, 2729.6263182499997), (99, 2729.63240765)),
        started_at="2026-11-23T13:33:28.558915", ended_at="2026-11-23T13:33:35.256419")


def test_parse_export_names_a_missing_metric():
    export = load("aiperf_export_with_errors.json")
    del export["inter_token_latency"]  # what a run without --streaming exports
    with pytest.raises(ValueError, match="aiperf export has no 'inter_token_latency' metric \\(aiperf 0.13.0;"):
        parse_export(export)
