"""Reading guidellm's JSON report (kvscope.rollout.loadgen.read_report), on reports laid out as
guidellm 0.8.1 writes them (``benchmarks[0]``: ``requests`` by status, ``metrics``,
``scheduler_metrics.requests_made``), cut to the fields read."""

from __future__ import annotations

import json

from kvscope.rollout.loadgen import read_report


def _request(i: int) -> dict:
    return {"time_to_first_token_ms": 100.0 + i, "inter_token_latency_ms": 10.0,
            "request_latency": 0.5, "prompt_tokens": 64, "output_tokens": 8,
            "request_start_time": 1000.0 + i, "request_end_time": 1000.5 + i}


def _report(tmp_path, successful: int, incomplete_listed: int, made_incomplete: int,
            limit: int | None = None):
    cells = {"successful": {"count": successful, "percentiles": {"p50": 1.0, "p95": 2.0,
                                                                 "p99": 3.0}}}
    doc = {"benchmarks": [{
        "requests": {"successful": [_request(i) for i in range(successful)], "errored": [],
                     "incomplete": [_request(100 + i) for i in range(incomplete_listed)],
                     "total": None},
        "metrics": {name: cells for name in ("time_to_first_token_ms",
                                             "inter_token_latency_ms", "request_latency")},
        "scheduler_metrics": {"requests_made": {
            "successful": successful, "errored": 0, "incomplete": made_incomplete,
            "total": successful + made_incomplete}}}]}
    if limit is not None:  # the run's max_requests constraint, as guidellm records it
        doc["benchmarks"][0]["config"] = {"constraints": {"max_requests": {
            "type_": "max_requests", "args": {"kind": "max_requests", "count": limit}}}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(doc))
    return read_report(path)


def test_a_request_cancelled_unsent_is_counted_apart_from_errors(tmp_path):
    """24 asked for: 23 succeeded and guidellm cancelled 1 before sending it. Its report
    counts 1 incomplete in requests_made and lists none: 23 measured, 0 errors, 1 unsent (the
    rollout test read 23 of 24 with no error and failed)."""
    result = _report(tmp_path, successful=23, incomplete_listed=0, made_incomplete=1)
    assert (len(result.ttft), result.errors, result.unsent) == (23, 0, 1)


def test_a_request_cut_off_after_it_started_is_an_error_not_unsent(tmp_path):
    """1 cancelled after it started is listed as incomplete: an error (its server was cut off
    mid-answer), and nothing is unsent; 2 cancelled, 1 listed: 1 error, 1 unsent."""
    result = _report(tmp_path, successful=23, incomplete_listed=1, made_incomplete=1)
    assert (len(result.ttft), result.errors, result.unsent) == (23, 1, 0)
    result = _report(tmp_path, successful=22, incomplete_listed=1, made_incomplete=2)
    assert (len(result.ttft), result.errors, result.unsent) == (22, 1, 1)


def test_a_request_guidellm_created_and_never_listed_is_unsent(tmp_path):
    """A CI run of the rollout test: 24 asked for (max_requests), 24 created, 23 succeeded,
    none errored or cancelled, and requests_made counts 23 (``dataset_incomplete``): 1 unsent.
    With the limit met, or none recorded, nothing is unsent."""
    result = _report(tmp_path, successful=23, incomplete_listed=0, made_incomplete=0, limit=24)
    assert (len(result.ttft), result.errors, result.unsent) == (23, 0, 1)
    result = _report(tmp_path, successful=24, incomplete_listed=0, made_incomplete=0, limit=24)
    assert result.unsent == 0
    result = _report(tmp_path, successful=22, incomplete_listed=1, made_incomplete=2, limit=24)
    assert (result.errors, result.unsent) == (1, 1)
