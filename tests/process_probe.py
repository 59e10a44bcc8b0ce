"""A request-body parser that says which process ran it (tests/test_request_body.py). Its own small
module: the body parser's process imports it to unpickle it, and the test modules import torch."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from splitserve.router.request_limits import RequestLimits


def process_id(_body: Mapping[str, Any], _limits: RequestLimits) -> int:
    return os.getpid()
