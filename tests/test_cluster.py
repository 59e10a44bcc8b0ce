"""End to end through gRPC on a local Ray cluster (loopback only), KV pulled over NIXL."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.common.block_hash import BlockHasher
from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.proto.splitserve.v1 import generation_pb2_grpc
from splitserve.testing.local_cluster import running_cluster, tiny_cluster_config
from splitserve.testing.workloads import mixed_workload
from tests.factories import hf_greedy, process_stat, stream_tokens

pytestmark = pytest.mark.slow


def _greedy_request(index: int, case) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=f"req-{index}", token_ids=pb.TokenIds(ids=case.prompt_token_ids),
                              sampling=pb.SamplingParams(temperature=0.0, max_tokens=case.max_tokens,
                                                         ignore_eos=case.ignore_eos))


def _run_concurrently(port: int, cases) -> list[list[int]]:
    with ThreadPoolExecutor(len(cases)) as pool:
        results = pool.map(lambda item: stream_tokens(port, _greedy_request(*item))[0], enumerate(cases))
        return list(results)


def _assert_matches_hf(model_dir, cases, outputs) -> None:
    for index, (case, tokens) in enumerate(zip(cases, outputs)):
        assert tokens == hf_greedy(model_dir, case), f"request {index}"


@pytest.fixture(scope="module")
def disaggregated(tiny_llama_dir):
    with running_cluster(tiny_cluster_config(tiny_llama_dir, prefill=2, decode=2)) as running:
        yield running


def test_32_concurrent_greedy_requests_match_hf_2p2d(disaggregated, tiny_llama_dir):
    cluster, loop = disaggregated
    cases = mixed_workload(512, num_requests=32, seed=3, max_prompt=200, max_output=24)
    _assert_matches_hf(tiny_llama_dir, cases, _run_concurrently(cluster.port, cases))
    loop.run(cluster.wait_idle())


def test_response_carries_usage_timing_and_text(disaggregated, tiny_llama_dir):
    cluster, loop = disaggregated
    request = pb.GenerateRequest(text="Tell me about the river".encode(),
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    tokens, text, responses = stream_tokens(cluster.port, request)
    final = responses[-1]
    assert (final.finish_reason, final.usage.completion_tokens, len(tokens)) == ("length", 6, 6)
    assert final.usage.prompt_tokens > 0 and all(r.finish_reason == "" for r in responses[:-1])
    assert 0 < final.timing.first_token_s <= final.timing.total_s and final.timing.transfer_s > 0
    from splitserve.router.tokenizer import RouterTokenizer

    assert text == RouterTokenizer.from_model_dir(tiny_llama_dir).decode(tokens)
    loop.run(cluster.wait_idle())


def test_invalid_input_gets_invalid_argument_and_server_stays_healthy(disaggregated):
    cluster, _ = disaggregated
    bad = [pb.GenerateRequest(text=b""),
           pb.GenerateRequest(text=b"\xff\xfe"),
           pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 5000)),
           pb.GenerateRequest(token_ids=pb.TokenIds(ids=[99999])),
           pb.GenerateRequest(text=b"hi", sampling=pb.SamplingParams(top_p=2.0)),
           pb.GenerateRequest(text=b"hi", model="nope"),
           pb.GenerateRequest(text=b"hi", ttft_slo_s=-1.0),
           pb.GenerateRequest()]
    fields = ["prompt", "prompt.text", "prompt", "prompt.token_ids", "top_p", "model", "ttft_slo_s", "prompt"]
    for request, field in zip(bad, fields):
        with pytest.raises(grpc.RpcError) as error:
            stream_tokens(cluster.port, request)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details().startswith(f"{field}: "), error.value.details()
    with grpc.insecure_channel(f"127.0.0.1:{cluster.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_a_shared_prefix_is_served_from_the_prefill_cache_that_holds_it(disaggregated):
    cluster, loop = disaggregated
    prefix = list(range(200, 264))  # 8 full blocks of 8 tokens

    async def indexed() -> None:  # on the router's loop: the index is not shared across threads
        hashes = BlockHasher(8, 0).hash_prefix(prefix)
        while max(cluster.orchestrator.index.matched_blocks(hashes).values()) < len(hashes):
            await asyncio.sleep(0.01)

    first = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prefix + [5, 6, 7]),
                               sampling=pb.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert stream_tokens(cluster.port, first)[2][-1].usage.cached_tokens == 0
    loop.run(asyncio.wait_for(indexed(), 10))
    second = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prefix + [9, 10]),
                                sampling=pb.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert stream_tokens(cluster.port, second)[2][-1].usage.cached_tokens == len(prefix)
    loop.run(cluster.wait_idle())


def test_a_request_that_cannot_meet_its_ttft_slo_is_rejected_at_once(disaggregated):
    cluster, loop = disaggregated
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(3, 200))), ttft_slo_s=1e-9,
                                 sampling=pb.SamplingParams(max_tokens=4))
    with pytest.raises(grpc.RpcError) as error:
        stream_tokens(cluster.port, request)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.value.details().startswith("predicted TTFT "), error.value.details()
    assert dict(cluster.orchestrator.routing_stats().rejections) == {"ttft_slo": 1}
    loop.run(cluster.wait_idle())


def test_client_cancel_mid_stream_frees_both_workers(disaggregated):
    cluster, loop = disaggregated
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(3, 150))),
                                 sampling=pb.SamplingParams(max_tokens=1500, ignore_eos=True))
    with grpc.insecure_channel(f"127.0.0.1:{cluster.port}") as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)
        received = [next(call) for _ in range(4)]
        call.cancel()
    assert all(len(r.token_ids) >= 1 for r in received)
    loop.run(cluster.wait_idle())


def test_deadline_ends_the_stream_and_frees_everything(disaggregated):
    cluster, loop = disaggregated
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(3, 100))),
                                 sampling=pb.SamplingParams(max_tokens=1900, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as error:
        stream_tokens(cluster.port, request, timeout_s=1.0)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    loop.run(cluster.wait_idle())


def _living(pids: set[int]) -> dict[int, str]:
    """The command line of each of `pids` still running. A zombie (state Z: exited, not yet reaped by
    PID 1, which on these VMs reaps orphans up to a second or so late) is not running."""
    living = {}
    for pid in pids:
        fields = process_stat(pid)
        if fields is None or fields[0] == "Z":
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                living[pid] = cmdline.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
    return living


def _still_living_after(pids: set[int], timeout_s: float) -> dict[int, str]:
    """_living(pids) once none is left or `timeout_s` has passed (each ends by itself, soon)."""
    import time

    deadline = time.monotonic() + timeout_s
    while (alive := _living(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _descendants(pid: int) -> set[int]:
    children = {pid}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := process_stat(entry)) is not None and int(fields[1]) in children:
            children.add(int(entry))
    return children


def test_every_listener_is_on_loopback(disaggregated):
    ours = _descendants(os.getpid())  # Ray's processes (GCS, raylet, agents, workers) all descend from the driver
    listing = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    checked = 0
    for line in listing.splitlines():
        pids = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if pids & ours:
            local = line.split()[3]
            assert re.match(r"^(127\.0\.0\.1|\[::ffff:127\.0\.0\.1\]|\[::1\]):\d+$", local), line
            checked += 1
    assert checked >= 5


@pytest.mark.parametrize("mode, prefill, decode", [("disaggregated", 1, 1), ("colocated", 0, 2)])
def test_other_shapes_match_hf(tiny_llama_dir, mode, prefill, decode):
    cases = mixed_workload(512, num_requests=12, seed=5, max_prompt=120, max_output=16)
    with running_cluster(tiny_cluster_config(tiny_llama_dir, mode, prefill, decode)) as (cluster, loop):
        _assert_matches_hf(tiny_llama_dir, cases, _run_concurrently(cluster.port, cases))
        loop.run(cluster.wait_idle())


def test_serve_command_drains_and_stops_cleanly_on_sigterm(tiny_llama_dir):
    import signal
    import sys

    command = [sys.executable, "-m", "splitserve.deploy.cli", "serve", "--model", str(tiny_llama_dir),
               "--grpc-port", "0", "--metrics-port", "0", "--http-port", "0", "--set",
               "prefill.engine.num_kv_blocks=256", "--set", "decode.engine.num_kv_blocks=256", "--set",
               "prefill.resources.num_cpus=0.5", "--set", "decode.resources.num_cpus=0.5"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        banner = server.stdout.readline()
        port = int(re.search(r"on 127\.0\.0\.1:(\d+)", banner).group(1))
        request = pb.GenerateRequest(text=b"hello", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))
        tokens, _, _ = stream_tokens(port, request)
        assert len(tokens) == 3
        children = _descendants(server.pid) - {server.pid}
        # A stream running at SIGTERM finishes: the router drains before it stops.
        long_request = pb.GenerateRequest(text=b"hello", sampling=pb.SamplingParams(max_tokens=120, ignore_eos=True))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = generation_pb2_grpc.GenerationStub(channel).Generate(long_request, timeout=60)
            first = next(stream)
            server.send_signal(signal.SIGTERM)
            rest = list(stream)
        assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 120
        assert rest[-1].finish_reason == "length"
        assert server.wait(timeout=60) == 0
        output = server.stdout.read()
        assert "splitserve: draining (up to 30 s; signal again to stop now)" in output
        assert "splitserve: shutting down (0 requests still in flight end with UNAVAILABLE)" in output
        # Every child ends by itself, soon: Ray's processes, the router's body parser, and the
        # resource tracker multiprocessing starts for the parser (it exits at EOF once serve has
        # exited). A process still running after 15 s leaked.
        assert not (alive := _still_living_after(children, 15)), f"processes outlived serve: {alive}"
    finally:
        if server.poll() is None:
            server.kill()


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_serve_command_stopped_while_its_workers_start_stops_cleanly(tiny_llama_dir, tmp_path, signum):
    """A signal while the workers load (Kubernetes stopping a starting pod, Ctrl-C): everything
    started stops and serve exits 0 with one line. Before, SIGTERM there met Ray's own handler
    (an abort with a native stack trace) and SIGINT a Python traceback."""
    import shutil
    import signal
    import sys
    import time

    model = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    os.mkfifo(model / "zz-never-written.safetensors")  # its load blocks in open(): the workers never finish starting
    command = [sys.executable, "-m", "splitserve.deploy.cli", "serve", "--model", str(model), "--grpc-port", "0",
               "--metrics-port", "0", "--http-port", "0", "--set", "prefill.resources.num_cpus=0.5", "--set",
               "decode.resources.num_cpus=0.5"]
    with open(tmp_path / "stderr", "w") as stderr:
        server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(process.startswith(("ray::PrefillWorker", "ray::DecodeWorker"))
                      for process in _living(_descendants(server.pid)).values()):
            assert server.poll() is None and time.monotonic() < deadline, "no worker started"
            time.sleep(0.1)
        children = _descendants(server.pid) - {server.pid}
        server.send_signal(getattr(signal, signum))
        assert server.wait(timeout=60) == 0
        assert server.stdout.read().splitlines()[-1] == "splitserve: stopped before serving"
        assert not [line for line in (tmp_path / "stderr").read_text().splitlines()
                    if "Traceback" in line or "SIGTERM received" in line]
        assert not (alive := _still_living_after(children, 15)), f"processes outlived serve: {alive}"
    finally:
        if server.poll() is None:
            server.kill()


def test_layerwise_transfer_matches_hf_1p1d(tiny_llama_dir):
    """kv_transfer_layerwise over NIXL: the router relays each prefill's TransferParams and layers (a
    Ray stream in, the decode worker's stream out) and every request's KV is pulled layer by layer."""
    cases = [dataclasses.replace(case, max_tokens=max(case.max_tokens, 2), ignore_eos=True)  # none ends at token 1
             for case in mixed_workload(512, num_requests=12, seed=7, max_prompt=120, max_output=16)]
    config = tiny_cluster_config(tiny_llama_dir, kv_transfer_layerwise=True)
    with running_cluster(config) as (cluster, loop):
        _assert_matches_hf(tiny_llama_dir, cases, _run_concurrently(cluster.port, cases))
        loop.run(cluster.wait_idle())
        stats = loop.run(_stats(cluster.decode_actors[0]))
    assert stats.num_layerwise_pulls == len(cases)


async def _stats(actor):
    return await actor.stats.remote()
