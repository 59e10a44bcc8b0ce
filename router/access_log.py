"""One access-log line per client request, when it ends (on any path after validation): its status,
tokens, TTFT and latency, on the `splitserve.access` logger; and one `refused` line for an HTTP or gRPC
request answered with an error before it became a request of the router (refused at the edge, by admission
or in validation), so that every generation request, and every request refused with an error, is in the
log once (a successful call of another endpoint, /v1/models or /tokenize, has no line).

The fields ride on the log record (`extra={"fields": ...}`), so the JSON formatter
(common/log_format.py) writes them as keys; the text line renders them as key=value with every
string quoted and bounded (common/log_escape.py), so a client's request id cannot forge a line."""

from __future__ import annotations

import logging

from splitserve.common.log_escape import MAX_LOGGED_CHARS, quote_for_log
from splitserve.common.stats import RequestRecord

logger = logging.getLogger("splitserve.access")


def access_fields(record: RequestRecord) -> dict[str, object]:
    """The request's access-log fields: status is OK or the gRPC status code it ended with; client_request_id
    follows request_id only when the router knows the request by another id than the client's (its own was in
    flight: router/request_ids.py)."""
    renamed = {} if record.client_request_id is None else {"client_request_id":
                                                            record.client_request_id[:MAX_LOGGED_CHARS]}
    return {"request_id": record.request_id[:MAX_LOGGED_CHARS], **renamed,
            "status": "OK" if record.error_code is None else record.error_code,
            "finish_reason": record.finish_reason, "rejection_reason": record.rejection_reason,
            "prompt_tokens": record.num_prompt_tokens, "cached_tokens": record.num_cached_tokens,
            "output_tokens": record.num_output_tokens, "ttft_s": _rounded(record.ttft_s),
            "tpot_s": _rounded(record.tpot_s), "e2e_s": _rounded(record.e2e_s),
            "prefill_worker": record.prefill_worker, "decode_worker": record.decode_worker,
            "migrations": record.num_migrations}


def text_line(fields: dict[str, object]) -> str:
    """`request "id" status=OK ...`: None fields left out, strings quoted."""
    return f"request {quote_for_log(fields['request_id'])} {_key_values(fields, skip='request_id')}"


def refusal_fields(method: str, path: str, http_status: int, message: str | None, param: str | None,
                   client_request_id: str | None, anthropic_request_id: str | None) -> dict[str, object]:
    """An HTTP request refused before it ran: what it asked for, the answer's status and its error message, and on
    the Messages API the `request-id` its answer carried (what an Anthropic client quotes). Every string is cut
    at MAX_LOGGED_CHARS here, not only when the text line quotes it: the JSON log writes the fields themselves,
    and a 404's message quotes the whole path the client sent."""
    fields = {"method": method[:MAX_LOGGED_CHARS], "path": path[:MAX_LOGGED_CHARS], "http_status": http_status,
              **_refusal(message, param, client_request_id)}
    return fields if anthropic_request_id is None else {**fields, "anthropic_request_id": anthropic_request_id}


def grpc_refusal_fields(rpc: str, grpc_status: str, message: str | None, param: str | None,
                        client_request_id: str | None) -> dict[str, object]:
    """A gRPC call (or one request of a Triton stream) refused before it ran: its full method name
    (`/splitserve.v1.Generation/Generate`), the status code's name it ended with and the error, as
    refusal_fields for HTTP."""
    return {"rpc": rpc, "grpc_status": grpc_status, **_refusal(message, param, client_request_id)}


def log_refusal(fields: dict[str, object]) -> None:
    """`refused method="POST" path="/v1/completions" http_status=400 ...` (HTTP) or `refused
    rpc="/splitserve.v1.Generation/Generate" grpc_status="INVALID_ARGUMENT" ...` (gRPC), on the access logger.
    The line is rendered only when the logger writes it: a burst's thousands of refusals are accounted for on
    the router's loop."""
    if logger.isEnabledFor(logging.INFO):
        logger.info("refused %s", _key_values(fields), extra={"fields": fields})


def _refusal(message: str | None, param: str | None, client_request_id: str | None) -> dict[str, object]:
    """The fields every refusal has: the request id the client sent (if any), the field the error names (if
    any) and the error message."""
    return {"client_request_id": _cut(client_request_id), "param": _cut(param), "error": _cut(message)}


def _cut(text: str | None) -> str | None:
    return None if text is None else text[:MAX_LOGGED_CHARS]


def log_access(record: RequestRecord) -> None:
    """The router's request observer for the access log: a line per client request (an internal step's
    record, step_of set, has none: its client request has its own line)."""
    if record.step_of is not None or not logger.isEnabledFor(logging.INFO):
        return
    fields = access_fields(record)
    logger.info("%s", text_line(fields), extra={"fields": fields})


def _key_values(fields: dict[str, object], skip: str | None = None) -> str:
    """key=value for each field but `skip` and the None ones, strings quoted (and bounded)."""
    return " ".join(f"{key}={quote_for_log(value) if isinstance(value, str) else value}"
                    for key, value in fields.items() if key != skip and value is not None)


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)
