"""Log output set up by a command run in-process follows the process's stderr: a thread that logs
after stderr was swapped and the old stream closed (as a test runner or a notebook does) writes to
the new one, and never fails with a logging error."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from fuelline.protocol.common.logs import configure_logging


@pytest.fixture
def restored_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_records_go_to_the_stderr_of_the_moment(monkeypatch, restored_logging) -> None:
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("INFO", "text")
    logging.getLogger("fuelline.server").warning("before the swap")
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    first.close()  # what a test runner does with the output it captured
    failures = []
    monkeypatch.setattr(logging, "raiseExceptions", True)
    monkeypatch.setattr(logging.Handler, "handleError", lambda self, record: failures.append(record))
    logging.getLogger("fuelline.server").warning("after the swap")
    assert failures == []
    assert "after the swap" in second.getvalue() and "before the swap" not in second.getvalue()


def test_json_lines_follow_stderr_too(monkeypatch, restored_logging) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    configure_logging("INFO", "json")
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    logging.getLogger("fuelline.client").info("hello")
    assert '"message": "hello"' in out.getvalue()
