"""Several routers (router.replicas 2) over the same workers on a real Ray cluster: one address
for both (SO_REUSEPORT), each router's prefix index exact; one router killed under load loses only
its own streams, the other's all finish with Hugging Face's output, and every worker ends the dead
router's requests (its held KV included) within 1 s of the kill, long before the 30 s lease
would; its own streams end UNAVAILABLE, never as a finished stream, even when the workers hear of
its death before its process has exited; a worker killed is reported by Ray's actor states and
unroutable on every router."""

from __future__ import annotations

import json

import pytest
import ray

from splitserve.testing.local_cluster import running_cluster
from splitserve.testing.router_faults import (REAP_WITHIN_S, StreamResult, index_is_exact, kill_a_router_under_load,
                                              kill_a_worker, load_cases, router_cluster_config,
                                              stream_on_own_connection)
from splitserve.router.request_body import LARGE_BODY_BYTES
from splitserve.testing.workloads import GreedyCase
from tests.factories import hf_greedy, http_request

pytestmark = pytest.mark.slow


def test_a_router_the_workers_hear_is_dead_before_it_exits_cuts_its_streams_with_unavailable(tiny_llama_dir):
    """Ray publishes a killed router's DEAD a few ms before its process has exited, and the workers
    end its requests then: the router, still running, must not receive a plain abort it would
    pass on to its clients as a finished stream (finish_reason 'abort', status OK). Here the
    workers hear 0.3 s before the kill. (First in the module: its cluster has ended before the
    module's own starts.)"""
    with running_cluster(router_cluster_config(tiny_llama_dir)) as (cluster, loop):
        cases = load_cases()
        death = kill_a_router_under_load(cluster, cases, told_before_s=0.3)
        _assert_only_the_victims_streams_were_cut(death, cases, tiny_llama_dir)
        loop.run(cluster.wait_idle(timeout_s=30))


@pytest.fixture(scope="module")
def two_routers(tiny_llama_dir):
    with running_cluster(router_cluster_config(tiny_llama_dir)) as running:
        yield running


def test_both_routers_serve_one_address_with_exact_prefix_indexes(two_routers, tiny_llama_dir):
    cluster, _ = two_routers
    case = load_cases()[0]
    assert len(cluster.routers) == 2
    assert cluster.router_ports.http is not None
    assert stream_on_own_connection(cluster.port, "warm", case) == StreamResult(
        tuple(hf_greedy(tiny_llama_dir, case)), None, "length")
    assert [index_is_exact(cluster, router) for router in cluster.routers.values()] == [True, True]


def test_router_actors_parse_large_bodies_in_their_parser_process(two_routers, tiny_llama_dir):
    """A body over LARGE_BODY_BYTES goes to the router's parser process, which a router actor spawns
    from Ray's worker process (its main module is Ray's); each of several connections (spread over
    both routers by SO_REUSEPORT) gets Hugging Face's tokens."""
    cluster, _ = two_routers
    case = GreedyCase(load_cases()[1].prompt_token_ids, 8, True)
    request = {"prompt": list(case.prompt_token_ids), "max_tokens": case.max_tokens, "temperature": 0,
               "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    body = json.dumps(request).encode() + b" " * LARGE_BODY_BYTES
    expected = [f"token_id:{token}" for token in hf_greedy(tiny_llama_dir, case)]
    for _ in range(4):
        status, _, raw = http_request(cluster.router_ports.http, "POST", "/v1/completions", body)
        assert status == 200, raw
        assert json.loads(raw)["choices"][0]["logprobs"]["tokens"] == expected


def test_killing_one_of_two_routers_under_load_loses_only_its_streams(two_routers, tiny_llama_dir):
    cluster, loop = two_routers
    cases = load_cases()
    death = kill_a_router_under_load(cluster, cases)
    assert death.held_on_prefill
    _assert_only_the_victims_streams_were_cut(death, cases, tiny_llama_dir)
    assert death.reaped_s <= REAP_WITHIN_S, f"the dead router's requests left the workers {death.reaped_s:.2f} s after"
    loop.run(cluster.wait_idle(timeout_s=30))
    (survivor,) = cluster.routers.values()
    assert ray.get(survivor.num_in_flight.remote()) == 0
    assert index_is_exact(cluster, survivor)


def _assert_only_the_victims_streams_were_cut(death, cases, model_dir) -> None:
    """The cut streams ended UNAVAILABLE, at most as many as the dead router had in flight when it
    was chosen (one may finish between that count and the kill); every other stream finished with
    Hugging Face's output and finish_reason 'length', never 'abort' (what a stream a worker ended
    finishes with)."""
    in_flight = dict(death.in_flight)
    assert {(result.code, result.finish_reason) for result in death.cut} == {("UNAVAILABLE", None)}
    assert 1 <= len(death.cut) <= in_flight[death.victim]
    finished = [(case, result) for case, result in zip(cases, death.results) if result.code is None]
    assert len(finished) == len(cases) - len(death.cut)
    assert [(result.tokens, result.finish_reason) for _, result in finished] == [
        (tuple(hf_greedy(model_dir, case)), "length") for case, _ in finished]


def test_a_killed_worker_is_reported_by_rays_actor_states_and_unroutable_on_every_router(two_routers):
    cluster, loop = two_routers
    kill = kill_a_worker(cluster, loop, "prefill-0")
    assert kill.states == ("RESTARTING",)
    assert kill.unroutable_s < kill.rejoined_s
    print(f"killed worker unroutable on every router {kill.unroutable_s:.3f} s after the kill, routable again "
          f"{kill.rejoined_s:.1f} s after")
