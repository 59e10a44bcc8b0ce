"""The one way a client-supplied string (a request id, an error message quoting the client's
input) goes into a log line: escaped and bounded, so it can neither forge a line nor flood one."""

from __future__ import annotations

import json

MAX_LOGGED_CHARS = 256
"""Characters of a value written to a log line; the rest is counted, not written."""


def quote_for_log(value: object, max_chars: int = MAX_LOGGED_CHARS) -> str:
    """str(value) as a JSON string literal (quotes, backslashes, control and non-ASCII characters
    escaped, so the result is one line of printable ASCII), cut after max_chars characters with
    the number left out: `"a\\nb\\u0000c"`, `"xxx"...(+999997 chars)`."""
    text = str(value)
    quoted = json.dumps(text[:max_chars], ensure_ascii=True)
    return quoted if len(text) <= max_chars else f"{quoted}...(+{len(text) - max_chars} chars)"
