"""The Triton / KServe v2 inference protocol's tensors, in the conventions of Triton's vLLM backend:
ModelInferRequests parsed into typed requests, and text rendered as ModelInferResponses.

Inputs (each of shape [1]): `text_input` (BYTES, the prompt, UTF-8; required), `stream` (BOOL:
one response per text delta), `sampling_parameters` (BYTES: a JSON object of vLLM sampling
parameters), `exclude_input_in_output` (BOOL) and the vLLM backend's additional-output switches
`return_finish_reason`, `return_num_input_tokens` and `return_num_output_tokens` (BOOL). Outputs
(shape [1]): `text_output` and `finish_reason` (BYTES), `num_input_tokens` and `num_output_tokens`
(UINT32) when asked for. Sampling values
may be JSON numbers/booleans or strings holding them (the vLLM backend's sample client sends
`{"temperature": "0.1"}`); without the sampling_parameters tensor, the request's own parameters
are read the same way (as the vLLM backend does).

This module is the gRPC edge of the Triton API: protocol messages exist only here and in the
servicer. Parsing raises InvalidRequestError naming the offending input or parameter; sampling
values are validated by SamplingParams itself and sizes by router/request_limits.py, so every API
accepts and refuses the same values.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import SamplingParams
from splitserve.proto.inference import grpc_service_pb2 as pb
from splitserve.router.request_limits import RequestLimits

FINAL_RESPONSE = "triton_final_response"
"""Response parameter (bool) marking a stream's last response to a request."""
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"
"""Request parameter (bool): end the request's responses with an empty one flagged final."""
UNSUPPORTED_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end", "priority", "timeout")
"""Triton's reserved request parameters this server does not implement (refused when set; the first
one set, in this order, is named)."""
_LENGTH = struct.Struct("<I")
"""The length prefix of each element of a raw BYTES tensor."""
_UINT32 = struct.Struct("<I")
"""A raw UINT32 element."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]
    optional: bool = False
    """An input a request may leave out."""


INPUTS = (TensorSpec("text_input", "BYTES", (1,)), TensorSpec("stream", "BOOL", (1,), optional=True),
          TensorSpec("sampling_parameters", "BYTES", (1,), optional=True),
          TensorSpec("exclude_input_in_output", "BOOL", (1,), optional=True),
          TensorSpec("return_finish_reason", "BOOL", (1,), optional=True),
          TensorSpec("return_num_input_tokens", "BOOL", (1,), optional=True),
          TensorSpec("return_num_output_tokens", "BOOL", (1,), optional=True))
OUTPUTS = (TensorSpec("text_output", "BYTES", (1,)), TensorSpec("finish_reason", "BYTES", (1,)),
           TensorSpec("num_input_tokens", "UINT32", (1,)), TensorSpec("num_output_tokens", "UINT32", (1,)))
_OUTPUT_SWITCHES = {"finish_reason": ("return_finish_reason", True),
                    "num_input_tokens": ("return_num_input_tokens", False),
                    "num_output_tokens": ("return_num_output_tokens", False)}
"""The optional outputs (the vLLM backend's additional outputs): the BOOL input that turns each on or
off, and whether it is on when that input is left out (finish_reason was always returned here)."""
_INPUTS = {spec.name: spec for spec in INPUTS}
_CONFIG_DATATYPES = {"BYTES": pb.TYPE_STRING, "BOOL": pb.TYPE_BOOL, "UINT32": pb.TYPE_UINT32}
"""The model configuration's DataType of each tensor datatype used (Triton's TYPE_STRING is BYTES)."""
_OUTPUT_NAMES = tuple(spec.name for spec in OUTPUTS)

_FLOAT = "a number"
_INT = "an integer"
_BOOL = "a boolean"
_STRINGS = "a string or a list of strings"
_INTS = "a list of integers"
_BIASES = "an object mapping token ids to biases"
_SAMPLING_KINDS = {"temperature": _FLOAT, "top_p": _FLOAT, "top_k": _INT, "min_p": _FLOAT, "max_tokens": _INT,
                   "seed": _INT, "stop": _STRINGS, "stop_token_ids": _INTS, "ignore_eos": _BOOL,
                   "repetition_penalty": _FLOAT, "frequency_penalty": _FLOAT, "presence_penalty": _FLOAT,
                   "skip_special_tokens": _BOOL, "min_tokens": _INT, "logit_bias": _BIASES,
                   "allowed_token_ids": _INTS, "bad_words": _STRINGS, "include_stop_str_in_output": _BOOL}
"""The vLLM sampling parameters accepted (same names as SamplingParams' fields), by what each must be."""


@dataclass(frozen=True)
class ServedModel:
    """The one model the router serves, as the protocol names it."""

    name: str
    version: str
    """The only version ("1"); a request naming no version gets it."""
    platform: str

    def serves(self, name: str, version: str) -> bool:
        return name == self.name and version in ("", self.version)


@dataclass(frozen=True)
class OutputValues:
    """What one response reports of its request (each value goes out only if its output is requested)."""

    text: str
    finish_reason: str | None
    """None until the request's last response."""
    num_input_tokens: int
    """The prompt's tokens."""
    num_output_tokens: int
    """The tokens generated since the request's previous response, whose text this one carries."""


@dataclass(frozen=True)
class InferRequest:
    """A validated ModelInferRequest."""

    id: str
    """The client's request id (may be empty), echoed in every response."""
    text: str
    stream: bool
    """One response per text delta (ModelStreamInfer only); else one response with the whole text."""
    prepend_prompt: bool
    """The response text starts with the prompt (exclude_input_in_output false; never when streaming)."""
    sampling: SamplingParams
    outputs: tuple[str, ...]
    """The output tensors to return, in OUTPUTS order: text_output and each optional output its switch
    turns on, narrowed to those the request names, if it names some."""
    empty_final_response: bool
    """End a stream's responses to this request with an empty one flagged final."""


# ---- requests -------------------------------------------------------------------------------

def parse_infer_request(request: pb.ModelInferRequest, limits: RequestLimits) -> InferRequest:
    """The request's inputs and parameters, checked against `limits` too; raises InvalidRequestError
    naming what is wrong."""
    limits.check_request_id(request.id, "id")
    values = _input_values(request)
    if "text_input" not in values:
        raise InvalidRequestError("text_input", "is required (BYTES, shape [1]: the prompt)")
    limits.check_prompt_bytes(len(values["text_input"]), "text_input")
    text = _utf8(values["text_input"], "text_input")
    stream = values.get("stream", False)
    exclude = values.get("exclude_input_in_output")
    prepend = not stream if exclude is None else not exclude
    if stream and prepend:
        raise InvalidRequestError("exclude_input_in_output", "false is not allowed when streaming")
    options, empty_final = _request_parameters(request.parameters)
    source = "parameters"
    if "sampling_parameters" in values:  # the tensor wins over request parameters, as in the vLLM backend
        source = "sampling_parameters"
        options = _json_object(_utf8(values[source], source), source)
    sampling = _sampling_params(options, source)
    max_tokens_field = "max_tokens" if options.get("max_tokens") is not None else None
    limits.check_sampling(sampling, max_tokens_field)
    return InferRequest(request.id, text, stream, prepend, sampling, _outputs(request, values),
                        empty_final)


def _sampling_params(options: Mapping[str, Any], source: str) -> SamplingParams:
    """SamplingParams from vLLM-named options (read from `source`); null values keep the defaults
    (max_tokens 16, as in vLLM)."""
    unknown = sorted(set(options) - set(_SAMPLING_KINDS))
    if unknown:
        raise InvalidRequestError(source, f"unknown sampling parameter {unknown[0]!r}; supported: "
                                          f"{', '.join(sorted(_SAMPLING_KINDS))}")
    return SamplingParams(**{name: _coerce(name, value, _SAMPLING_KINDS[name]) for name, value in options.items()
                             if value is not None})


def _input_values(request: pb.ModelInferRequest) -> dict[str, bytes | bool]:
    """Each input's one element, by name, after checking name, datatype and shape."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidRequestError("raw_input_contents", f"has {len(raw)} entries for {len(request.inputs)} inputs")
    values: dict[str, bytes | bool] = {}
    for index, tensor in enumerate(request.inputs):
        spec = _INPUTS.get(tensor.name)
        if spec is None:
            raise InvalidRequestError("inputs", f"unexpected input {tensor.name!r}; this model takes "
                                                f"{', '.join(_INPUTS)}")
        if tensor.name in values:
            raise InvalidRequestError(tensor.name, "is given twice")
        if tensor.datatype != spec.datatype or tuple(tensor.shape) != spec.shape:
            got = f"{tensor.datatype or '(no datatype)'} of shape {list(tensor.shape)}"
            raise InvalidRequestError(tensor.name, f"must be {spec.datatype} of shape {list(spec.shape)}, got {got}")
        values[tensor.name] = _raw_element(raw[index], spec) if raw else _content_element(tensor.contents, spec)
    return values


def _raw_element(data: bytes, spec: TensorSpec) -> bytes | bool:
    if spec.datatype == "BOOL":
        if len(data) != 1 or data[0] > 1:
            raise InvalidRequestError(spec.name, f"raw BOOL contents must be one byte 0 or 1, got {data[:8]!r}")
        return data[0] == 1
    if len(data) < _LENGTH.size or _LENGTH.size + _LENGTH.unpack_from(data)[0] != len(data):
        raise InvalidRequestError(spec.name, "raw BYTES contents must be one element: a 4-byte little-endian "
                                             f"length and that many bytes (got {len(data)} bytes)")
    return data[_LENGTH.size:]


def _content_element(contents: pb.InferTensorContents, spec: TensorSpec) -> bytes | bool:
    elements = contents.bool_contents if spec.datatype == "BOOL" else contents.bytes_contents
    if len(elements) != 1:
        field = "bool_contents" if spec.datatype == "BOOL" else "bytes_contents"
        raise InvalidRequestError(spec.name, f"must hold one element in contents.{field} (or in raw_input_contents), "
                                             f"got {len(elements)}")
    return elements[0]


def _utf8(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequestError(name, f"is not valid UTF-8 ({error.reason} at byte {error.start})") from None


def _json_object(text: str, name: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as error:
        # ValueError: not JSON, or an integer literal past Python's digit limit; RecursionError:
        # arrays or objects nested too deep to parse.
        raise InvalidRequestError(name, f"is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(name, f"must be a JSON object, got {text[:80]!r}")
    return value


def _request_parameters(parameters: Mapping[str, pb.InferParameter]) -> tuple[dict[str, Any], bool]:
    """(sampling options given as request parameters, whether an empty final response was asked for)."""
    # tritonclient sends sequence_start and sequence_end with every sequence_id; name the one the
    # caller set (the map's order is not the client's).
    for key in UNSUPPORTED_PARAMETERS:
        if key in parameters:
            raise InvalidRequestError(f"parameters.{key}", "is not supported by this server")
    options: dict[str, Any] = {}
    empty_final = False
    for key, parameter in parameters.items():
        value = getattr(parameter, parameter.WhichOneof("parameter_choice") or "string_param")
        if key == EMPTY_FINAL_RESPONSE:
            empty_final = _coerce(f"parameters.{key}", value, _BOOL)
        elif key.startswith("triton_"):
            raise InvalidRequestError(f"parameters.{key}", "is not supported by this server")
        else:
            options[key] = value
    return options, empty_final


def _coerce(name: str, value: Any, kind: str) -> Any:
    """`value` as a `kind`; numbers and booleans may come as strings ("0.1", "true")."""
    try:
        if kind == _FLOAT:
            return _number(value, float)
        if kind == _INT:
            return _number(value, int)
        if kind == _BOOL:
            return _boolean(value)
        if kind == _STRINGS:
            return (value,) if isinstance(value, str) else tuple(_typed_list(value, str))
        if kind == _BIASES:  # its keys and biases are checked by SamplingParams
            if not isinstance(value, dict):
                raise TypeError(value)
            return dict(value)
        return tuple(_typed_list(value, int))
    except (TypeError, ValueError):
        raise InvalidRequestError(name, f"must be {kind}, got {value!r}") from None


def _number(value: Any, kind: type) -> int | float:
    if isinstance(value, str):
        return kind(value.strip())
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise TypeError(value)
    return kind(value)


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise TypeError(value)


def _typed_list(value: Any, kind: type) -> list:
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise TypeError(value)
    return value


def _outputs(request: pb.ModelInferRequest, values: Mapping[str, bytes | bool]) -> tuple[str, ...]:
    """The outputs produced (as the vLLM backend: text_output, and each optional one its switch input
    turns on), narrowed to those the request names; naming one that is switched off is refused."""
    produced = [name for name in _OUTPUT_NAMES
                if name not in _OUTPUT_SWITCHES or values.get(*_OUTPUT_SWITCHES[name])]
    names = [output.name for output in request.outputs]
    for name in names:
        if name not in _OUTPUT_NAMES:
            raise InvalidRequestError("outputs", f"unexpected output {name!r}; this model returns "
                                                 f"{', '.join(_OUTPUT_NAMES)}")
        if name not in produced:
            raise InvalidRequestError("outputs", f"{name!r} is returned only with {_OUTPUT_SWITCHES[name][0]} true")
    return tuple(name for name in produced if not names or name in names)


# ---- responses ------------------------------------------------------------------------------

def infer_response(model: ServedModel, request: InferRequest, output: OutputValues,
                   final: bool | None = None) -> pb.ModelInferResponse:
    """A response carrying the requested outputs (finish_reason "" until the last response), as raw
    contents like Triton's; `final` sets the triton_final_response parameter (streams only)."""
    response = _header(model, request.id, final)
    values = {"text_output": _bytes_element(output.text.encode("utf-8")),
              "finish_reason": _bytes_element((output.finish_reason or "").encode("utf-8")),
              "num_input_tokens": _UINT32.pack(output.num_input_tokens),
              "num_output_tokens": _UINT32.pack(output.num_output_tokens)}
    for spec in OUTPUTS:
        if spec.name in request.outputs:
            response.outputs.add(name=spec.name, datatype=spec.datatype, shape=spec.shape)
            response.raw_output_contents.append(values[spec.name])
    return response


def empty_final_response(model: ServedModel, request_id: str) -> pb.ModelInferResponse:
    """No outputs, only the triton_final_response flag (what triton_enable_empty_final_response asks for)."""
    return _header(model, request_id, final=True)


def stream_error(model: ServedModel, request_id: str, message: str) -> pb.ModelStreamInferResponse:
    """A failed request in a stream: the message, and a response naming the request (flagged final:
    nothing follows for it)."""
    return pb.ModelStreamInferResponse(error_message=message, infer_response=_header(model, request_id, final=True))


def model_metadata(model: ServedModel) -> pb.ModelMetadataResponse:
    return pb.ModelMetadataResponse(name=model.name, versions=[model.version], platform=model.platform,
                                    inputs=_tensor_metadata(INPUTS), outputs=_tensor_metadata(OUTPUTS))


def model_config(model: ServedModel) -> pb.ModelConfigResponse:
    """The configuration a Triton vLLM-backend model states: no batch dimension (max_batch_size 0,
    each request one prompt), decoupled (any number of responses per request in ModelStreamInfer)."""
    inputs = [pb.ModelInput(name=s.name, data_type=_CONFIG_DATATYPES[s.datatype], dims=s.shape, optional=s.optional)
              for s in INPUTS]
    outputs = [pb.ModelOutput(name=s.name, data_type=_CONFIG_DATATYPES[s.datatype], dims=s.shape) for s in OUTPUTS]
    config = pb.ModelConfig(name=model.name, platform=model.platform, max_batch_size=0, input=inputs, output=outputs,
                            model_transaction_policy=pb.ModelTransactionPolicy(decoupled=True))
    return pb.ModelConfigResponse(config=config)


def _tensor_metadata(specs: Sequence[TensorSpec]) -> list[pb.ModelMetadataResponse.TensorMetadata]:
    return [pb.ModelMetadataResponse.TensorMetadata(name=s.name, datatype=s.datatype, shape=s.shape) for s in specs]


def _header(model: ServedModel, request_id: str, final: bool | None) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=model.name, model_version=model.version, id=request_id)
    if final is not None:
        response.parameters[FINAL_RESPONSE].bool_param = final
    return response


def _bytes_element(data: bytes) -> bytes:
    return _LENGTH.pack(len(data)) + data
