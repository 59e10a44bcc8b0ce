"""The Triton / KServe v2 gRPC API (inference.GRPCInferenceService) on the router's gRPC port, driven
by the real `tritonclient.grpc` (unmodified) with the vLLM backend's tensors: the wire format
against tritonclient's own descriptors, health and metadata, streamed and whole outputs equal to
the splitserve gRPC API's greedy text, sampling parameters, errors, and cancellation.
(API-key auth over this API is tested in test_auth.py, beside the other APIs'.)"""

from __future__ import annotations

import importlib.metadata
import json
import queue

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from transformers import AutoTokenizer
from tritonclient.grpc import model_config_pb2 as triton_model_config_pb2
from tritonclient.grpc import service_pb2 as triton_service_pb2
from tritonclient.utils import InferenceServerException

from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import SamplingParams
from splitserve.proto.inference import grpc_service_pb2 as ipb
from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.router.triton_protocol import parse_infer_request
from tests.factories import ServedApis, make_request_limits, served_apis, stream_tokens

MODEL = "tiny-llama"
PROMPT = "The river runs"
GREEDY = {"temperature": 0, "ignore_eos": True}
LONG = 2000
"""max_tokens of a request the test cancels (the tiny model decodes about 1000 tokens/s)."""


class Served(ServedApis):
    def client(self) -> triton.InferenceServerClient:
        return triton.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")

    def grpc_text(self, prompt: str = PROMPT, **sampling) -> tuple[list[int], str]:
        """Token ids and text of the splitserve Generate API for the same request."""
        request = pb.GenerateRequest(model=MODEL, text=prompt.encode(), sampling=pb.SamplingParams(**sampling))
        token_ids, text, _ = stream_tokens(self.grpc_port, request)
        return token_ids, text

    def infer(self, inputs: list[triton.InferInput], **kwargs) -> triton.InferResult:
        with self.client() as client:
            return client.infer(MODEL, inputs, client_timeout=60, **kwargs)

    def stream(self, *requests: dict, enable_empty_final_response: bool = False) -> list:
        """Send each request (async_stream_infer keyword arguments) on one stream; every response
        in arrival order: InferResults, or InferenceServerExceptions for failed requests."""
        received: queue.Queue = queue.Queue()
        with self.client() as client:
            client.start_stream(callback=lambda result, error: received.put(error or result), stream_timeout=60)
            for request in requests:
                client.async_stream_infer(MODEL, enable_empty_final_response=enable_empty_final_response, **request)
            client.stop_stream()  # half-closes, then waits for the server to end the stream
        return list(received.queue)

    def decode_generation_tokens(self) -> int:
        return sum(self.loop.run(w.stats()).engine.num_generation_tokens for w in self.cluster.decode_workers)

    def wait_idle(self) -> None:
        self.loop.run(self.cluster.wait_idle())


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL, served_class=Served) as served:
        yield served


def _inputs(prompt: str | None = PROMPT, stream: bool | None = None, sampling: dict | str | None = None,
            exclude_input: bool | None = None) -> list[triton.InferInput]:
    """The vLLM backend's input tensors; None leaves a tensor out."""
    tensors = []
    for name, value in (("text_input", prompt), ("stream", stream), ("sampling_parameters", sampling),
                        ("exclude_input_in_output", exclude_input)):
        if value is None:
            continue
        if isinstance(value, bool):
            tensor = triton.InferInput(name, [1], "BOOL")
            tensor.set_data_from_numpy(np.array([value], dtype=bool))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            tensor = triton.InferInput(name, [1], "BYTES")
            tensor.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        tensors.append(tensor)
    return tensors


def _text(result: triton.InferResult, name: str = "text_output") -> str:
    (value,) = result.as_numpy(name)
    return value.decode()


def _final(result: triton.InferResult) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


# ---- the wire format ----------------------------------------------------------------------

def _fields(descriptor) -> list[tuple]:
    proto = descriptor_pb2.DescriptorProto()
    descriptor.CopyToProto(proto)
    return [(f.name, f.number, f.type, f.label, f.type_name) for f in proto.field]


SENT_ONLY = {"inference.ModelConfig", "inference.ModelInput", "inference.ModelOutput"}
"""Parts of model_config.proto declared as a subset (the server only sends them)."""


def _messages(file) -> dict:
    """Every message of a file (nested ones too) by full name."""
    found, pending = {}, list(file.message_types_by_name.values())
    while pending:
        message = pending.pop()
        found[message.full_name] = message
        pending.extend(message.nested_types)
    return found


def test_every_message_and_method_matches_tritonclients_protocol():
    ours = _messages(ipb.DESCRIPTOR)
    theirs = {**_messages(triton_service_pb2.DESCRIPTOR), **_messages(triton_model_config_pb2.DESCRIPTOR)}
    assert len(ours) == 30
    for name, message in ours.items():
        if name in SENT_ONLY:  # declared with the fields the server sets, each as the protocol numbers it
            assert set(_fields(message)) < set(_fields(theirs[name])), name
        else:
            assert _fields(message) == _fields(theirs[name]), name
    data_type = triton_model_config_pb2.DESCRIPTOR.enum_types_by_name["DataType"]
    assert [(v.name, v.number) for v in ipb.DataType.DESCRIPTOR.values] == [(v.name, v.number)
                                                                           for v in data_type.values]
    service = ipb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    reference = triton_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert [m.name for m in service.methods] == ["ServerLive", "ServerReady", "ServerMetadata", "ModelReady",
                                                 "ModelMetadata", "ModelConfig", "ModelInfer", "ModelStreamInfer"]
    for method in service.methods:
        other = reference.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name, method.client_streaming,
                method.server_streaming) == (other.input_type.full_name, other.output_type.full_name,
                                             other.client_streaming, other.server_streaming)


# ---- health and metadata ------------------------------------------------------------------

def test_server_and_model_readiness(served):
    with served.client() as client:
        assert client.is_server_live() and client.is_server_ready()
        assert [client.is_model_ready(MODEL), client.is_model_ready(MODEL, "1"), client.is_model_ready(MODEL, "2"),
                client.is_model_ready("llama-70b")] == [True, True, False, False]


def test_server_metadata_names_splitserve_and_its_version(served):
    # tritonclient's get_server_metadata, often a new client's first call, was UNIMPLEMENTED.
    with served.client() as client:
        metadata = client.get_server_metadata(as_json=True)
    assert metadata == {"name": "splitserve", "version": importlib.metadata.version("splitserve"),
                        "extensions": ["parameters"]}


def test_model_metadata_lists_the_tensors(served):
    with served.client() as client:
        metadata = client.get_model_metadata(MODEL, as_json=True)
    assert metadata == {
        "name": MODEL, "versions": ["1"], "platform": "splitserve",
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": ["1"]},
                   {"name": "stream", "datatype": "BOOL", "shape": ["1"]},
                   {"name": "sampling_parameters", "datatype": "BYTES", "shape": ["1"]},
                   {"name": "exclude_input_in_output", "datatype": "BOOL", "shape": ["1"]},
                   {"name": "return_finish_reason", "datatype": "BOOL", "shape": ["1"]},
                   {"name": "return_num_input_tokens", "datatype": "BOOL", "shape": ["1"]},
                   {"name": "return_num_output_tokens", "datatype": "BOOL", "shape": ["1"]}],
        "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": ["1"]},
                    {"name": "finish_reason", "datatype": "BYTES", "shape": ["1"]},
                    {"name": "num_input_tokens", "datatype": "UINT32", "shape": ["1"]},
                    {"name": "num_output_tokens", "datatype": "UINT32", "shape": ["1"]}]}


def test_model_config_states_the_vllm_backends_tensors_and_decoupling(served):
    # tritonclient's get_model_config (which perf_analyzer and genai-perf read for the tensors and
    # decoupling) was UNIMPLEMENTED.
    with served.client() as client:
        config = client.get_model_config(MODEL, as_json=True)
        versioned = client.get_model_config(MODEL, "1", as_json=True)
    assert config == versioned == {"config": {
        "name": MODEL, "platform": "splitserve",
        "input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": ["1"]},
                  {"name": "stream", "data_type": "TYPE_BOOL", "dims": ["1"], "optional": True},
                  {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": ["1"], "optional": True},
                  {"name": "exclude_input_in_output", "data_type": "TYPE_BOOL", "dims": ["1"], "optional": True},
                  {"name": "return_finish_reason", "data_type": "TYPE_BOOL", "dims": ["1"], "optional": True},
                  {"name": "return_num_input_tokens", "data_type": "TYPE_BOOL", "dims": ["1"], "optional": True},
                  {"name": "return_num_output_tokens", "data_type": "TYPE_BOOL", "dims": ["1"], "optional": True}],
        "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": ["1"]},
                   {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": ["1"]},
                   {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": ["1"]},
                   {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": ["1"]}],
        "model_transaction_policy": {"decoupled": True}}}


def test_an_unknown_model_is_not_found(served):
    with served.client() as client:
        with pytest.raises(InferenceServerException) as metadata_error:
            client.get_model_metadata("llama-70b")
        with pytest.raises(InferenceServerException) as config_error:
            client.get_model_config(MODEL, "2")
    with pytest.raises(InferenceServerException) as infer_error:
        served.infer(_inputs(), model_version="7")
    assert (metadata_error.value.status(), metadata_error.value.message()) == (
        "StatusCode.NOT_FOUND", "unknown model 'llama-70b'; this server serves 'tiny-llama' version '1'")
    assert (infer_error.value.status(), infer_error.value.message()) == (
        "StatusCode.NOT_FOUND", "unknown model 'tiny-llama' version '7'; this server serves 'tiny-llama' version '1'")
    assert (config_error.value.status(), config_error.value.message()) == (
        "StatusCode.NOT_FOUND", "unknown model 'tiny-llama' version '2'; this server serves 'tiny-llama' version '1'")


def test_health_and_reflection_know_the_service(served):
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService"), timeout=10).status
        database = ProtoReflectionDescriptorDatabase(channel)
        services = database.get_services()
        triton_file = database.FindFileContainingSymbol("inference.GRPCInferenceService")
        generation_file = database.FindFileContainingSymbol("splitserve.v1.Generation")
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert sorted(services) == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                                "inference.GRPCInferenceService", "splitserve.v1.Generation"]
    assert (triton_file.name, [s.name for s in triton_file.service]) == ("inference/grpc_service.proto",
                                                                         ["GRPCInferenceService"])
    assert generation_file.name == "splitserve/v1/generation.proto"


# ---- outputs ------------------------------------------------------------------------------

def test_streamed_deltas_concatenate_to_the_grpc_apis_greedy_text(served):
    _, expected = served.grpc_text(temperature=0, max_tokens=12, ignore_eos=True)
    results = served.stream({"inputs": _inputs(stream=True, sampling={**GREEDY, "max_tokens": 12}),
                             "request_id": "req-1"})
    assert "".join(_text(r) for r in results) == expected != ""
    assert len(results) >= 2
    assert [(_text(r, "finish_reason"), _final(r)) for r in results] == [("", False)] * (len(results) - 1) + [
        ("length", True)]
    assert {(r.get_response().id, r.get_response().model_name, r.get_response().model_version)
            for r in results} == {("req-1", MODEL, "1")}
    served.wait_idle()


def test_an_empty_final_response_when_asked_for(served):
    _, expected = served.grpc_text(temperature=0, max_tokens=6, ignore_eos=True)
    results = served.stream({"inputs": _inputs(stream=True, sampling={**GREEDY, "max_tokens": 6})},
                            enable_empty_final_response=True)
    *content, final = results
    assert "".join(_text(r) for r in content) == expected
    assert [_final(r) for r in content] == [False] * len(content) and _text(content[-1], "finish_reason") == "length"
    assert (_final(final), list(final.get_response().outputs), final.as_numpy("text_output")) == (True, [], None)


def test_model_infer_returns_the_whole_text(served):
    _, expected = served.grpc_text(temperature=0, max_tokens=12, ignore_eos=True)
    sampling = {**GREEDY, "max_tokens": 12}
    excluded = served.infer(_inputs(sampling=sampling, exclude_input=True))
    by_default = served.infer(_inputs(sampling=sampling))  # non-streaming: the prompt is included, as in vLLM's
    included = served.infer(_inputs(sampling=sampling, exclude_input=False))
    assert (_text(excluded), _text(excluded, "finish_reason")) == (expected, "length")
    assert _text(by_default) == _text(included) == PROMPT + expected
    assert "triton_final_response" not in excluded.get_response().parameters  # a stream-only flag


def test_a_non_streaming_request_on_a_stream_gets_one_response(served):
    _, expected = served.grpc_text(temperature=0, max_tokens=8, ignore_eos=True)
    (result,) = served.stream({"inputs": _inputs(stream=False, sampling={**GREEDY, "max_tokens": 8},
                                                 exclude_input=False)})
    assert (_text(result), _text(result, "finish_reason"), _final(result)) == (PROMPT + expected, "length", True)


def test_concurrent_requests_on_one_stream_are_told_apart_by_id(served):
    prompts = {"a": PROMPT, "b": "Once upon a time"}
    expected = {rid: served.grpc_text(prompt, temperature=0, max_tokens=10, ignore_eos=True)[1]
                for rid, prompt in prompts.items()}
    results = served.stream(*({"inputs": _inputs(prompt, stream=True, sampling={**GREEDY, "max_tokens": 10}),
                               "request_id": rid} for rid, prompt in prompts.items()))
    texts = {rid: "".join(_text(r) for r in results if r.get_response().id == rid) for rid in prompts}
    assert texts == expected and expected["a"] != expected["b"]
    assert sorted(r.get_response().id for r in results if _final(r)) == ["a", "b"]


def test_requests_in_flight_may_share_an_id(served):
    # Triton request ids are the client's tags: the vLLM backend's sample client numbers its requests
    # from "0", so two such clients send the same ids at once. The second request with an id in
    # flight was refused (INVALID_ARGUMENT: request_id: '0' is already in flight).
    _, expected = served.grpc_text(temperature=0, max_tokens=LONG // 10, ignore_eos=True)
    request = {"inputs": _inputs(sampling={**GREEDY, "max_tokens": LONG // 10}, exclude_input=True), "request_id": "0"}
    results = served.stream(request, request, request)  # run concurrently; one response each
    assert [(r.get_response().id, _text(r), _text(r, "finish_reason"), _final(r)) for r in results] == [
        ("0", expected, "length", True)] * 3


def test_max_tokens_given_as_strings_like_the_vllm_sample_client(served):
    token_ids, expected = served.grpc_text(temperature=0, max_tokens=5, ignore_eos=True)
    _, longer = served.grpc_text(temperature=0, max_tokens=12, ignore_eos=True)
    sampling = {"temperature": "0", "max_tokens": "5", "ignore_eos": "true"}
    result = served.infer(_inputs(sampling=sampling, exclude_input=True))
    assert len(token_ids) == 5 and longer.startswith(expected) and longer != expected
    assert (_text(result), _text(result, "finish_reason")) == (expected, "length")


def test_sampling_from_request_parameters_without_the_tensor(served):
    _, expected = served.grpc_text(temperature=0, max_tokens=5, ignore_eos=True)
    result = served.infer(_inputs(exclude_input=True), parameters={"temperature": 0.0, "max_tokens": 5,
                                                                   "ignore_eos": True})
    assert _text(result) == expected


def test_a_stop_string_cuts_the_text(served):
    _, full = served.grpc_text(temperature=0, max_tokens=12, ignore_eos=True)
    stop = full[5:8]
    results = served.stream({"inputs": _inputs(stream=True, sampling={**GREEDY, "max_tokens": 12, "stop": [stop]})})
    assert "".join(_text(r) for r in results) == full[:full.index(stop)]
    assert (_text(results[-1], "finish_reason"), _final(results[-1])) == ("stop", True)


def test_a_seed_reproduces_the_grpc_apis_sample(served):
    sampling = {"temperature": 1.0, "top_k": 50, "seed": 1234, "max_tokens": 10, "ignore_eos": True}
    _, expected = served.grpc_text(**sampling)
    assert _text(served.infer(_inputs(sampling=sampling, exclude_input=True))) == expected


def test_only_the_requested_outputs_are_returned(served):
    result = served.infer(_inputs(sampling={**GREEDY, "max_tokens": 2}),
                          outputs=[triton.InferRequestedOutput("text_output")])
    assert [o.name for o in result.get_response().outputs] == ["text_output"]
    assert result.as_numpy("finish_reason") is None


def _switch(name: str, value: bool) -> triton.InferInput:
    tensor = triton.InferInput(name, [1], "BOOL")
    tensor.set_data_from_numpy(np.array([value], dtype=bool))
    return tensor


def test_the_vllm_backends_additional_outputs_example_streams(served):
    # The vLLM backend's documented example (docs/additional_outputs.md) sends return_finish_reason
    # and return_num_output_tokens; both inputs were refused as unexpected.
    token_ids, expected = served.grpc_text(temperature=0, max_tokens=12, ignore_eos=True)
    inputs = [*_inputs(stream=True, sampling={**GREEDY, "max_tokens": 12}),
              _switch("return_finish_reason", True), _switch("return_num_output_tokens", True)]
    results = served.stream({"inputs": inputs})
    counts = [int(result.as_numpy("num_output_tokens")[0]) for result in results]
    assert [o.name for o in results[0].get_response().outputs] == ["text_output", "finish_reason",
                                                                   "num_output_tokens"]
    assert "".join(_text(result) for result in results) == expected
    assert [_text(result, "finish_reason") for result in results] == [""] * (len(results) - 1) + ["length"]
    assert (sum(counts), min(counts) >= 1, results[0].as_numpy("num_output_tokens").dtype) == (
        len(token_ids), True, np.uint32)


def test_an_additional_output_switched_off_is_not_returned(served):
    result = served.infer([*_inputs(sampling={**GREEDY, "max_tokens": 3}, exclude_input=True),
                           _switch("return_finish_reason", False), _switch("return_num_output_tokens", True)])
    assert [o.name for o in result.get_response().outputs] == ["text_output", "num_output_tokens"]
    assert result.as_numpy("num_output_tokens").tolist() == [3]


def test_num_input_tokens_counts_the_prompts_tokens_on_every_response(served, tiny_llama_dir):
    # return_num_input_tokens, the vLLM backend's third counting switch, was refused as unexpected.
    prompt_tokens = len(AutoTokenizer.from_pretrained(tiny_llama_dir)(PROMPT)["input_ids"])
    results = served.stream({"inputs": [*_inputs(stream=True, sampling={**GREEDY, "max_tokens": 4}),
                                        _switch("return_num_input_tokens", True)]})
    whole = served.infer([*_inputs(sampling={**GREEDY, "max_tokens": 4}), _switch("return_num_input_tokens", True)])
    assert [int(result.as_numpy("num_input_tokens")[0]) for result in results] == [prompt_tokens] * len(results)
    assert (whole.as_numpy("num_input_tokens").tolist(), [o.name for o in whole.get_response().outputs]) == (
        [prompt_tokens], ["text_output", "finish_reason", "num_input_tokens"])


def test_cancelling_the_stream_aborts_its_requests(served):
    before = served.decode_generation_tokens()
    first = queue.Queue()
    with served.client() as client:
        client.start_stream(callback=lambda result, error: first.put(error or result))
        client.async_stream_infer(MODEL, _inputs(stream=True, sampling={**GREEDY, "max_tokens": LONG}))
        assert _text(first.get(timeout=60), "finish_reason") == ""
        client.stop_stream(cancel_requests=True)
    served.wait_idle()
    assert served.decode_generation_tokens() - before < LONG // 2


# ---- errors -------------------------------------------------------------------------------

@pytest.mark.parametrize(("inputs", "message"), [
    (_inputs(sampling="{not json"), "sampling_parameters: is not valid JSON: Expecting property name enclosed in "
                                    "double quotes: line 1 column 2 (char 1)"),
    (_inputs(sampling="[1]"), "sampling_parameters: must be a JSON object, got '[1]'"),
    (_inputs(sampling={"temprature": 0}), "sampling_parameters: unknown sampling parameter 'temprature'; supported: "
                                          "allowed_token_ids, bad_words, frequency_penalty, ignore_eos, "
                                          "include_stop_str_in_output, logit_bias, max_tokens, min_p, min_tokens, "
                                          "presence_penalty, repetition_penalty, seed, skip_special_tokens, stop, "
                                          "stop_token_ids, temperature, top_k, top_p"),
    (_inputs(sampling={"temperature": -1}), "temperature: must be a finite number >= 0, got -1.0"),
    (_inputs(sampling={"max_tokens": "ten"}), "max_tokens: must be an integer, got 'ten'"),
    (_inputs(sampling={"max_tokens": 2.5}), "max_tokens: must be an integer, got 2.5"),
    (_inputs(sampling={"ignore_eos": "yes"}), "ignore_eos: must be a boolean, got 'yes'"),
    (_inputs(sampling={"stop": [1]}), "stop: must be a string or a list of strings, got [1]"),
    (_inputs(prompt=None), "text_input: is required (BYTES, shape [1]: the prompt)"),
    (_inputs(prompt=""), "text_input: must not be empty"),
    (_inputs(stream=True), "stream: must be false in ModelInfer (one response per request); stream with "
                           "ModelStreamInfer"),
])
def test_bad_requests_are_invalid_argument_naming_the_input(served, inputs, message):
    with pytest.raises(InferenceServerException) as error:
        served.infer(inputs)
    assert (error.value.status(), error.value.message()) == ("StatusCode.INVALID_ARGUMENT", message)


def test_a_prompt_over_max_model_len_is_refused_naming_text_input(served, tiny_llama_dir):
    # The error named "prompt", an OpenAI field, not the tensor the client sent.
    max_model_len = served.tokenizers.limits.max_model_len
    prompt = PROMPT * (max_model_len // 4)  # several tokens per copy, and within router.max_prompt_bytes
    tokens = len(AutoTokenizer.from_pretrained(tiny_llama_dir)(prompt)["input_ids"])
    with pytest.raises(InferenceServerException) as error:
        served.infer(_inputs(prompt=prompt))
    assert (error.value.status(), error.value.message()) == (
        "StatusCode.INVALID_ARGUMENT",
        f"text_input: This model's maximum context length is {max_model_len} tokens. However, text_input has {tokens} "
        "tokens, and "
        "at least one output token must fit. Please reduce the length of the input.")


def test_a_failed_request_in_a_stream_is_an_error_message_and_the_stream_goes_on(served):
    _, expected = served.grpc_text(temperature=0, max_tokens=4, ignore_eos=True)
    results = served.stream({"inputs": _inputs(stream=True, sampling={"top_p": 0})},
                            {"inputs": _inputs(stream=True, exclude_input=False)},
                            {"inputs": _inputs(stream=True, sampling={**GREEDY, "max_tokens": 4})})
    errors = [str(r) for r in results if isinstance(r, InferenceServerException)]
    assert errors == ["INVALID_ARGUMENT: top_p: must be in (0, 1], got 0.0",
                      "INVALID_ARGUMENT: exclude_input_in_output: false is not allowed when streaming"]
    assert "".join(_text(r) for r in results if not isinstance(r, InferenceServerException)) == expected


def test_unsupported_triton_parameters_are_refused(served):
    with pytest.raises(InferenceServerException) as error:
        served.infer(_inputs(), priority=3)
    assert error.value.message() == "parameters.priority: is not supported by this server"


def test_a_sequence_id_is_refused_by_its_own_name(served):
    # tritonclient sends sequence_start and sequence_end beside sequence_id; the error named
    # whichever the parameter map listed first (sequence_end).
    with pytest.raises(InferenceServerException) as error:
        served.infer(_inputs(), sequence_id=5, sequence_start=True)
    assert (error.value.status(), error.value.message()) == (
        "StatusCode.INVALID_ARGUMENT", "parameters.sequence_id: is not supported by this server")


# ---- parsing, below the client ------------------------------------------------------------

def _request(**fields) -> ipb.ModelInferRequest:
    return ipb.ModelInferRequest(model_name=MODEL, **fields)


def _tensor(name: str, datatype: str, **contents) -> ipb.ModelInferRequest.InferInputTensor:
    return ipb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=[1],
                                                  contents=ipb.InferTensorContents(**contents))


def test_typed_contents_are_read_like_raw_contents():
    request = _request(id="r", inputs=[_tensor("text_input", "BYTES", bytes_contents=["héllo".encode()]),
                                       _tensor("stream", "BOOL", bool_contents=[True]),
                                       _tensor("sampling_parameters", "BYTES",
                                               bytes_contents=[b'{"top_k": "5", "stop": "x", "seed": null}'])])
    parsed = parse_infer_request(request, make_request_limits())
    assert (parsed.id, parsed.text, parsed.stream, parsed.prepend_prompt, parsed.empty_final_response,
            parsed.outputs) == ("r", "héllo", True, False, False, ("text_output", "finish_reason"))
    assert parsed.sampling == SamplingParams(top_k=5, stop=("x",))


@pytest.mark.parametrize(("fields", "message"), [
    ({"inputs": [_tensor("text_input", "BYTES", bytes_contents=[b"a", b"b"])]},
     "text_input: must hold one element in contents.bytes_contents (or in raw_input_contents), got 2"),
    ({"inputs": [_tensor("text_input", "BYTES")], "raw_input_contents": [b"\x05\x00\x00\x00abc"]},
     "text_input: raw BYTES contents must be one element: a 4-byte little-endian length and that many bytes "
     "(got 7 bytes)"),
    ({"inputs": [_tensor("text_input", "BYTES"), _tensor("stream", "BOOL")], "raw_input_contents": [b"\x00" * 4]},
     "raw_input_contents: has 1 entries for 2 inputs"),
    ({"inputs": [_tensor("text_input", "STRING", bytes_contents=[b"a"])]},
     "text_input: must be BYTES of shape [1], got STRING of shape [1]"),
    ({"inputs": [_tensor("text_input", "BYTES", bytes_contents=[b"\xff"])]},
     "text_input: is not valid UTF-8 (invalid start byte at byte 0)"),
    ({"inputs": [_tensor("image", "BYTES", bytes_contents=[b"a"])]},
     "inputs: unexpected input 'image'; this model takes text_input, stream, sampling_parameters, "
     "exclude_input_in_output, return_finish_reason, return_num_input_tokens, return_num_output_tokens"),
    ({"inputs": [_tensor("text_input", "BYTES", bytes_contents=[b"a"])] * 2}, "text_input: is given twice"),
    ({"inputs": [_tensor("text_input", "BYTES", bytes_contents=[b"a"]),
                 _tensor("sampling_parameters", "BYTES", bytes_contents=[b"[" * 100_000])]},
     "sampling_parameters: is not valid JSON: maximum recursion depth exceeded while decoding a JSON array from a "
     "unicode string"),
    ({"inputs": [_tensor("text_input", "BYTES", bytes_contents=[b"a"]),
                 _tensor("sampling_parameters", "BYTES", bytes_contents=[b'{"seed": ' + b"9" * 5000 + b"}"])]},
     "sampling_parameters: is not valid JSON: Exceeds the limit (4300 digits) for integer string conversion: value "
     "has 5000 digits; use sys.set_int_max_str_digits() to increase the limit"),
    ({"inputs": [_tensor("text_input", "BYTES", bytes_contents=[b"a"])],
      "outputs": [ipb.ModelInferRequest.InferRequestedOutputTensor(name="logprobs")]},
     "outputs: unexpected output 'logprobs'; this model returns text_output, finish_reason, num_input_tokens, "
     "num_output_tokens"),
    ({"inputs": [_tensor("text_input", "BYTES", bytes_contents=[b"a"])],
      "outputs": [ipb.ModelInferRequest.InferRequestedOutputTensor(name="num_output_tokens")]},
     "outputs: 'num_output_tokens' is returned only with return_num_output_tokens true"),
    ({"inputs": [_tensor("text_input", "BYTES", bytes_contents=[b"a"])],
      "parameters": {"sequence_id": ipb.InferParameter(int64_param=4)}},
     "parameters.sequence_id: is not supported by this server"),
    ({"inputs": [_tensor("text_input", "BYTES", bytes_contents=[b"a"])],
      "parameters": {"n": ipb.InferParameter(int64_param=2)}},
     "parameters: unknown sampling parameter 'n'; supported: allowed_token_ids, bad_words, frequency_penalty, "
     "ignore_eos, include_stop_str_in_output, logit_bias, max_tokens, min_p, min_tokens, presence_penalty, "
     "repetition_penalty, seed, skip_special_tokens, stop, stop_token_ids, temperature, top_k, top_p"),
])
def test_malformed_tensors_are_refused_naming_the_input(fields, message):
    with pytest.raises(InvalidRequestError) as error:
        parse_infer_request(_request(**fields), make_request_limits())
    assert str(error.value) == message


def test_request_parameters_are_ignored_when_the_tensor_is_given():
    request = _request(inputs=[_tensor("text_input", "BYTES", bytes_contents=[b"a"]),
                               _tensor("sampling_parameters", "BYTES", bytes_contents=[b'{"max_tokens": 3}'])],
                       parameters={"max_tokens": ipb.InferParameter(string_param="100"),
                                   "triton_enable_empty_final_response": ipb.InferParameter(bool_param=True)})
    parsed = parse_infer_request(request, make_request_limits())
    assert (parsed.sampling, parsed.empty_final_response) == (SamplingParams(max_tokens=3), True)
