"""The splitserve.v1.Generation API as a generic gRPC client sees it (grpcurl, Postman, Evans,
language SDKs without our stubs): the service, its messages and their fields learned from server
reflection alone, calls made with dynamic message classes; and how a call that runs out of time or
is cancelled ends, on the wire and in the router's accounting, with every worker freed."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format
from google.protobuf.message_factory import GetMessageClass
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from tests.factories import ServedApis, served_apis, stream_tokens

MODEL = "tiny-llama"
PROMPT = "The river runs"
LONG = 2000
"""max_tokens of requests that run out of time or are cancelled (the tiny model decodes about 1000
tokens/s: they would run for seconds)."""


class Served(ServedApis):
    def generic_generate(self, channel: grpc.Channel):
        """Generate as a client without stubs makes it: descriptors by reflection, dynamic messages.
        Returns (the call, the request message class)."""
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        method = pool.FindServiceByName("splitserve.v1.Generation").FindMethodByName("Generate")
        request_class, response_class = GetMessageClass(method.input_type), GetMessageClass(method.output_type)
        call = channel.unary_stream("/splitserve.v1.Generation/Generate",
                                    request_serializer=request_class.SerializeToString,
                                    response_deserializer=response_class.FromString)
        return call, request_class

    def decode_generation_tokens(self) -> int:
        return sum(self.loop.run(w.stats()).engine.num_generation_tokens for w in self.cluster.decode_workers)

    def failures(self) -> tuple[float, float]:
        """(requests ended DEADLINE_EXCEEDED, ... CANCELLED) by the router's metrics."""
        return (self.requests_ended("request_failure", code="DEADLINE_EXCEEDED"),
                self.requests_ended("request_failure", code="CANCELLED"))

    def assert_freed(self) -> None:
        self.loop.run(self.cluster.wait_idle())
        assert (self.cluster.orchestrator.admission.in_flight, self.cluster.orchestrator.num_in_flight) == (0, 0)


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL, served_class=Served) as served:
        yield served


def _request(request_class, max_tokens: int):
    """A greedy request written as a generic client writes it: proto3 JSON (bytes are base64)."""
    return json_format.ParseDict({"model": MODEL, "text": "VGhlIHJpdmVyIHJ1bnM=",  # PROMPT
                                  "sampling": {"temperature": 0, "maxTokens": max_tokens, "ignoreEos": True}},
                                 request_class())


def test_a_client_with_only_reflection_streams_the_typed_clients_output(served):
    typed_ids, typed_text, typed = stream_tokens(served.grpc_port, pb.GenerateRequest(
        model=MODEL, text=PROMPT.encode(), sampling=pb.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        call, request_class = served.generic_generate(channel)
        responses = [json_format.MessageToDict(r) for r in call(_request(request_class, 6), timeout=60)]
    assert [t for r in responses for t in r["tokenIds"]] == typed_ids and len(typed_ids) == 6
    assert "".join(r.get("text", "") for r in responses) == typed_text
    usage = responses[-1]["usage"]
    assert (responses[-1]["finishReason"], usage["promptTokens"], usage["completionTokens"]) == (
        "length", typed[-1].usage.prompt_tokens, 6)


def test_a_cache_salt_shares_the_prefix_cache_only_with_requests_of_its_own_salt(served):
    prompt = list(range(200, 243))  # 5 full blocks of 8 and 3 tokens

    def cached_tokens(**salt) -> int:
        request = pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIds(ids=prompt), **salt,
                                     sampling=pb.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        return stream_tokens(served.grpc_port, request)[2][-1].usage.cached_tokens

    assert [cached_tokens(cache_salt="user-a"), cached_tokens(cache_salt="user-a"), cached_tokens(cache_salt="user-b"),
            cached_tokens(), cached_tokens()] == [0, 40, 0, 0, 40]
    with pytest.raises(grpc.RpcError) as error:
        cached_tokens(cache_salt="")
    assert (error.value.code(), error.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                           'cache_salt: must be a non-empty string, got ""')
    served.assert_freed()


def test_a_deadline_that_passes_mid_request_ends_it_as_deadline_exceeded(served):
    """The client's deadline cancels the call on the server (gRPC's own timer) the instant the
    request's deadline passes: the router records DEADLINE_EXCEEDED (the request ran out of time,
    which counts against the SLO), not CANCELLED (the client withdrew, which does not)."""
    (deadlines, cancels), before = served.failures(), served.decode_generation_tokens()
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        call, request_class = served.generic_generate(channel)
        with pytest.raises(grpc.RpcError) as error:
            list(call(_request(request_class, LONG), timeout=0.5))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    served.assert_freed()
    assert served.failures() == (deadlines + 1, cancels)
    assert served.decode_generation_tokens() - before < LONG // 2


def test_a_cancelled_call_ends_as_cancelled_and_frees_the_workers(served):
    (deadlines, cancels), before = served.failures(), served.decode_generation_tokens()
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        call, request_class = served.generic_generate(channel)
        responses = call(_request(request_class, LONG), timeout=60)
        received = [next(responses) for _ in range(3)]
        responses.cancel()
    assert all(r.finish_reason == "" for r in received)
    assert responses.code() == grpc.StatusCode.CANCELLED
    served.assert_freed()
    assert served.failures() == (deadlines, cancels + 1)
    assert served.decode_generation_tokens() - before < LONG // 2


def test_an_ipv6_host_is_bound_as_grpc_spells_it():
    """--host ::1 passed the preflight, then grpc refused "::1:50051" (it wants "[::1]:50051") once Ray and the
    workers had started."""
    import asyncio

    from splitserve.router.tls import bind_grpc_port

    async def bind() -> int:
        server = grpc.aio.server()
        try:
            return bind_grpc_port(server, "::1", 0, None)
        finally:
            await server.stop(None)

    assert asyncio.run(bind()) > 0


def test_a_grpc_port_taken_since_the_preflight_is_an_os_error_naming_the_address():
    """What `serve` reports as one line (it catches OSError); grpc itself raises a RuntimeError."""
    import asyncio
    import socket

    from splitserve.router.tls import bind_grpc_port

    async def bind(port: int) -> int:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        try:
            return bind_grpc_port(server, "127.0.0.1", port, None)
        finally:
            await server.stop(None)

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as error:
            asyncio.run(bind(port))
    assert str(error.value) == f"cannot listen on 127.0.0.1:{port}"

