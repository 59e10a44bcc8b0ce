"""A bounded soak of the served cluster, looking for what grows with the requests served.

Starts `splitserve serve default` as a user does (disaggregated, 1 prefill + 1 decode worker, the embedded
default model, 127.0.0.1, its own ports) with the probe of bench/soak_probe on PYTHONPATH, so the router's
process and both worker processes each write a snapshot every few seconds (RSS, fds, threads, asyncio
tasks, live splitserve instances, the length of every container attribute of them, live objects by type).
Client threads then send a varied workload for --minutes in --rounds rounds, each round followed by an
idle pause; /metrics is scraped throughout. A quantity that keeps growing from one idle point to the next
grows with the requests served: that is a leak (a bounded cache levels off).

Workload kinds (chosen at random, every request with fresh ids, `user` and `cache_salt`): completions and
chats, streamed and not, n > 1, logprobs, structured output (json_schema, regex, choice), tool calls, stop
strings, streams the client drops after a few chunks, requests the client times out, 4xx requests, gRPC
Generate streams (some cancelled, some with a short deadline), Triton ModelInfer and ModelStreamInfer, beam
search, the Responses API, request chat templates, /tokenize, /metrics.

Writes bench/results/soak_served.json: per process and per idle point the sampled numbers, and what grew
from the first idle point after warm-up (the first round) to the last; and its .png: each process's RSS and
(router) asyncio tasks at each idle point against the requests served by then. Run:
.venv/bin/python bench/soak_served.py --minutes 12 --rounds 6 --server-args --kv-cache-memory 16M
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx  # the openai client's HTTP library (the dev extra installs it)

REPO = Path(__file__).resolve().parent.parent
RESULT = REPO / "bench" / "results" / "soak_served.json"
PROBE_DIR = Path(__file__).resolve().parent / "soak_probe"
IDLE_PAUSE_S = 12.0
"""Each round ends with this long a pause; the probe's last snapshot in it is the round's idle point."""
WORDS = "the river runs past old stones and a quiet town where people walk at night under bright stars".split()


@dataclass(frozen=True)
class Ports:
    http: int
    grpc: int
    metrics: int


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="load time, idle pauses excluded (at most 12)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--base-port", type=int, default=18410)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--kinds", nargs="+", choices=sorted({kind.__name__ for kind in KINDS}),
                        help="send only these request kinds (default: all, in KINDS' proportions)")
    parser.add_argument("--types", action="store_true",
                        help="also count every live object by type (a full scan of the heap per snapshot, each "
                             "holding its process for about 0.1 s)")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                        help="more `splitserve serve` flags, e.g. --kv-cache-memory 16M (small pools fill up fast, "
                             "so the prefix caches reach their bound within the run)")
    args = parser.parse_args()
    if not 0 < args.minutes <= 12:
        parser.error("--minutes: between 0 and 12 (the machine is shared)")
    ports = Ports(args.base_port, args.base_port + 1, args.base_port + 2)
    probe_dir = Path(tempfile.mkdtemp(prefix="soak-probe-"))
    server = start_server(ports, probe_dir, args.server_args, args.types)
    try:
        wait_ready(ports, server)
        result = drive(ports, args, probe_dir)
    finally:
        stop_server(server)
    result["processes"] = summarize(probe_dir, result["idle_points"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({"requests": result["requests"], "outcomes": result["outcomes"],
                      "grew": {role: proc["grew"] for role, proc in result["processes"].items()}}, indent=1))


def plot(result: dict, path: Path) -> None:
    """RSS per process, and the router's asyncio tasks, at each idle point against the requests served."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    served = [point["requests"] for point in result["idle_points"]]
    figure, (rss, tasks) = plt.subplots(1, 2, figsize=(11, 4))
    for role, process in result["processes"].items():
        rss.plot(served, [sample.get("rss_mb") for sample in process["points"]], marker="o", label=role)
    router = result["processes"].get("router")
    if router is not None:
        tasks.plot(served, [sample.get("asyncio_tasks") for sample in router["points"]], marker="o")
    rss.set(xlabel="requests served", ylabel="RSS (MB)", title="RSS at each idle point")
    tasks.set(xlabel="requests served", ylabel="asyncio tasks", title="router's asyncio tasks at each idle point")
    rss.set_ylim(bottom=0)
    tasks.set_ylim(bottom=0)
    rss.legend()
    figure.suptitle(f"bench/soak_served.py, {result['date']}: {result['requests']} requests")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def start_server(ports: Ports, probe_dir: Path, server_args: list[str], types: bool) -> subprocess.Popen:
    env = dict(os.environ, SPLITSERVE_SOAK_PROBE_DIR=str(probe_dir), SPLITSERVE_SOAK_PROBE_PERIOD_S="3",
               SPLITSERVE_SOAK_PROBE_TYPES="1" if types else "0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(PROBE_DIR), os.environ.get("PYTHONPATH")])))
    command = [str(Path(sys.executable).parent / "splitserve"), "serve", "default", "--host", "127.0.0.1",
               "--port", str(ports.http), "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics),
               "--prefill-workers", "1", "--decode-workers", "1",
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--trust-request-chat-template",
               *server_args]
    log = open(probe_dir / "server.log", "w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(ports: Ports, server: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"splitserve serve exited with status {server.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{ports.http}/health", timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise SystemExit("splitserve serve was not ready in time")


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM (as Ctrl-C would), then SIGKILL of its process group if it did not stop."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def drive(ports: Ports, args: argparse.Namespace, probe_dir: Path) -> dict:
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    idle_points = [{"t": time.time() + IDLE_PAUSE_S, "requests": 0, "metrics": scrape_metrics(ports)}]
    time.sleep(IDLE_PAUSE_S)  # the first idle point: served nothing yet
    round_s = args.minutes * 60 / args.rounds
    kinds = [kind for kind in KINDS if args.kinds is None or kind.__name__ in args.kinds]
    for round_index in range(args.rounds):
        stop_at = time.monotonic() + round_s
        threads = [threading.Thread(target=client, args=(ports, random.Random(args.seed * 997 + round_index * 31 + c),
                                                         stop_at, kinds, outcomes, lock), daemon=True)
                   for c in range(args.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        time.sleep(IDLE_PAUSE_S)
        idle_points.append({"t": time.time(), "requests": sum(outcomes.values()), "metrics": scrape_metrics(ports)})
        print(f"round {round_index + 1}/{args.rounds}: {sum(outcomes.values())} requests", flush=True)
    return {"date": datetime.date.today().isoformat(), "minutes": args.minutes, "rounds": args.rounds,
            "clients": args.clients, "requests": sum(outcomes.values()), "outcomes": dict(sorted(outcomes.items())),
            "idle_points": idle_points, "server_log_tail": (probe_dir / "server.log").read_text()[-3000:]}


def client(ports: Ports, rng: random.Random, stop_at: float, kinds: list, outcomes: Counter,
           lock: threading.Lock) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{ports.http}", timeout=60) as http:
        while time.monotonic() < stop_at:
            kind = rng.choice(kinds)
            try:
                outcome = kind(http, ports, rng)
            except (httpx.HTTPError, OSError) as error:
                outcome = type(error).__name__
            with lock:
                outcomes[f"{kind.__name__}:{outcome}"] += 1


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def unique(rng: random.Random) -> str:
    return f"{rng.getrandbits(48):012x}"


def tenant(rng: random.Random) -> dict:
    """Fields every request carries: a fresh `user` and `cache_salt` each time."""
    return {"model": "default", "user": f"user-{unique(rng)}", "cache_salt": f"salt-{unique(rng)}"}


def completion(http: httpx.Client, ports: Ports, rng: random.Random) -> str:
    body = {**tenant(rng), "prompt": words(rng, rng.randint(3, 60)), "max_tokens": rng.randint(1, 24),
            "n": rng.choice([1, 1, 2]), "logprobs": rng.choice([None, 2]), "echo": rng.random() < 0.2,
            "stop": rng.choice([None, ["the"], [" river", "\n"]]), "temperature": rng.choice([0.0, 0.8])}
    response = http.post("/v1/completions", json=body, headers={"X-Request-Id": f"req-{unique(rng)}"})
    return str(response.status_code)


def chat(http: httpx.Client, ports: Ports, rng: random.Random) -> str:
    body = {**tenant(rng), "messages": [{"role": "user", "content": words(rng, rng.randint(3, 40))}],
            "max_tokens": rng.randint(1, 24), "n": rng.choice([1, 2]), **rng.choice([{}, {"logprobs": True, "top_logprobs": 2}]),
            "request_id": f"chat-{unique(rng)}"}
    return str(http.post("/v1/chat/completions", json=body).status_code)


def streamed(http: httpx.Client, ports: Ports, rng: random.Random) -> str:
    """A streamed completion or chat; half of them dropped by the client after 1-3 chunks."""
    drop_after = rng.choice([None, rng.randint(1, 3)])
    body = {**tenant(rng), "max_tokens": rng.randint(4, 32), "stream": True,
            "stream_options": {"include_usage": True}, "n": rng.choice([1, 2]), "ignore_eos": True}
    if rng.random() < 0.5:
        path, body = "/v1/completions", {**body, "prompt": words(rng, rng.randint(3, 60))}
    else:
        path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": words(rng, 12)}]}
    with http.stream("POST", path, json=body) as response:
        for index, _ in enumerate(response.iter_lines()):
            if drop_after is not None and index >= drop_after:
                return "dropped"  # leaving the block closes the connection mid-stream
    return str(response.status_code)


def structured(http: httpx.Client, ports: Ports, rng: random.Random) -> str:
    """A grammar no earlier request used (json_schema with a fresh property name, regex, choice)."""
    name = f"k{unique(rng)}"
    constraint = rng.choice([
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
            "type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}}}},
        {"structured_outputs": {"regex": f"{name}-[0-9]{{2,4}}"}},
        {"structured_outputs": {"choice": [name, f"{name}x", "no"]}},
    ])
    body = {**tenant(rng), **constraint, "messages": [{"role": "user", "content": words(rng, 8)}],
            "max_tokens": 24, "stream": rng.random() < 0.3}
    return str(http.post("/v1/chat/completions", json=body).status_code)


def tools(http: httpx.Client, ports: Ports, rng: random.Random) -> str:
    function = f"fn_{unique(rng)}"
    tool = {"type": "function", "function": {"name": function, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
    choice = rng.choice(["auto", "required", {"type": "function", "function": {"name": function}}])
    body = {**tenant(rng), "messages": [{"role": "user", "content": "weather in " + words(rng, 2)}],
            "tools": [tool], "tool_choice": choice, "max_tokens": 40, "stream": rng.random() < 0.3}
    return str(http.post("/v1/chat/completions", json=body).status_code)


def timed_out(http: httpx.Client, ports: Ports, rng: random.Random) -> str:
    """The client gives up after 50-300 ms, mid-request."""
    body = {**tenant(rng), "prompt": words(rng, 40), "max_tokens": 64, "ignore_eos": True}
    try:
        return str(http.post("/v1/completions", json=body, timeout=rng.uniform(0.05, 0.3)).status_code)
    except httpx.TimeoutException:
        return "client-timeout"


BAD_BODIES = [
    {"model": "default", "prompt": "x", "max_tokens": -1},
    {"model": "no-such-model", "prompt": "x"},
    {"model": "default"},
    {"model": "default", "prompt": "x", "temperature": "hot"},
    {"model": "default", "prompt": "x " * 5000, "max_tokens": 4},
    {"model": "default", "messages": [{"role": "user"}], "n": 0},
]


def bad_request(http: httpx.Client, ports: Ports, rng: random.Random) -> str:
    body = {**rng.choice(BAD_BODIES), "user": f"user-{unique(rng)}"}
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if rng.random() < 0.2:
        return str(http.post(path, content=b"{not json", headers={"content-type": "application/json"}).status_code)
    return str(http.post(path, json=body).status_code)


def tokenize(http: httpx.Client, ports: Ports, rng: random.Random) -> str:
    return str(http.post("/tokenize", json={"model": "default", "prompt": words(rng, 20)}).status_code)


def metrics(http: httpx.Client, ports: Ports, rng: random.Random) -> str:
    return str(httpx.get(f"http://127.0.0.1:{ports.metrics}/metrics", timeout=10).status_code)


def grpc_generate(http: httpx.Client, ports: Ports, rng: random.Random) -> str:
    """A Generate stream with a fresh request id: finished, cancelled after 1-2 deltas, or a short deadline."""
    import grpc

    from splitserve.common.sampling_params import SamplingParams
    from splitserve.deploy.client import GenerationClient, build_generate_request

    ending = rng.choice(["finish", "cancel", "deadline"])
    request = build_generate_request(text=words(rng, rng.randint(3, 60)), request_id=f"grpc-{unique(rng)}",
                                     params=SamplingParams(max_tokens=rng.randint(2, 32), ignore_eos=True),
                                     cache_salt=f"salt-{unique(rng)}")
    timeout = rng.uniform(0.05, 0.4) if ending == "deadline" else 60
    try:
        with GenerationClient(f"127.0.0.1:{ports.grpc}", timeout_s=timeout) as generation:
            for index, _ in enumerate(generation.stream(request)):
                if ending == "cancel" and index >= rng.randint(0, 1):
                    return "cancelled"  # closing the channel cancels the call
    except grpc.RpcError as error:
        return error.code().name
    return "OK"


def triton_infer(http: httpx.Client, ports: Ports, rng: random.Random) -> str:
    import grpc

    from splitserve.proto.inference import grpc_service_pb2 as pb
    from splitserve.proto.inference import grpc_service_pb2_grpc as pb_grpc

    sampling = json.dumps({"temperature": 0, "max_tokens": rng.randint(1, 16)})
    request = pb.ModelInferRequest(model_name="default", id=f"triton-{unique(rng)}", inputs=[
        pb.ModelInferRequest.InferInputTensor(name="text_input", datatype="BYTES", shape=[1],
                                              contents=pb.InferTensorContents(bytes_contents=[words(rng, 10).encode()])),
        pb.ModelInferRequest.InferInputTensor(name="sampling_parameters", datatype="BYTES", shape=[1],
                                              contents=pb.InferTensorContents(bytes_contents=[sampling.encode()]))])
    with grpc.insecure_channel(f"127.0.0.1:{ports.grpc}") as channel:
        try:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
        except grpc.RpcError as error:
            return error.code().name
    return "OK"


def beam_search(http: httpx.Client, ports: Ports, rng: random.Random) -> str:
    body = {**tenant(rng), "prompt": words(rng, rng.randint(3, 30)), "max_tokens": rng.randint(2, 8),
            "n": rng.choice([1, 2]), "use_beam_search": True}
    return str(http.post("/v1/completions", json=body).status_code)


def responses(http: httpx.Client, ports: Ports, rng: random.Random) -> str:
    body = {"model": "default", "input": words(rng, rng.randint(3, 30)), "max_output_tokens": rng.randint(2, 16),
            "user": f"user-{unique(rng)}", "stream": rng.random() < 0.5}
    return str(http.post("/v1/responses", json=body).status_code)


def request_template(http: httpx.Client, ports: Ports, rng: random.Random) -> str:
    """A chat with a chat template no earlier request sent (the server trusts request templates)."""
    template = f"{{% for m in messages %}}[{unique(rng)}]{{{{ m['content'] }}}}{{% endfor %}}"
    body = {**tenant(rng), "messages": [{"role": "user", "content": words(rng, 8)}], "max_tokens": 4,
            "chat_template": template}
    return str(http.post("/v1/chat/completions", json=body).status_code)


def triton_stream(http: httpx.Client, ports: Ports, rng: random.Random) -> str:
    """Two requests on one ModelStreamInfer stream, streamed deltas; half the streams cancelled after a response."""
    import grpc

    from splitserve.proto.inference import grpc_service_pb2 as pb
    from splitserve.proto.inference import grpc_service_pb2_grpc as pb_grpc

    def request(index: int):
        tensors = [("text_input", words(rng, 10).encode()), ("stream", None),
                   ("sampling_parameters", json.dumps({"max_tokens": rng.randint(2, 16)}).encode())]
        return pb.ModelInferRequest(model_name="default", id=f"ts-{unique(rng)}-{index}", inputs=[
            pb.ModelInferRequest.InferInputTensor(name=name, datatype="BOOL" if value is None else "BYTES", shape=[1],
                                                  contents=pb.InferTensorContents(bool_contents=[True])
                                                  if value is None else pb.InferTensorContents(bytes_contents=[value]))
            for name, value in tensors])

    cancel = rng.random() < 0.5
    with grpc.insecure_channel(f"127.0.0.1:{ports.grpc}") as channel:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([request(0), request(1)]), timeout=30)
        try:
            for index, _ in enumerate(call):
                if cancel and index >= 1:
                    call.cancel()
                    return "cancelled"
        except grpc.RpcError as error:
            return error.code().name
    return "OK"


KINDS = [completion, completion, chat, chat, streamed, streamed, structured, tools, timed_out, bad_request,
         tokenize, metrics, grpc_generate, grpc_generate, triton_infer, triton_stream, beam_search, responses,
         request_template]


def scrape_metrics(ports: Ports) -> dict:
    """The /metrics series count, per metric family how many distinct series it has, and how many prefill
    KV leases expired so far (a lease that nobody pulled or freed: a release path missed it)."""
    text = httpx.get(f"http://127.0.0.1:{ports.metrics}/metrics", timeout=10).text
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    families = Counter(line.split("{")[0].split(" ")[0] for line in series)
    expired = sum(float(line.rsplit(" ", 1)[1]) for line in series
                  if line.startswith("splitserve_kv_leases_expired_total"))
    return {"series": len(series), "families": dict(families), "kv_leases_expired": expired}


def summarize(probe_dir: Path, idle_points: list[dict]) -> dict:
    """Per process (named by role): its snapshot at each idle point, and every number that grew from the
    second idle point (after the first round, the warm-up) to the last."""
    processes = {}
    for path in sorted(probe_dir.glob("*.jsonl")):
        snapshots = [json.loads(line) for line in path.read_text().splitlines()]
        snapshots = [snap for snap in snapshots if "probe_error" not in snap]
        if not snapshots:
            continue
        role = role_of(snapshots[-1])
        at_idle = [last_before(snapshots, point["t"]) for point in idle_points]
        processes[role] = {"pid": snapshots[0]["pid"], "points": [compact(snap) for snap in at_idle],
                           "grew": growth(at_idle[1], at_idle[-1]) if len(at_idle) > 2 else {}}
    return processes


def role_of(snapshot: dict) -> str:
    for cls, role in (("RouterServers", "router"), ("PrefillWorker", "prefill"), ("DecodeWorker", "decode")):
        if cls in snapshot["roots"]:
            return role
    return f"other-{snapshot['pid']}"


def last_before(snapshots: list[dict], t: float) -> dict:
    earlier = [snap for snap in snapshots if snap["t"] <= t]
    return earlier[-1] if earlier else snapshots[0]


def compact(snapshot: dict) -> dict:
    return {key: snapshot[key] for key in NUMBERS + ("rss_mb", "task_coroutines")} | {
        "containers_nonzero": {name: size for name, size in snapshot["containers"].items() if size}}


NUMBERS = ("fds", "threads", "os_threads", "asyncio_tasks", "allocated_blocks", "ray_object_refs")


def growth(before: dict, after: dict) -> dict:
    grew = {key: [before[key], after[key]] for key in NUMBERS if after[key] > before[key]}
    for section in ("instances", "containers", "types"):
        for name, size in after[section].items():
            if size > before[section].get(name, 0) and name != "kv_pool.free_blocks":
                grew[f"{section}:{name}"] = [before[section].get(name, 0), size]
    return grew


if __name__ == "__main__":
    main()
