"""The HTTP API's acceptor process (router/acceptor_process.py) in a served router: a full router's refusals are
its, byte for byte the loop's; everything else reaches the loop; slots are neither lost nor overrun; it ends
with the router, and the router accepts by itself if it ends first.

Which side answered shows in `connection: close`: the acceptor closes every connection it refuses, while the
loop keeps a keep-alive request's connection open."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.proto.splitserve.v1 import generation_pb2_grpc as pb_grpc
from splitserve.router import acceptor_process
from splitserve.router.acceptor_process import (_COUNT, _SLOTS, CONNECTIONS, GATED, MAX_FDS_PER_MESSAGE,
                                                MAX_HELD_REFUSALS, REFUSED, SLOTS, STOP, UNLOGGED, Acceptor,
                                                AcceptorProcess, RefusedRequest)
from splitserve.router.admission import Admission, AdmissionControl
from splitserve.router.busy_refusal import RefusalRules, RefusalTemplate
from splitserve.router.http_server import SlotReleasingProtocol, TakenSlot
from splitserve.router.policy import RoutingConfig
from tests.factories import child_of_killed_process, http_request, process_running, process_stat, served_apis

MODEL = "tiny-llama"
FULL_MESSAGE = "the router has 1 requests in flight, its limit (router.routing.max_in_flight_requests); retry later"
GATED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/embeddings")
ONE_SLOT = RoutingConfig(disaggregation="always", max_in_flight_requests=1)


def post(path: str, body: dict, headers: bytes = b"") -> bytes:
    data = json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (path.encode(), len(data), headers, data))


def exchange(port: int, *parts: bytes, pause_s: float = 0.0) -> bytes:
    """Send `parts` (`pause_s` apart) on a fresh connection and return the answer: its head and Content-Length
    body, or a stream up to its last event."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each part its own segment
        for index, part in enumerate(parts):
            if index:
                time.sleep(pause_s)
            sock.sendall(part)
        return _read_answer(sock)


def _read_answer(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"\r\ncontent-length: (\d+)", head)
    while (len(body) < int(length.group(1))) if length else (b"data: [DONE]" not in body):
        body += _recv(sock)
    return head + b"\r\n\r\n" + body


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    assert chunk, "the server closed the connection mid-answer"
    return chunk


def normalized(answer: bytes) -> bytes:
    """The answer with its date and fresh ids replaced (after checking their forms)."""
    answer = re.sub(rb"\r\ndate: [A-Z][a-z]{2}, \d\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT\r\n", b"\r\ndate: D\r\n",
                    answer)
    answer = re.sub(rb"\r\nrequest-id: req_[0-9a-f]{32}\r\n", b"\r\nrequest-id: req_R\r\n", answer)
    return re.sub(rb"\r\nx-request-id: [0-9a-f]{32}\r\n", b"\r\nx-request-id: X\r\n", answer)


def hold_slot(served) -> Admission:
    async def admit():
        return served.cluster.orchestrator.admit()

    return served.loop.run(admit())


def release(served, admission: Admission) -> None:
    async def release_it():
        admission.release()

    served.loop.run(release_it())


def rejections_once_counted(served, count: int, timeout_s: float = 10.0) -> dict[str, int]:
    """The router's admission rejections once `count` are in, or as they are at the deadline: the acceptor sends
    its refusals to the router for counting and logging when it is idle, after their answers went out."""
    deadline = time.monotonic() + timeout_s
    while True:
        rejections = dict(served.cluster.orchestrator.routing_stats().rejections)
        if sum(rejections.values()) >= count or time.monotonic() > deadline:
            return rejections
        time.sleep(0.01)


def acceptor_pids() -> list[int]:
    """This process's acceptor children that run."""
    return [int(entry.name) for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and (fields := process_stat(entry.name)) is not None and fields[0] != "Z"
            and int(fields[1]) == os.getpid() and b"splitserve.router.acceptor_process" in _command_line(entry)]


def _command_line(entry: Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:
        return b""


def refusals_of_a_full_router(tiny_llama_dir, caplog, acceptor: bool, ids: bool) -> dict[tuple[str, bool], bytes]:
    """Every gated path's answer (with and without the client's X-Request-Id) from a router whose one slot is
    held, as keep-alive requests; `ids`: --enable-request-id-headers. Each refused line names the Anthropic
    `request-id` its answer carried (on /v1/messages only)."""
    options = {"http_acceptor_process": acceptor, "enable_request_id_headers": ids}
    caplog.set_level(logging.INFO, logger="splitserve.access")
    caplog.clear()
    with served_apis(tiny_llama_dir, MODEL, routing=ONE_SLOT, router_options=options) as served:
        slot = hold_slot(served)
        answers = {(path, own_id): exchange(served.http_port, post(path, {"model": MODEL, "prompt": "hi"},
                                                                   b"X-Request-Id: mine-7\r\n" if own_id else b""))
                   for path in GATED_PATHS for own_id in (False, True)}
        release(served, slot)
        assert rejections_once_counted(served, len(answers)) == {"too_many_requests": len(answers)}
    logged = sorted((entry.fields["path"], entry.fields.get("anthropic_request_id")) for entry in caplog.records
                    if entry.name == "splitserve.access" and entry.getMessage().startswith("refused"))
    sent = sorted((path, None if (found := re.search(rb"\r\nrequest-id: (req_[0-9a-f]{32})\r\n", answer)) is None
                   else found.group(1).decode()) for (path, _), answer in answers.items())
    assert logged == sent and sum(anthropic_id is not None for _, anthropic_id in sent) == 2
    return answers


@pytest.mark.parametrize("ids", [True, False], ids=["request-id-headers", "no-request-id-headers"])
def test_the_acceptors_refusal_is_the_loops_byte_for_byte(tiny_llama_dir, caplog, ids):
    by_loop = refusals_of_a_full_router(tiny_llama_dir, caplog, acceptor=False, ids=ids)
    by_acceptor = refusals_of_a_full_router(tiny_llama_dir, caplog, acceptor=True, ids=ids)
    for key, answer in by_acceptor.items():
        assert answer.count(b"\r\nconnection: close\r\n") == 1 and b"connection: close" not in by_loop[key]
        assert normalized(answer).replace(b"connection: close\r\n", b"") == normalized(by_loop[key])
        assert answer.startswith(b"HTTP/1.1 429 Too Many Requests\r\n") and FULL_MESSAGE.encode() in answer
        assert (b"\r\nx-request-id: mine-7\r\n" in answer) == (ids and key[1])
    sent_id = b"x-request-id: mine-7\r\n" if ids else b""
    assert normalized(by_acceptor["/v1/messages", True]).endswith(
        b"request-id: req_R\r\nvary: Origin\r\n" + sent_id + b"connection: close\r\n\r\n"
        b'{"type":"error","error":{"type":"rate_limit_error","message":"' + FULL_MESSAGE.encode() + b'"}}')


def test_a_full_router_refuses_in_the_acceptor_and_serves_the_rest_on_the_loop(tiny_llama_dir, caplog):
    caplog.set_level(logging.INFO, logger="splitserve.access")
    completion = {"model": MODEL, "prompt": "The river runs", "max_tokens": 3, "temperature": 0}
    with served_apis(tiny_llama_dir, MODEL, routing=ONE_SLOT) as served:
        port, orchestrator = served.http_port, served.cluster.orchestrator
        slot = hold_slot(served)
        whole = exchange(port, post("/v1/completions", completion, b"X-Request-Id: whole-1\r\n"))
        split = post("/v1/completions", completion)
        in_two_parts = exchange(port, split[:40], split[40:], pause_s=0.3)  # waited for, then refused
        trickled = exchange(port, *(split[i:i + 8] for i in range(0, len(split), 8)), pause_s=0.02)  # the loop's
        chunked = exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                 b"2\r\n{}\r\n0\r\n\r\n")  # the loop's to refuse too
        probes = [http_request(port, "GET", path)[0] for path in ("/health", "/metrics", "/v1/models")]
        release(served, slot)
        served_answer = json.loads(http_request(port, "POST", "/v1/completions", json.dumps(completion).encode())[2])
        slots_after = orchestrator.admission.in_flight
        rejections = rejections_once_counted(served, 4)
    answers = (whole, in_two_parts, trickled, chunked)
    assert [answer.split(b"\r\n", 1)[0] for answer in answers] == [b"HTTP/1.1 429 Too Many Requests"] * 4
    assert [b"\r\nconnection: close\r\n" in answer for answer in answers] == [True, True, False, False]
    assert probes == [200, 200, 200]
    assert served_answer["usage"]["completion_tokens"] == 3 and slots_after == 0
    assert rejections == {"too_many_requests": 4}
    refused = [entry.fields for entry in caplog.records if entry.name == "splitserve.access"
               and entry.getMessage().startswith("refused")]
    assert [(f["path"], f["http_status"], f["client_request_id"], f["error"]) for f in refused] == [
        ("/v1/completions", 429, "whole-1", FULL_MESSAGE), *[("/v1/completions", 429, None, FULL_MESSAGE)] * 3]


@pytest.mark.parametrize("slots", [1, 3])
def test_requests_at_once_get_exactly_the_free_slots_and_the_acceptor_refuses_the_rest(tiny_llama_dir, slots):
    """Requests landing together on a router with free slots: the acceptor hands over as many as there are slots
    (the router takes each one's slot on arrival) and refuses the others itself, before the router has said the
    slots are gone; a count that forgot requests in transit, or one the router's reports got ahead of, would
    hand more over, which the loop would refuse."""
    # the admitted streams outlast the burst by far: no slot frees while it lands
    streamed = {"model": MODEL, "prompt": "The river runs", "max_tokens": 150, "temperature": 0, "ignore_eos": True,
                "stream": True}
    senders = 4 * slots + 1
    with served_apis(tiny_llama_dir, MODEL, routing=RoutingConfig(disaggregation="always",
                                                                  max_in_flight_requests=slots)) as served:
        for _ in range(2):
            answers: list[bytes] = [b""] * senders
            barrier = threading.Barrier(senders)

            def send(index: int) -> None:
                barrier.wait()
                answers[index] = exchange(served.http_port, post("/v1/completions", streamed))

            threads = [threading.Thread(target=send, args=(index,)) for index in range(senders)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            statuses = sorted(answer.split(b"\r\n", 1)[0] for answer in answers)
            assert statuses == [b"HTTP/1.1 200 OK"] * slots + [b"HTTP/1.1 429 Too Many Requests"] * (senders - slots)
            assert all(b"\r\nconnection: close\r\n" in answer for answer in answers if b" 429 " in answer[:15])
            assert served.cluster.orchestrator.admission.in_flight == 0


def test_a_drain_waits_for_the_requests_the_acceptor_handed_over(tiny_llama_dir):
    """A request whose slot the router took as the acceptor handed it over counts for the drain like any other:
    the drain waits for its stream to end, and it ends whole."""
    streamed = {"model": MODEL, "prompt": "The river runs", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                "stream": True}
    with served_apis(tiny_llama_dir, MODEL, routing=ONE_SLOT) as served:
        answer: list[bytes] = []
        stream = threading.Thread(target=lambda: answer.append(exchange(served.http_port, post("/v1/completions",
                                                                                               streamed))))
        stream.start()
        deadline = time.monotonic() + 30
        while served.cluster.orchestrator.admission.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        left = served.drain(timeout_s=60)
        stream.join(60)
    assert left == 0
    assert answer[0].startswith(b"HTTP/1.1 200 OK") and answer[0].count(b"data: {") == 60
    assert answer[0].count(b'"finish_reason": "length"') == 1 and b"data: [DONE]" in answer[0]


def test_a_client_sending_one_request_after_another_is_never_refused(tiny_llama_dir):
    """On a one-slot router, each request's slot is free again by the time its client has the answer and sends the
    next, however the answer ended (a stream, a whole body, a 400, a 404, a gRPC error status): the router
    releases the slot, and so tells the acceptor, before the answer's end goes out, and the acceptor reads that
    first."""
    completion = {"model": MODEL, "prompt": "The river runs", "max_tokens": 2, "temperature": 0}
    with served_apis(tiny_llama_dir, MODEL, routing=ONE_SLOT) as served:
        port = served.http_port
        heads = []
        with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
            generation = pb_grpc.GenerationStub(channel)
            for index in range(40):
                kind = index % 4
                if kind == 2:  # refused by gRPC validation, after admission
                    try:
                        list(generation.Generate(pb.GenerateRequest(model=MODEL, text=b"hi", request_id="a b")))
                    except grpc.RpcError as error:
                        heads.append(error.code().name)
                elif kind == 3:  # a gated path this server does not serve: 404 after admission
                    heads.append(exchange(port, post("/v1/embeddings", {"model": MODEL, "input": "hi"}))
                                 .split(b"\r\n", 1)[0])
                heads.append(exchange(port, post("/v1/completions", {**completion, "stream": kind == 1}))
                             .split(b"\r\n", 1)[0])
        refused_batch = exchange(port, post("/v1/completions", {**completion, "prompt": ["a", "b"]}))
        after_refusal = exchange(port, post("/v1/completions", completion))
    assert heads == [b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK", "INVALID_ARGUMENT", b"HTTP/1.1 200 OK",
                     b"HTTP/1.1 404 Not Found", b"HTTP/1.1 200 OK"] * 10
    assert refused_batch.startswith(b"HTTP/1.1 429") and after_refusal.startswith(b"HTTP/1.1 200 OK")


def test_the_router_accepts_by_itself_once_the_acceptor_is_gone_and_stops_it_on_the_way_out(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL, routing=ONE_SLOT) as served:
        [acceptor] = acceptor_pids()
        os.kill(acceptor, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while acceptor in acceptor_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        slot = hold_slot(served)
        refused = exchange(served.http_port, post("/v1/completions", {"model": MODEL, "prompt": "hi"}))
        release(served, slot)
        health = http_request(served.http_port, "GET", "/health")[0]
        port = served.http_port
    assert refused.startswith(b"HTTP/1.1 429") and b"connection: close" not in refused  # the loop's refusal
    assert health == 200 and acceptor_pids() == []
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # nothing listens after the stop


def test_each_slot_report_counts_exactly_the_handed_over_requests_whose_slot_was_taken():
    """The acceptor may hand out (free slots reported) - (handed over since, by its count - taken in, by the
    report's): for that never to exceed the router's real free slots, each report counts as taken in only the
    requests whose slot was taken, also while the router takes the slots of one message's requests."""

    admission = AdmissionControl(3)
    ours, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connections = [socket.socketpair() for _ in range(3)]
    served: list[Admission | None] = []

    async def scenario():
        acceptor = AcceptorProcess(socket.socket(), RefusalRules({}, None, ()), lambda: _slot(admission),
                                   lambda sock, slot: (served.append(slot), sock.close()),
                                   lambda refused, unlogged: None, lambda: None)
        acceptor.attach(ours)
        admission.watch(acceptor.report_free_slots)
        socket.send_fds(child, [GATED + _COUNT.pack(3)], [a.fileno() for a, _ in connections])
        while len(served) < 3:
            await asyncio.sleep(0.001)

    asyncio.run(scenario())
    reports = []
    child.setblocking(False)
    while True:
        try:
            reports.append(_SLOTS.unpack(child.recv(64))[1:])
        except BlockingIOError:
            break
    assert reports == [(3, 0), (2, 1), (1, 2), (0, 3)]  # free + taken in = 3 at every report
    assert all(isinstance(slot, Admission) for slot in served)
    for a, b in connections:
        a.close()
        b.close()


@contextlib.contextmanager
def full_acceptor(prepare_control: Callable[[socket.socket], None] = lambda control: None,
                  max_held_refusals: int = MAX_HELD_REFUSALS) -> Iterator[tuple[socket.socket, int]]:
    """An Acceptor in a thread of this process for a router with no free slot, refusing on /v1/completions:
    (the router's end of the control socket, the listening port); stopped on the way out. `prepare_control(child's
    end)` runs before the acceptor starts."""
    router, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    prepare_control(child)
    listening = socket.create_server(("127.0.0.1", 0))
    acceptor = Acceptor(child, listening, RefusalRules({"/v1/completions": SHORT_429}, None, ()), max_held_refusals)
    router.send(_SLOTS.pack(SLOTS, 0, 0))
    serving = threading.Thread(target=acceptor.run)
    serving.start()
    router.settimeout(10)
    try:
        yield router, listening.getsockname()[1]
    finally:
        router.send(STOP)
        serving.join(10)
        router.close()
    assert not serving.is_alive()


SHORT_429 = RefusalTemplate(b"HTTP/1.1 429 Too Many Requests\r\n", ((b"content-length", b"4"),), b"full")
SHORT_429_SENT = b"HTTP/1.1 429 Too Many Requests\r\ndate: D\r\ncontent-length: 4\r\nconnection: close\r\n\r\nfull"
LONG_ID_REQUEST = post("/v1/completions", {"model": MODEL, "prompt": "hi"}, b"X-Request-Id: " + b"r" * 200 + b"\r\n")


def test_an_acceptor_whose_router_does_not_read_still_refuses():
    """The acceptor never blocks on the router: with the router's end of the control socket unread (its loop
    stalled) and a send buffer that holds only a few messages, a full router's requests are still answered 429,
    and the refusals reach the router once it reads again."""
    smallest_buffer = lambda control: control.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)  # noqa: E731
    with full_acceptor(smallest_buffer) as (router, port):  # the kernel's least: a few messages
        answers = [exchange(port, LONG_ID_REQUEST) for _ in range(300)]
        refused: list[RefusedRequest] = []
        while len(refused) < 300:
            message = router.recv(1 << 16)
            assert message[:1] == REFUSED
            refused.extend(RefusedRequest.batch_from_wire(message[1:]))
    assert [normalized(answer) for answer in answers] == [SHORT_429_SENT] * 300
    assert refused == [RefusedRequest("/v1/completions", "r" * 200, None)] * 300


def _fill(control: socket.socket) -> None:
    """The control socket full before the first refusal: a router that stopped reading (each message `-`)."""
    control.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            control.send(b"-")


def test_an_acceptor_holds_a_bounded_number_of_refusal_records_for_a_router_that_does_not_read():
    """Past max_held_refusals records the acceptor only counts its refusals; the router gets the records it held
    and then the count, and every refusal is answered alike."""
    with full_acceptor(_fill, max_held_refusals=50) as (router, port):
        answers = [exchange(port, LONG_ID_REQUEST) for _ in range(300)]
        refused: list[RefusedRequest] = []
        while (message := router.recv(1 << 16))[:1] in (b"-", REFUSED):
            refused.extend(RefusedRequest.batch_from_wire(message[1:]) if message[:1] == REFUSED else [])
    assert {normalized(answer) for answer in answers} == {SHORT_429_SENT}
    assert refused == [RefusedRequest("/v1/completions", "r" * 200, None)] * 50
    assert (message[:1], _COUNT.unpack(message[1:])[0]) == (UNLOGGED, 250)


def test_the_router_counts_refusals_without_records_and_says_so_once(caplog):
    from types import SimpleNamespace

    from splitserve.router.openai_server import account_busy_refusals
    from splitserve.router.orchestrator import Orchestrator

    caplog.set_level(logging.INFO)
    router = Orchestrator("r", (), [SimpleNamespace(worker_id="decode-0")], None, "colocated")
    account_busy_refusals(router, True, [RefusedRequest("/v1/completions", "a-1", None),
                                         RefusedRequest("/v1/messages", None, "req_0f")], 0)
    account_busy_refusals(router, True, [], 250)
    assert dict(router.routing_stats().rejections) == {"too_many_requests": 252}
    assert [(record.name, record.levelname, record.getMessage()) for record in caplog.records] == [
        ("splitserve.access", "INFO", 'refused method="POST" path="/v1/completions" http_status=429 '
                                      'client_request_id="a-1" error="the router has 1024 requests in flight, its '
                                      'limit (router.routing.max_in_flight_requests); retry later"'),
        ("splitserve.access", "INFO", 'refused method="POST" path="/v1/messages" http_status=429 '
                                      'error="the router has 1024 requests in flight, its limit '
                                      '(router.routing.max_in_flight_requests); retry later" '
                                      'anthropic_request_id="req_0f"'),
        ("splitserve.router.openai_server", "WARNING", "250 requests the HTTP acceptor refused (429) have no line "
                                                       "in the access log: the router did not take their records in "
                                                       "time")]


def test_a_connection_that_sends_nothing_is_dropped_and_a_head_not_whole_in_time_is_handed_off(monkeypatch):
    """A client that closes before sending anything is nobody's (the router hears nothing of it); one whose head is
    not whole within HEAD_WAIT_S goes to the loop with what it sent still unread."""
    monkeypatch.setattr(acceptor_process, "HEAD_WAIT_S", 0.3)
    with full_acceptor() as (router, port):
        socket.create_connection(("127.0.0.1", port)).close()
        with socket.create_connection(("127.0.0.1", port)) as slow:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x")
            started = time.monotonic()
            message, fds, _, _ = socket.recv_fds(router, 1 << 16, MAX_FDS_PER_MESSAGE)
            waited_s = time.monotonic() - started
            handed = [socket.socket(fileno=fd) for fd in fds]
            handed[0].settimeout(10)
            unread = handed[0].recv(100)
            for sock in handed:
                sock.close()
    assert (message, len(handed), unread) == (CONNECTIONS, 1, b"POST /v1/completions HTTP/1.1\r\nHost: x")
    assert 0.2 < waited_s < 5


def _slot(admission) -> Admission | None:
    decision = admission.try_admit()
    return decision if isinstance(decision, Admission) else None


def test_a_slot_taken_for_a_connection_is_released_if_the_connection_ends_first():
    released: list[int] = []
    taken_by_request, lost_first = TakenSlot(Admission(lambda: released.append(1))), \
        TakenSlot(Admission(lambda: released.append(2)))

    class Inner(asyncio.Protocol):
        lost = 0

        def connection_lost(self, exc):
            Inner.lost += 1

    request_slot = taken_by_request.take()
    SlotReleasingProtocol(Inner(), taken_by_request).connection_lost(None)
    SlotReleasingProtocol(Inner(), lost_first).connection_lost(None)
    assert (released, Inner.lost, lost_first.take()) == ([2], 2, None)
    request_slot.release()
    assert released == [2, 1]


_HOLD_S = 6.0
_KILLED_ROUTER = f"""
import asyncio, os, socket, time
from splitserve.router.acceptor_process import AcceptorProcess
from splitserve.router.busy_refusal import RefusalRules

async def main():
    listening = socket.create_server(("127.0.0.1", 0))
    acceptor = AcceptorProcess(listening, RefusalRules({{}}, None, ()), lambda: None, lambda sock, slot: sock.close(),
                               lambda refused, unlogged: None, lambda: None)
    acceptor.start()
    if os.fork() == 0:  # holds a copy of the router's end of the control socket for {_HOLD_S} s after the router dies
        time.sleep({_HOLD_S})
        os._exit(0)
    probe = socket.create_connection(listening.getsockname())
    probe.setblocking(False)
    await asyncio.wait_for(asyncio.get_running_loop().sock_recv(probe, 1), 10)  # closed once handed over: it runs
    print(acceptor.pid, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, input)

asyncio.run(main())
"""


def test_the_acceptor_ends_with_a_router_that_is_killed():
    """By the kernel's death signal: the control socket's end of file cannot tell it here (a forked copy of the
    router's end outlives the router by _HOLD_S, longer than the test waits)."""
    acceptor, ran = child_of_killed_process(_KILLED_ROUTER, timeout_s=_HOLD_S / 2)
    assert ran and not process_running(acceptor)


def test_the_acceptor_process_imports_only_the_standard_library():
    """It starts on every router start and runs beside the router: none of the router's dependencies load in it."""
    probe = ("import sys; before = set(sys.modules); import splitserve.router.acceptor_process; "
             "print(sorted({name.split('.')[0] for name in set(sys.modules) - before} - sys.stdlib_module_names))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).parents[1]).stdout.strip()
    assert loaded == "['splitserve']"
