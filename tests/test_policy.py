"""Routing and admission policy replayed on typed observations: exact choices, both sides of each boundary.

Per-token costs are powers of two, so every predicted TTFT below is exact in floating point.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.router.policy import (DISAGGREGATION_MODES, ROUTING_POLICIES, DecodeCandidate, PrefillCandidate,
                                      Rejection, RouteDecision, RoutingConfig, RoutingRequest, decode_score,
                                      predicted_ttft_s, route, route_prefill_only)

S = 2.0 ** -10  # seconds per prompt token
CONFIG = RoutingConfig(default_prefill_s_per_token=S)


def prefill(worker_id: str, cached: int = 0, queued: int = 0, s_per_token: float | None = None,
            in_flight: int = 0) -> PrefillCandidate:
    return PrefillCandidate(worker_id, cached, queued, s_per_token, in_flight)


def decode(worker_id: str, cached: int = 0, queued: int = 0, s_per_token: float | None = None, running: int = 0,
           max_num_seqs: int = 8, free: int = 100, total: int = 100, in_flight: int = 0) -> DecodeCandidate:
    return DecodeCandidate(worker_id, cached, queued, s_per_token, running, max_num_seqs, free, total, in_flight)


def request(prompt: int = 1000, blocks: int = 10, slo: float | None = None) -> RoutingRequest:
    return RoutingRequest(prompt, blocks, slo)


def config(**fields) -> RoutingConfig:
    return RoutingConfig(**{"default_prefill_s_per_token": S, **fields})


def choice(result: RouteDecision | Rejection) -> tuple[str | None, str, str]:
    assert isinstance(result, RouteDecision), result
    return result.prefill_worker_id, result.decode_worker_id, result.reason


# ---- the cost model ---------------------------------------------------------------------------

def test_predicted_ttft_counts_uncached_and_queued_tokens_at_the_measured_or_default_cost():
    assert predicted_ttft_s(request(1000), prefill("p", cached=800, queued=300), CONFIG) == 500 * S
    assert predicted_ttft_s(request(1000), prefill("p", cached=800, queued=300, s_per_token=2 * S), CONFIG) == 1000 * S
    # The engine computes at least the last prompt token, however much is cached.
    assert predicted_ttft_s(request(1000), prefill("p", cached=1000), CONFIG) == 1 * S
    assert predicted_ttft_s(request(1000), prefill("p", cached=5000), CONFIG) == 1 * S


@pytest.mark.parametrize("queued, turn, winner", [
    (799, 0, "p0"), (799, 1, "p0"),  # 200 + 799 < 1000: the cache hit is worth its queue
    (800, 0, "p0"), (800, 1, "p1"),  # 200 + 800 == 1000: an exact tie goes round-robin
    (801, 0, "p1"), (801, 1, "p1"),  # 200 + 801 > 1000: the idle worker is sooner
])
def test_a_cache_hit_behind_a_queue_loses_to_an_idle_worker_exactly_when_it_is_slower(queued, turn, winner):
    candidates = [prefill("p0", cached=800, queued=queued), prefill("p1")]
    result = route(request(1000), candidates, [decode("d0")], CONFIG, turn)
    assert choice(result) == (winner, "d0", "cache_hit" if winner == "p0" else "load")
    assert result.predicted_ttft_s == (1000 if winner == "p1" else 200 + queued) * S


def test_a_measured_slow_worker_loses_its_cache_advantage():
    candidates = [prefill("p0", cached=499, s_per_token=2 * S), prefill("p1", s_per_token=S)]
    assert choice(route(request(1000), candidates, [decode("d0")], CONFIG, 0))[0] == "p1"  # 1002 vs 1000
    candidates = [prefill("p0", cached=501, s_per_token=2 * S), prefill("p1", s_per_token=S)]
    assert choice(route(request(1000), candidates, [decode("d0")], CONFIG, 1))[0] == "p0"  # 998 vs 1000


def test_a_burst_at_an_idle_pool_alternates_workers():
    prefills, decodes = [prefill("p0"), prefill("p1")], [decode("d0"), decode("d1")]
    chosen = [choice(route(request(1000), prefills, decodes, CONFIG, turn))[:2] for turn in range(4)]
    assert chosen == [("p0", "d0"), ("p1", "d1"), ("p0", "d0"), ("p1", "d1")]


def test_least_loaded_takes_fewest_in_flight_and_ignores_caches():
    cfg = config(policy="least_loaded")
    prefills = [prefill("p0", cached=900, in_flight=2), prefill("p1", in_flight=1), prefill("p2", cached=64,
                                                                                               in_flight=1)]
    decodes = [decode("d0", in_flight=3, running=0), decode("d1", in_flight=1, running=7)]
    assert choice(route(request(1000), prefills, decodes, cfg, 0)) == ("p1", "d1", "load")
    assert choice(route(request(1000), prefills, decodes, cfg, 1)) == ("p2", "d1", "cache_hit")


def test_round_robin_takes_turns_over_every_candidate():
    cfg = config(policy="round_robin")
    prefills = [prefill("p0", queued=10_000), prefill("p1", cached=900), prefill("p2")]
    decodes = [decode("d0", running=7), decode("d1")]
    chosen = [choice(route(request(1000), prefills, decodes, cfg, turn)) for turn in range(4)]
    assert chosen == [("p0", "d0", "round_robin"), ("p1", "d1", "round_robin"), ("p2", "d0", "round_robin"),
                      ("p0", "d1", "round_robin")]


# ---- the decode worker --------------------------------------------------------------------------

def test_decode_score_is_batch_occupancy_plus_kv_usage_after_admission():
    assert decode_score(request(blocks=10), decode("d", running=4, free=60)) == 1.0  # 4/8 + 1 - 50/100
    assert decode_score(request(blocks=10), decode("d", running=2, free=10, total=40)) == 1.25  # 2/8 + 1 - 0/40


@pytest.mark.parametrize("d0_running, winner", [(4, "d1"), (3, "d0")])
def test_decode_worker_trades_batch_occupancy_against_kv_headroom(d0_running, winner):
    # d0: running/8 + 1 - 50/100 (1.0 at 4 running, 0.875 at 3); d1: 0 + 1 - 10/100 = 0.9.
    decodes = [decode("d0", running=d0_running, free=60), decode("d1", running=0, free=20)]
    assert choice(route(request(1000, blocks=10), [prefill("p0")], decodes, CONFIG, 0))[1] == winner


def test_decode_workers_without_room_are_skipped():
    decodes = [decode("d0", free=9), decode("d1", running=8), decode("d2", running=6, free=10)]
    for turn in range(3):
        assert choice(route(request(1000, blocks=10), [prefill("p0")], decodes, CONFIG, turn))[1] == "d2"


def test_a_busy_decode_pool_queues_instead_of_rejecting():
    # Nobody has room now; d0 scores 0/8 + 1 - (9 - 10)/100 = 1.01, d1 8/8 + 1 - (50 - 10)/100 = 1.6.
    decodes = [decode("d0", free=9), decode("d1", running=8, max_num_seqs=8, free=50)]
    for turn in range(2):
        assert choice(route(request(1000, blocks=10), [prefill("p0")], decodes, CONFIG, turn))[1] == "d0"
    baselines = {choice(route(request(1000, blocks=10), [prefill("p0")], decodes, config(policy="round_robin"),
                              turn))[1] for turn in range(2)}
    assert baselines == {"d0", "d1"}  # cache- and load-blind, but never a rejection


@pytest.mark.parametrize("policy", ROUTING_POLICIES)
def test_a_request_larger_than_every_decode_pool_is_rejected_no_kv_capacity(policy):
    decodes = [decode("d0", free=9, total=9), decode("d1", free=5, total=9)]
    result = route(request(1000, blocks=10), [prefill("p0")], decodes, config(policy=policy), 0)
    assert isinstance(result, Rejection) and result.reason == "no_kv_capacity"
    assert result.message == ("the request needs 10 KV blocks (prompt + max_tokens) and the largest decode "
                              "KV pool has 9")


def test_no_decode_candidates_is_a_caller_bug():
    with pytest.raises(ValueError, match="decode candidate"):
        route(request(), [prefill("p0")], [], CONFIG, 0)


def test_a_prefill_only_request_takes_the_best_prefill_worker_and_no_decode_worker():
    """A pooling request: the prefill worker predicted fastest (p1's cached 512 tokens beat p0's idle queue), no
    decode worker (none is a candidate, so none's KV pool or queue counts), and queue-full prefill workers skipped."""
    assert choice(route_prefill_only(request(1000), [prefill("p0"), prefill("p1", cached=512)], CONFIG, 0)) == (
        "p1", None, "cache_hit")
    assert choice(route_prefill_only(request(1000), [prefill("p0", queued=600), prefill("p1", queued=10)],
                                     config(max_queued_prefill_tokens=500), 0)) == ("p1", None, "load")
    full = route_prefill_only(request(1000), [prefill("p0", queued=600)], config(max_queued_prefill_tokens=500), 0)
    assert isinstance(full, Rejection) and full.reason == "queue_full"
    assert [choice(route_prefill_only(request(), [prefill("p0"), prefill("p1")], config(policy="round_robin"), turn))
            for turn in range(2)] == [("p0", None, "round_robin"), ("p1", None, "round_robin")]
    with pytest.raises(ValueError, match="prefill candidate"):
        route_prefill_only(request(), [], CONFIG, 0)


# ---- conditional disaggregation -----------------------------------------------------------------

@pytest.mark.parametrize("prompt, where", [(256, None), (257, "p0")])
def test_auto_prefills_locally_up_to_max_local_prefill_tokens(prompt, where):
    result = route(request(prompt), [prefill("p0")], [decode("d0")], CONFIG, 0)
    assert choice(result) == (where, "d0", "local_prefill" if where is None else "load")
    assert result.predicted_ttft_s == prompt * S


def test_a_decode_cache_hit_makes_a_long_prompt_local_for_prefix_aware_only():
    decodes = [decode("d0", cached=900)]
    assert choice(route(request(1000), [prefill("p0")], decodes, CONFIG, 0)) == (None, "d0", "local_prefill")
    result = route(request(1000), [prefill("p0")], decodes, config(policy="least_loaded"), 0)
    assert choice(result) == ("p0", "d0", "load")  # cache-blind: 1000 uncached tokens > 256


def test_the_decode_cache_hit_counts_in_the_local_predicted_ttft():
    result = route(request(1000), [prefill("p0")], [decode("d0", cached=900, queued=40)], CONFIG, 0)
    assert choice(result)[0] is None and result.predicted_ttft_s == 140 * S


@pytest.mark.parametrize("decode_queued, where", [(100, None), (101, "p0")])
def test_auto_goes_remote_when_local_is_slower_than_remote_plus_transfer(decode_queued, where):
    # local: (100 + queued) * S; remote: 100 * S + transfer 100 * S.
    cfg = config(transfer_s_per_token=S)
    result = route(request(100), [prefill("p0")], [decode("d0", queued=decode_queued)], cfg, 0)
    assert choice(result)[0] == where
    # A remote TTFT excludes the transfer: the first token streams from the prefill worker.
    assert result.predicted_ttft_s == (100 + decode_queued if where is None else 100) * S


def test_never_prefills_on_the_decode_worker_and_always_on_a_prefill_worker():
    assert choice(route(request(5000), [prefill("p0")], [decode("d0")], config(disaggregation="never"), 0)) == \
        (None, "d0", "local_prefill")
    assert choice(route(request(10), [prefill("p0")], [decode("d0", cached=9)], config(disaggregation="always"),
                        0)) == ("p0", "d0", "load")


def test_without_prefill_workers_the_decode_worker_prefills_in_every_mode():
    for mode in DISAGGREGATION_MODES:
        assert choice(route(request(5000), [], [decode("d0")], config(disaggregation=mode), 0)) == \
            (None, "d0", "local_prefill")


# ---- admission control --------------------------------------------------------------------------

@pytest.mark.parametrize("slo_in_tokens, admitted", [(250, True), (249, False)])
def test_ttft_slo_rejects_above_factor_times_slo(slo_in_tokens, admitted):
    # Predicted 1000 * S against 4 x the SLO: 1000 * S allowed exactly at an SLO of 250 * S.
    result = route(request(1000, slo=slo_in_tokens * S), [prefill("p0")], [decode("d0")], CONFIG, 0)
    if admitted:
        assert choice(result) == ("p0", "d0", "load")
    else:
        assert result == Rejection("ttft_slo", "predicted TTFT 0.977 s exceeds the allowed 0.973 s "
                                               "(4 x the 0.243 s TTFT SLO) at the current load")


def test_no_slo_means_no_ttft_check():
    result = route(request(1000, slo=None), [prefill("p0", queued=10 ** 9)], [decode("d0")], CONFIG, 0)
    assert choice(result) == ("p0", "d0", "load")


def test_the_ttft_check_uses_the_chosen_option():
    # 200 prompt tokens, SLO 200 * S, factor 1. With 1 token queued on the decode worker, auto picks
    # local (201 * S <= 200 * S + transfer 200 * 5e-6 s), which misses the SLO; remote would not.
    cfg = config(admission_ttft_factor=1.0)
    assert choice(route(request(200, slo=200 * S), [prefill("p0")], [decode("d0")], cfg, 0))[0] is None
    result = route(request(200, slo=200 * S), [prefill("p0")], [decode("d0", queued=1)], cfg, 0)
    assert isinstance(result, Rejection) and result.reason == "ttft_slo"
    assert "predicted TTFT 0.196 s exceeds the allowed 0.195 s" in result.message
    always = config(admission_ttft_factor=1.0, disaggregation="always")
    assert choice(route(request(200, slo=200 * S), [prefill("p0")], [decode("d0", queued=1)], always, 0)) == \
        ("p0", "d0", "load")


def test_full_prefill_queues_reject_queue_full():
    cfg = config(max_queued_prefill_tokens=500)
    result = route(request(1000), [prefill("p0", queued=500), prefill("p1", queued=600)], [decode("d0")], cfg, 0)
    assert result == Rejection("queue_full", "every prefill worker already has >= 500 prompt tokens queued "
                                             "(least: 500)")


def test_auto_prefills_a_short_prompt_locally_when_every_prefill_queue_is_full():
    cfg = config(max_queued_prefill_tokens=500)
    prefills = [prefill("p0", queued=600), prefill("p1", queued=700)]
    assert choice(route(request(20), prefills, [decode("d0")], cfg, 0)) == (None, "d0", "local_prefill")
    always = config(max_queued_prefill_tokens=500, disaggregation="always")
    assert route(request(20), prefills, [decode("d0")], always, 0).reason == "queue_full"


def test_a_full_queue_takes_no_new_prompt_even_with_a_cache_hit():
    cfg = config(max_queued_prefill_tokens=500)
    prefills = [prefill("p0", cached=999, queued=500), prefill("p1", queued=499)]
    assert choice(route(request(1000), prefills, [decode("d0")], cfg, 0)) == ("p1", "d0", "load")


def test_full_decode_queues_reject_queue_full_when_prefilling_locally():
    cfg = config(max_queued_prefill_tokens=500, disaggregation="never")
    decodes = [decode("d0", queued=500), decode("d1", queued=499, running=7)]
    assert choice(route(request(100), [prefill("p0")], decodes, cfg, 0)) == (None, "d1", "local_prefill")
    result = route(request(100), [], [decode("d0", queued=500)], cfg, 0)
    assert result == Rejection("queue_full", "every decode worker already has >= 500 prompt tokens queued "
                                             "(least: 500)")


def test_auto_sends_a_short_prompt_remote_when_the_decode_queue_is_full():
    # Local would be sooner (600 * S vs (100 + 499) * 2S), but d0's queue is at the limit.
    prefills = [prefill("p0", queued=499, s_per_token=2 * S)]
    assert choice(route(request(100), prefills, [decode("d0", queued=499)], config(max_queued_prefill_tokens=500),
                        0))[0] is None
    assert choice(route(request(100), prefills, [decode("d0", queued=500)], config(max_queued_prefill_tokens=500),
                        0)) == ("p0", "d0", "load")


# ---- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("policy", "random"), ("disaggregation", "sometimes"), ("max_local_prefill_tokens", -1),
    ("default_prefill_s_per_token", 0.0), ("transfer_s_per_token", -1e-9),
    ("admission_ttft_factor", 0.0), ("max_queued_prefill_tokens", 0),
])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must"):
        RoutingConfig(**{field: value})


@pytest.mark.parametrize("fields, name", [
    ((0, 1, None), "num_prompt_tokens"), ((1, 0, None), "num_blocks_needed"), ((1, 1, -1.0), "ttft_slo_s"),
])
def test_request_errors_name_the_field(fields, name):
    with pytest.raises(ValueError, match=f"^{name} must"):
        RoutingRequest(*fields)


def test_decode_candidate_errors_name_the_worker():
    with pytest.raises(ValueError, match="^d0: max_num_seqs"):
        decode("d0", max_num_seqs=0)
    with pytest.raises(ValueError, match="^d0: need 0 <= num_free_kv_blocks <= num_kv_blocks"):
        decode("d0", free=101, total=100)


# ---- properties ---------------------------------------------------------------------------------

_counts = st.integers(min_value=0, max_value=3000)
_costs = st.none() | st.floats(min_value=1e-6, max_value=1e-2)


@st.composite
def _prefills(draw):
    fields = draw(st.lists(st.tuples(_counts, _counts, _costs, st.integers(0, 9)), max_size=4))
    return [PrefillCandidate(f"p{i}", *f) for i, f in enumerate(fields)]


@st.composite
def _decodes(draw):
    decodes = []
    for i in range(draw(st.integers(1, 4))):
        total = draw(st.integers(1, 200))
        decodes.append(DecodeCandidate(f"d{i}", draw(_counts), draw(_counts), draw(_costs), draw(st.integers(0, 10)),
                                       draw(st.integers(1, 8)), draw(st.integers(0, total)), total,
                                       draw(st.integers(0, 9))))
    return decodes


_configs = st.builds(RoutingConfig, policy=st.sampled_from(ROUTING_POLICIES),
                     disaggregation=st.sampled_from(DISAGGREGATION_MODES),
                     max_local_prefill_tokens=st.integers(0, 1000),
                     max_queued_prefill_tokens=st.none() | st.integers(1, 3000))
_requests = st.builds(RoutingRequest, st.integers(1, 3000), st.integers(1, 60),
                      st.none() | st.floats(min_value=1e-3, max_value=10))


@settings(max_examples=300, deadline=None)
@given(_requests, _prefills(), _decodes(), _configs, st.integers(0, 100))
def test_route_only_returns_candidates_and_always_means_remote(request_, prefills, decodes, cfg, turn):
    result = route(request_, prefills, decodes, cfg, turn)
    if isinstance(result, Rejection):
        assert result.reason in ("ttft_slo", "queue_full", "no_kv_capacity") and result.message
        return
    chosen_decode = next(c for c in decodes if c.worker_id == result.decode_worker_id)
    assert chosen_decode.num_kv_blocks >= request_.num_blocks_needed
    if any(c.num_free_kv_blocks >= request_.num_blocks_needed and c.num_running < c.max_num_seqs for c in decodes):
        assert chosen_decode.num_free_kv_blocks >= request_.num_blocks_needed  # room now beats queueing
        assert chosen_decode.num_running < chosen_decode.max_num_seqs
    assert result.prefill_worker_id in {None, *(c.worker_id for c in prefills)}
    if cfg.disaggregation == "always" and prefills:
        assert result.prefill_worker_id is not None
    if cfg.disaggregation == "never":
        assert result.prefill_worker_id is None
    assert result.predicted_ttft_s > 0
    assert result.reason in ("cache_hit", "load", "local_prefill", "round_robin")
