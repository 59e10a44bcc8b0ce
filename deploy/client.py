"""Streaming gRPC client for the `Generation` service (what `splitserve generate --target` uses).

Torch-free: only grpc, the generated code and common's SamplingParams.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import grpc

from splitserve.common.errors import InvalidRequestError
from splitserve.common.generation_config import DEFAULTED_SAMPLING_FIELDS
from splitserve.common.sampling_params import SamplingParams
from splitserve.proto.splitserve.v1 import generation_pb2, generation_pb2_grpc

_UINT64_FIELDS = frozenset({"seed"})
"""Sampling fields that are unsigned on the wire (common.SamplingParams allows a negative seed)."""
LOCAL_SAMPLING_FIELDS = frozenset({"bad_words_token_ids", "n", "truncate_prompt_tokens", "detokenize"})
"""SamplingParams fields that are not sent: the server derives bad_words_token_ids (it tokenizes bad_words
itself); n fans out above the engine (the offline LLM), and one Generate stream is one sequence;
truncate_prompt_tokens and detokenize are the offline LLM's (sampling_to_proto refuses them set)."""


@dataclass(frozen=True)
class ClientTls:
    """How a client checks the router's certificate and, for mutual TLS, proves who it is."""

    ca_file: str | None = None
    """PEM CA certificate(s) that signed the router's certificate; None: the system's trusted roots."""
    cert_file: str | None = None
    """PEM client certificate chain, for a router that requires one (router.tls.client_ca_file)."""
    key_file: str | None = None
    """PEM private key of cert_file; given exactly when cert_file is."""

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("TLS: a client certificate needs its key: give both cert_file and key_file, or neither")

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Read the files (FileNotFoundError names a missing one)."""
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca_file),
                                            private_key=_read(self.key_file),
                                            certificate_chain=_read(self.cert_file))


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


class GenerationClient:
    """One gRPC channel to a router (TLS when `tls` is given); a context manager that closes the
    channel on exit."""

    def __init__(self, target: str, timeout_s: float | None = None, api_key: str | None = None,
                 tls: ClientTls | None = None) -> None:
        """target is "HOST:PORT"; timeout_s is each request's deadline (whole stream), None for none;
        api_key is sent as `authorization: Bearer <key>` metadata (router.api_key_env), None for none;
        tls connects over TLS (the router's certificate must cover HOST), None for plaintext.

        Connecting is lazy and does not wait for the server: an unreachable target fails the first
        stream with UNAVAILABLE instead of hanging.
        """
        self.target = target
        self.timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._channel = (grpc.insecure_channel(target) if tls is None
                         else grpc.secure_channel(target, tls.channel_credentials()))
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def stream(self, request: generation_pb2.GenerateRequest) -> Iterator[generation_pb2.GenerateResponse]:
        """The responses of one Generate call, in order; the last one has finish_reason set.

        The call starts at the first next(), which is also where connection errors surface.

        Raises grpc.RpcError (`.code()`, `.details()`) on a failed call. Abandoning the iterator
        (closing it, or breaking out of a loop over it) cancels the call, so the server frees
        the request's resources.
        """
        call = self._stub.Generate(request, timeout=self.timeout_s, metadata=self._metadata)
        try:
            yield from call
        finally:
            call.cancel()  # a no-op once the stream has ended

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


def _check_sendable(params: SamplingParams) -> None:
    """InvalidRequestError for what only the offline LLM resolves (the wire has no field or value for it)."""
    if params.max_tokens is None:
        raise InvalidRequestError("max_tokens", "None (to the end of the context) is resolved by the offline LLM "
                                                "only: send an integer, or leave max_tokens out for the server's default")
    if params.truncate_prompt_tokens is not None:
        raise InvalidRequestError("truncate_prompt_tokens", "is the offline LLM's: set the GenerateRequest's "
                                                            "truncate_prompt_tokens")
    if not params.detokenize:
        raise InvalidRequestError("detokenize", "is the offline LLM's: a server always returns text")


def sampling_to_proto(params: SamplingParams) -> generation_pb2.SamplingParams:
    """The fields that differ from their defaults are set, and always those a server's sampling
    defaults (--generation-config) would fill: `params` is a whole choice, so a value of it that
    equals SamplingParams' default (top_p 1.0) must reach the server as given, not as unset.

    Raises InvalidRequestError for a negative seed, which the wire's uint64 cannot carry, for n > 1, and for
    what only the offline LLM resolves (max_tokens None, truncate_prompt_tokens, detokenize False).
    """
    if params.n != 1:
        raise InvalidRequestError("n", f"a Generate stream carries one sequence, got n={params.n}: send one request "
                                       f"per sequence (SamplingParams.for_sequence(i) seeds them as vLLM does)")
    _check_sendable(params)
    message = generation_pb2.SamplingParams()
    for spec in dataclasses.fields(SamplingParams):
        value = getattr(params, spec.name)
        if (value == spec.default and spec.name not in DEFAULTED_SAMPLING_FIELDS) or spec.name in LOCAL_SAMPLING_FIELDS:
            continue
        if spec.name in _UINT64_FIELDS and value < 0:
            raise InvalidRequestError(spec.name, f"must be >= 0 to be sent to a server, got {value}")
        if spec.name == "logit_bias":  # (token id, bias) pairs -> the wire's map
            message.logit_bias.update(dict(value))
        elif isinstance(value, tuple):
            getattr(message, spec.name).extend(value)
        else:
            setattr(message, spec.name, value)
    return message


def _set_prompt(request: generation_pb2.GenerateRequest, text: str | None, token_ids: Sequence[int] | None,
                messages: Sequence[Mapping[str, str]] | None, add_generation_prompt: bool | None) -> None:
    if (text is None) + (token_ids is None) + (messages is None) != 2:
        raise ValueError("give exactly one of text, token_ids or messages")
    if add_generation_prompt is not None and messages is None:
        raise ValueError("add_generation_prompt applies to chat messages only")
    if text is not None:
        request.text = text.encode("utf-8")
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    else:
        request.chat.messages.extend(generation_pb2.ChatMessage(role=message["role"], content=message["content"])
                                     for message in messages)
        if add_generation_prompt is not None:
            request.chat.add_generation_prompt = add_generation_prompt


def build_generate_request(*, text: str | None = None, token_ids: Sequence[int] | None = None,
                           messages: Sequence[Mapping[str, str]] | None = None,
                           add_generation_prompt: bool | None = None, params: SamplingParams | None = None,
                           request_id: str = "", model: str = "",
                           cache_salt: str | None = None, priority: int = 0) -> generation_pb2.GenerateRequest:
    """A GenerateRequest for exactly one of text / token_ids / chat messages ({"role", "content"} each).

    add_generation_prompt (chat only) and sampling fields are left unset unless given, so the
    server's defaults apply; an empty request_id lets the router make one, an empty model means
    the served model; cache_salt (vLLM's, a non-empty string) salts the prompt's prefix-cache blocks;
    priority (vLLM's) orders it on a server whose scheduling policy is "priority" (lower first).
    """
    request = generation_pb2.GenerateRequest(request_id=request_id, model=model, priority=priority)
    _set_prompt(request, text, token_ids, messages, add_generation_prompt)
    if cache_salt is not None:
        request.cache_salt = cache_salt
    if params is not None:
        request.sampling.CopyFrom(sampling_to_proto(params))
    return request
