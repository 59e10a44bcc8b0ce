"""One access-log line per client request, when it ends (on any path after validation): its status,
tokens, TTFT and latency, on the `splitserve.access` logger.

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
    parts = [f"request {quote_for_log(fields['request_id'])}"]
    parts += [f"{key}={quote_for_log(value) if isinstance(value, str) else value}"
              for key, value in fields.items() if key != "request_id" and value is not None]
    return " ".join(parts)


def log_access(record: RequestRecord) -> None:
    """The router's request observer for the access log: a line per client request (an internal step's
    record, step_of set, has none: its client request has its own line)."""
    if record.step_of is not None:
        return
    fields = access_fields(record)
    logger.info("%s", text_line(fields), extra={"fields": fields})


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)
