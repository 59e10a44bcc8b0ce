"""Burst rejection latency: how long a client waits for its "too many requests" under a burst.

N requests (default 2,500) hit the router's OpenAI HTTP API at once, over loopback, while its
admission limit (router.routing.max_in_flight_requests, default here 16) lets only a few in. The
cluster is the local launcher's on Ray, bound to loopback (the router in this process, 1 prefill +
1 decode actor of the tests' tiny Llama, NIXL); the client is a spawned process with its own GIL
that opens every connection at once (non-blocking sockets, one request each) and sends each
request as soon as its connection is up. Each request is timed from its send to the kernel's receive timestamp of the
reply's bytes (SO_TIMESTAMPNS), so the client's own backlog of 2,500 replies to read does not
count as the router's latency (the JSON also holds that client-observed time, `seen_head`):

- rejected (429): to its status line; every one must carry the admission message and a
  Retry-After header;
- admitted (200, streamed, max_tokens --max-tokens): to its first SSE event (TTFT) and its end.

The burst is sent --bursts times (default 5), a second apart, to the same cluster: the percentiles pool
them, and each burst's p99 is in the JSON too (on 2 shared cores one burst's p99 varies by 2x from the
next's).

The router's acceptor process (router/acceptor_process.py) answers the refusals: an epoll loop of its
own, off the router's event loop. Then the same client bursts at two bare servers in their own
processes that answer every request with a canned 429 (no HTTP framework, no router), measured in the
same run: an asyncio server (the floor of a single Python event loop, where the router's refusals were
answered before the acceptor), and an epoll loop that only accepts, reads a request's head, answers
and closes (the floor of the acceptor's way of doing it in Python on this machine).

Writes bench/results/admission_burst.json and .png; exits 1 when the rejections' p99 misses the
100 ms target (pooled). Bounded: --bursts bursts, every request with a timeout (--timeout-s), each client and
bare server is joined or killed, and the Ray session it started is shut down.

Run: .venv/bin/python bench/admission_burst.py                  (about a minute and a half on 2 cores)
     .venv/bin/python bench/admission_burst.py --requests 500 --limit 8
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import platform
import selectors
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
PROMPT = "The river runs"
TARGET_P99_S = 0.1
"""Issue 20's target for the rejections' p99."""
BURST_GAP_S = 1.0
"""Pause between two bursts of one run."""


# ---- the client (a spawned process: only the standard library) ------------------------------
SO_TIMESTAMPNS = 35
"""Linux's SO_TIMESTAMPNS (asm-generic/socket.h; Python's socket module does not name it): each
recvmsg carries the wall-clock time the kernel received the data, so a reply is timed when it
arrived, not when this single-threaded client got round to reading it."""
_TIMESPEC = struct.Struct("@qq")


class _Connection:
    """One request on its own non-blocking connection, and what arrived on it."""

    def __init__(self, port: int, request: bytes) -> None:
        self.request = request
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connect_ns = time.time_ns()
        self.sock.connect_ex(("127.0.0.1", port))
        self.sent_ns: int | None = None
        self.head_ns: int | None = None
        """Kernel arrival of the reply's first bytes (its status line)."""
        self.first_event_ns: int | None = None
        """Kernel arrival of the bytes holding the first SSE event."""
        self.end_ns: int | None = None
        self.seen_head_ns: int | None = None
        """When this client read the first bytes (what a client without kernel timestamps measures)."""
        self.data = bytearray()
        self.error: str | None = None

    def send(self) -> None:
        self.sent_ns = time.time_ns()
        self.sock.sendall(self.request)  # a few hundred bytes: the socket buffer takes them at once

    def receive(self) -> bool:
        """Read what arrived; True once the server closed the connection."""
        chunk, ancillary, _, _ = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(_TIMESPEC.size))
        arrived_ns = next((sec * 10**9 + nsec for level, kind, value in ancillary
                           if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS
                           for sec, nsec in [_TIMESPEC.unpack(value[:_TIMESPEC.size])]), time.time_ns())
        if not chunk:
            self.end_ns = self.end_ns or arrived_ns
            return True
        if self.head_ns is None:
            self.head_ns, self.seen_head_ns = arrived_ns, time.time_ns()
        self.data += chunk
        if self.first_event_ns is None and b"data: " in self.data.partition(b"\r\n\r\n")[2]:
            self.first_event_ns = arrived_ns
        self.end_ns = arrived_ns
        return False

    def record(self) -> dict:
        head, _, body = bytes(self.data).partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1]) if lines[0].startswith("HTTP/") else None
        headers = {name.strip().lower(): value.strip() for name, _, value in (h.partition(":") for h in lines[1:])}
        message = None
        if status not in (None, 200):
            try:
                message = json.loads(body)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = body[:200].decode("latin-1")
        since = lambda ns: None if ns is None or self.sent_ns is None else (ns - self.sent_ns) / 1e9  # noqa: E731
        return {"status": status, "head_s": since(self.head_ns), "ttft_s": since(self.first_event_ns),
                "end_s": since(self.end_ns), "seen_head_s": since(self.seen_head_ns), "sent_ns": self.sent_ns,
                "connect_ns": self.connect_ns, "message": message, "retry_after": headers.get("retry-after"),
                "error": self.error}


def burst(port: int, num_requests: int, max_tokens: int, timeout_s: float) -> list[dict]:
    """Open every connection at once, send each request as soon as its connection is up, and read
    every reply to its end (or until timeout_s)."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    selector = selectors.DefaultSelector()
    connections = [_Connection(port, request) for _ in range(num_requests)]
    for connection in connections:
        selector.register(connection.sock, selectors.EVENT_WRITE, connection)
    open_count, deadline = num_requests, time.monotonic() + timeout_s
    while open_count and time.monotonic() < deadline:
        for key, events in selector.select(timeout=0.5):
            connection: _Connection = key.data
            try:
                if connection.sent_ns is None:
                    connection.send()
                    selector.modify(connection.sock, selectors.EVENT_READ, connection)
                elif connection.receive():
                    selector.unregister(connection.sock)
                    open_count -= 1
            except OSError as error:
                connection.error = f"{type(error).__name__}: {error}"
                selector.unregister(connection.sock)
                open_count -= 1
    for connection in connections:
        if connection.end_ns is None and connection.error is None:
            connection.error = "timed out"
        connection.sock.close()
    selector.close()
    return [connection.record() for connection in connections]


def client_main(port: int, num_requests: int, max_tokens: int, timeout_s: float, out: multiprocessing.Queue) -> None:
    started = time.perf_counter()
    records = burst(port, num_requests, max_tokens, timeout_s)
    out.put((records, time.perf_counter() - started))


def run_bursts(port: int, args: argparse.Namespace) -> tuple[list[dict], list[float]]:
    """args.bursts bursts one after another (BURST_GAP_S apart, so the admitted requests of one are done before
    the next): every burst's records, each with its `burst` index, and each client's wall seconds."""
    records, walls = [], []
    for index in range(args.bursts):
        if index:
            time.sleep(BURST_GAP_S)
        burst_records, wall_s = run_client(port, args)
        records += [{**record, "burst": index} for record in burst_records]
        walls.append(round(wall_s, 3))
    return records, walls


def run_client(port: int, args: argparse.Namespace) -> tuple[list[dict], float]:
    """One burst from a spawned client process (killed if it outlives its bound): (records, its wall seconds)."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    client = context.Process(target=client_main, args=(port, args.requests, args.max_tokens, args.timeout_s, out))
    client.start()
    try:
        result = out.get(timeout=args.timeout_s + 60)
        client.join(10)
        return result
    finally:
        if client.is_alive():
            client.kill()
            client.join(5)


# ---- the floor: a bare asyncio server (a spawned process) ------------------------------------
_CANNED_429 = (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
               b"content-length: 28\r\nconnection: close\r\n\r\n{\"error\":{\"message\":\"full\"}}")


def bare_server_main(ready: multiprocessing.Queue, stop: multiprocessing.Event) -> None:
    """Answer every request with a canned 429 as soon as its head is in: what one Python event loop
    on this machine costs per connection, with no HTTP framework and no router behind it."""
    import asyncio

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_CANNED_429)
        writer.close()

    async def serve() -> None:
        server = await asyncio.start_server(answer, "127.0.0.1", 0, backlog=socket.SOMAXCONN)
        ready.put(server.sockets[0].getsockname()[1])
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        server.close()

    asyncio.run(serve())


def bare_epoll_server_main(ready: multiprocessing.Queue, stop: multiprocessing.Event) -> None:
    """Answer every request with a canned 429 as soon as its head is in, from a plain epoll loop: the least
    a Python process does per refused connection (accept, read, write, close), with no decision and no
    router behind it. The answer goes out with the FIN on one segment (MSG_MORE, then close), as the
    acceptor's does."""
    import select

    listening = socket.create_server(("127.0.0.1", 0), backlog=socket.SOMAXCONN)
    listening.setblocking(False)
    ready.put(listening.getsockname()[1])
    epoll, heads = select.epoll(), {}
    epoll.register(listening.fileno(), select.EPOLLIN)
    while not stop.is_set():
        for fd, _ in epoll.poll(0.2):
            if fd == listening.fileno():
                while True:
                    try:
                        connection, _ = listening.accept()
                    except BlockingIOError:
                        break
                    heads[connection.fileno()] = (connection, bytearray())
                    epoll.register(connection.fileno(), select.EPOLLIN)
                continue
            connection, head = heads[fd]
            chunk = connection.recv(65536)
            head += chunk
            if not chunk or b"\r\n\r\n" in head:
                epoll.unregister(fd)
                del heads[fd]
                if chunk:
                    connection.send(_CANNED_429, socket.MSG_MORE)
                connection.close()
    listening.close()


def run_floor(args: argparse.Namespace, server_main: Callable) -> list[dict]:
    """The same bursts against a bare server (bare_server_main, bare_epoll_server_main)."""
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Queue(), context.Event()
    server = context.Process(target=server_main, args=(ready, stop))
    server.start()
    try:
        records, _ = run_bursts(ready.get(timeout=60), args)
    finally:
        stop.set()
        server.join(10)
        if server.is_alive():
            server.kill()
            server.join(5)
    return records


# ---- the server side ---------------------------------------------------------------------
def run_burst(args: argparse.Namespace, model_dir: Path) -> tuple[list[dict], list[float], dict]:
    """Start the cluster (Ray on loopback: the router in this process, each worker an actor), run
    the bursts' client processes, and stop everything it started."""
    from splitserve.testing.local_cluster import running_cluster, tiny_cluster_config

    config = tiny_cluster_config(model_dir, **{"router.routing.max_in_flight_requests": args.limit,
                                               "router.replicas": args.routers, "router.resources.num_cpus": 0.25,
                                               "router.http_acceptor_process": args.acceptor})
    with running_cluster(config) as (cluster, loop):
        port = cluster.router_ports.http
        print(f"{args.routers} router(s) on 127.0.0.1:{port} (max_in_flight_requests {args.limit} each); sending "
              f"{args.requests} requests at once, {args.bursts} times", flush=True)
        records, wall_s = run_bursts(port, args)
        if cluster.orchestrator is None:  # router actors: their loops' statistics stay in their processes
            return records, wall_s, {}
        orchestrator = cluster.orchestrator
        lag = orchestrator.loop_lag.stats()
        rejections = dict(orchestrator.routing_stats().rejections)
    over_100ms = lag.count - lag.bucket_counts[lag.buckets.index(0.1)]
    return records, wall_s, {"admission_rejections": rejections, "loop_lag_beats": lag.count,
                             "loop_lag_mean_ms": _ms(lag.sum_s / lag.count if lag.count else None),
                             "loop_lag_beats_over_100ms": over_100ms}


# ---- statistics and output -----------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    from splitserve.planner.samples import nearest_rank

    return nearest_rank(sorted(values), q / 100) if values else None


def summary(values: list[float]) -> dict:
    return {"count": len(values), "p50_ms": _ms(percentile(values, 50)), "p90_ms": _ms(percentile(values, 90)),
            "p99_ms": _ms(percentile(values, 99)), "max_ms": _ms(max(values, default=None)),
            "mean_ms": _ms(statistics.fmean(values) if values else None)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def summarize(args: argparse.Namespace, records: list[dict], wall_s: list[float], server: dict,
              floor: list[dict], epoll_floor: list[dict]) -> dict:
    rejected = [r for r in records if r["status"] == 429]
    admitted = [r for r in records if r["status"] == 200]
    by_status: dict[str, int] = {}
    for record in records:
        key = str(record["status"]) if record["status"] is not None else record["error"] or "no answer"
        by_status[key] = by_status.get(key, 0) + 1
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {multiprocessing.cpu_count()} cores, Python {platform.python_version()}",
        "commit": _commit(),
        "config": {"requests": args.requests, "routers": args.routers, "max_in_flight_requests": args.limit,
                   "acceptor_process": args.acceptor, "bursts": args.bursts,
                   "max_tokens": args.max_tokens,
                   "api": "OpenAI HTTP /v1/completions, streamed, one connection per request"},
        "by_status": by_status,
        "sends_spread_ms_per_burst": [_sends_spread_ms(of_burst(records, index)) for index in range(args.bursts)],
        "rejected_latency": summary([r["head_s"] for r in rejected]),
        "rejected_p99_ms_per_burst": _p99_per_burst(records, args.bursts),
        "rejected_seen_by_client": summary([r["seen_head_s"] for r in rejected]),
        "floor_bare_asyncio_server": summary([r["head_s"] for r in floor if r["status"] == 429]),
        "floor_bare_epoll_server": summary([r["head_s"] for r in epoll_floor if r["status"] == 429]),
        "floor_bare_epoll_server_p99_ms_per_burst": _p99_per_burst(epoll_floor, args.bursts),
        "rejected_messages": sorted({r["message"] for r in rejected}),
        "rejected_without_retry_after": sum(1 for r in rejected if r["retry_after"] is None),
        "admitted_ttft": summary([r["ttft_s"] for r in admitted if r["ttft_s"] is not None]),
        "admitted_e2e": summary([r["end_s"] for r in admitted if r["end_s"] is not None]),
        "client_wall_s": wall_s,
        "server": server,
        "target_rejected_p99_ms": TARGET_P99_S * 1000,
    }


def of_burst(records: list[dict], index: int) -> list[dict]:
    return [r for r in records if r["burst"] == index]


def _p99_per_burst(records: list[dict], bursts: int) -> list[float | None]:
    """Each burst's p99 of its rejections (bursts of one run differ: the pooled p99 hides how much)."""
    return [summary([r["head_s"] for r in of_burst(records, index) if r["status"] == 429])["p99_ms"]
            for index in range(bursts)]


def _sends_spread_ms(records: list[dict]) -> float | None:
    """From a burst's first connect to its last send."""
    sent = [r["sent_ns"] for r in records if r["sent_ns"] is not None]
    return _ms((max(sent) - min(r["connect_ns"] for r in records)) / 1e9) if sent else None


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def plot(records: list[dict], floor: list[dict], epoll_floor: list[dict], result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    series = [("rejected (429): to the status line", [r["head_s"] for r in records if r["status"] == 429]),
              ("admitted (200): TTFT", [r["ttft_s"] for r in records if r["status"] == 200 and r["ttft_s"]]),
              ("floor: a bare asyncio server's canned 429", [r["head_s"] for r in floor if r["status"] == 429]),
              ("floor: a bare epoll loop's canned 429", [r["head_s"] for r in epoll_floor if r["status"] == 429])]
    for label, values in series:
        if values:
            ordered = sorted(v * 1000 for v in values)
            ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=f"{label} (n={len(values)})")
    ax.axvline(TARGET_P99_S * 1000, color="grey", linestyle="--", label="target p99 of rejections")
    ax.set_xscale("log")
    ax.set_xlabel("ms from the request's send to the reply's arrival")
    ax.set_ylabel("fraction of requests")
    config = result["config"]
    accepting = "an acceptor process refuses" if config["acceptor_process"] else "the router's loop refuses"
    ax.set_title(f"{config['requests']} requests at once ({config['bursts']} bursts pooled), max_in_flight_requests "
                 f"{config['max_in_flight_requests']}, {accepting}", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2500, help="requests in the burst")
    parser.add_argument("--limit", type=int, default=16, help="router.routing.max_in_flight_requests (per router)")
    parser.add_argument("--routers", type=int, default=1,
                        help="router.replicas: routers sharing the port with SO_REUSEPORT (each a Ray actor when > 1)")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens of each admitted request")
    parser.add_argument("--bursts", type=int, default=5, help="bursts one after another in the same cluster (and "
                        "against each floor); the percentiles pool them")
    parser.add_argument("--no-acceptor", dest="acceptor", action="store_false",
                        help="router.http_acceptor_process false: the router's event loop accepts and refuses")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="bound on each request")
    parser.add_argument("--out", type=Path, default=RESULTS / "admission_burst.json")
    args = parser.parse_args()
    if not 1 <= args.requests <= 10_000:
        parser.error("--requests must be in [1, 10000]")
    if not 1 <= args.bursts <= 20:
        parser.error("--bursts must be in [1, 20]")

    from splitserve.engine.tiny_model import build_tiny_model
    from splitserve.testing.tiny_models import TINY_SPECS

    with tempfile.TemporaryDirectory(prefix="admission-burst-") as tmp:
        model_dir = build_tiny_model(Path(tmp) / "llama", TINY_SPECS["llama"])
        records, wall_s, server = run_burst(args, model_dir)
    floor, epoll_floor = run_floor(args, bare_server_main), run_floor(args, bare_epoll_server_main)
    result = summarize(args, records, wall_s, server, floor, epoll_floor)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(records, floor, epoll_floor, result, args.out.with_suffix(".png"))
    shown = ("by_status", "sends_spread_ms_per_burst", "rejected_latency", "rejected_p99_ms_per_burst",
             "floor_bare_asyncio_server", "floor_bare_epoll_server", "floor_bare_epoll_server_p99_ms_per_burst",
             "admitted_ttft", "server")
    print(json.dumps({key: result[key] for key in shown}, indent=2))
    p99 = result["rejected_latency"]["p99_ms"]
    return 0 if p99 is not None and p99 < TARGET_P99_S * 1000 else 1


if __name__ == "__main__":
    sys.exit(main())
