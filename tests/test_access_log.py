"""One access-log line per request (router/access_log.py), and JSON log lines
(common/log_format.py): exact fields, and no client string can forge or flood a line."""

from __future__ import annotations

import json
import logging

from splitserve.common.log_format import JsonLinesFormatter, configure_logging
from splitserve.common.slo import SloOutcome
from splitserve.common.stats import RequestRecord
from splitserve.router.access_log import access_fields, log_access, text_line
from tests.factories import make_request_record


def _record(request_id: str, finished: bool = True) -> RequestRecord:
    return make_request_record(
        request_id, finish_reason="stop" if finished else None, error_code=None if finished else "RESOURCE_EXHAUSTED",
        routing_reason="load" if finished else None, rejection_reason=None if finished else "ttft_slo",
        prefill_worker="prefill-0" if finished else None, decode_worker="decode-1" if finished else None,
        num_prompt_tokens=40, num_cached_tokens=16 if finished else 0, num_output_tokens=5 if finished else 0,
        ttft_s=0.0125 if finished else None, inter_token_latencies=(0.01,) * 4 if finished else (),
        e2e_s=0.0525 if finished else 0.001, slo=SloOutcome(True, True) if finished else None,
        num_migrations=1 if finished else 0)


def test_a_finished_and_a_rejected_request_have_exact_fields():
    assert access_fields(_record("abc")) == {
        "request_id": "abc", "status": "OK", "finish_reason": "stop", "rejection_reason": None, "prompt_tokens": 40,
        "cached_tokens": 16, "output_tokens": 5, "ttft_s": 0.0125, "tpot_s": 0.01, "e2e_s": 0.0525,
        "prefill_worker": "prefill-0", "decode_worker": "decode-1", "migrations": 1}
    assert text_line(access_fields(_record("r-2", finished=False))) == (
        'request "r-2" status="RESOURCE_EXHAUSTED" rejection_reason="ttft_slo" prompt_tokens=40 cached_tokens=0 '
        'output_tokens=0 e2e_s=0.001 migrations=0')


def test_a_request_renamed_from_a_duplicate_client_id_names_both():
    """A request sent with the id of one in flight is known by that id with a suffix (router/request_ids.py)."""
    fields = access_fields(make_request_record("abc #2", client_request_id="abc"))
    assert (fields["request_id"], fields["client_request_id"]) == ("abc #2", "abc")
    assert text_line(fields).startswith('request "abc #2" client_request_id="abc" status="OK" finish_reason="length"')


def test_a_hostile_request_id_stays_on_one_bounded_line(caplog):
    hostile = 'a\nINFO forged line\x00"' + "x" * 1000
    with caplog.at_level(logging.INFO, logger="splitserve.access"):
        log_access(_record(hostile))
    [entry] = caplog.records
    line = entry.getMessage()
    assert "\n" not in line and "\x00" not in line
    assert line.startswith('request "a\\nINFO forged line\\u0000\\"xxx')
    assert len(line) < 700  # the id is cut at 256 characters
    assert len(entry.fields["request_id"]) == 256


def test_json_lines_carry_the_fields_as_keys_and_escape_everything():
    record = logging.LogRecord("splitserve.access", logging.INFO, __file__, 1, "line one\nline two", (), None)
    record.fields = access_fields(_record("id\u2028x"))
    text = JsonLinesFormatter().format(record)
    assert "\n" not in text and "\u2028" not in text and text.isascii()
    line = json.loads(text)
    assert (line["level"], line["logger"], line["message"]) == ("INFO", "splitserve.access", "line one\nline two")
    assert (line["request_id"], line["status"], line["ttft_s"], line["migrations"]) == ("id\u2028x", "OK", 0.0125, 1)
    assert line["time"].endswith("+00:00")


def test_configure_logging_installs_one_root_handler_of_the_chosen_format():
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure_logging("json")
        assert [type(h.formatter) for h in root.handlers] == [JsonLinesFormatter]
        configure_logging("text")
        assert [type(h.formatter) for h in root.handlers] == [logging.Formatter]
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])


def test_an_internal_step_has_no_line(caplog):
    """A beam search's step requests are not the client's: only the search's own record has a line."""
    with caplog.at_level(logging.INFO, logger="splitserve.access"):
        log_access(make_request_record("r-beam-0-0", step_of="r"))
        log_access(make_request_record("r"))
    assert [entry.fields["request_id"] for entry in caplog.records] == ["r"]
