"""The command line's manners: ``--version``, defaults in every ``--help``, Ctrl-C in ``fuelline
stream``, a status line that speaks English and does not repeat itself while nothing happens,
servers of one reader that disagree named by the option that differs, data left out shown by
``fuelline stream``, and a local client's move to the Unix socket kept out of the INFO log."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from fuelline.client import ServerDataStream
from fuelline.protocol import FingerprintMismatch
from fuelline.server.cli.main import build_parser

from support.processes import wait_until

CLI = [sys.executable, "-m", "fuelline.server.cli"]
STATUS = re.compile(r" INFO (\d+ clients?; [\d.]+ batches/s)")  # the status line's first words


def test_version_prints_the_installed_version() -> None:
    out = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"fuelline {importlib.metadata.version('fuelline')}"


@pytest.mark.parametrize(("endpoint", "fix"), [
    ("6111", "give the server's host too, e.g. localhost:6111"),
    ("datahost", "'datahost' has no port; give HOST:PORT, e.g. datahost:5557"),
    (":6111", "':6111' has no host; give HOST:PORT, e.g. localhost:6111"),
    ("a:5557,a:5557", "names a server twice"),
])
def test_stream_without_a_host_or_port_fails_in_one_line_naming_the_argument_and_the_fix(
        endpoint: str, fix: str) -> None:
    out = subprocess.run([*CLI, "stream", endpoint, "--connect-timeout", "1", "--timeout", "1"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    (line,) = out.stderr.splitlines()  # one line: no traceback, no log
    assert line.startswith("fuelline stream: error: argument HOST:PORT[,HOST:PORT...]: "), line
    assert fix in line, line


def _parsers() -> dict[str, argparse.ArgumentParser]:
    main = build_parser()
    sub = next(a for a in main._actions if isinstance(a, argparse._SubParsersAction))
    return {"fuelline": main, **{f"fuelline {name}": p for name, p in sub.choices.items()}}


def _expected_default(action: argparse.Action) -> str | None:
    """What --help should say an option defaults to; None for an option that has no default to show."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if action.help in (None, argparse.SUPPRESS) or not action.option_strings or action.nargs == 0:
        return None
    if action.default in (None, argparse.SUPPRESS, []):
        return None
    return str(action.default)


@pytest.mark.parametrize("command", list(_parsers()))
def test_every_help_shows_the_defaults(command: str, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "10000")  # one line per option: no wrapping to undo
    parser = _parsers()[command]
    text = parser.format_help()
    shown = 0
    for action in parser._actions:
        if action.help in (None, argparse.SUPPRESS):
            continue
        line = next(x for x in text.splitlines() if action.help in x)
        default = _expected_default(action)
        if default is None or "default" in action.help:  # a help that says its default keeps its words
            assert line.endswith(action.help), line
        else:
            assert line.endswith(f"{action.help} (default: {default})"), line
            shown += 1
    # (keygen's one option says its default itself; upgrade has none but its dataset)
    assert shown or command in ("fuelline keygen", "fuelline upgrade"), text


def test_ctrl_c_in_stream_ends_with_one_line_and_130(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "100")
    proc = subprocess.Popen([*CLI, "stream", server.endpoint, "--epochs", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        # Interrupted while reading, not while starting: an epoch was reported.
        first = lines.get(timeout=30)
        assert first.startswith("epoch 0: 80 batches"), first
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=20)
        assert proc.stderr is not None
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert rc == 130, stderr
    assert stderr.strip().splitlines() == ["fuelline stream: interrupted"], stderr


def status_lines(text: str) -> list[str]:
    return [m.group(1) for m in STATUS.finditer(text)]


def said_line(start: str, server) -> bool:
    return any(line.startswith(start) for line in status_lines(server.log()))


def test_idle_status_lines_are_not_repeated_and_plurals_agree(sample_dataset: Path, start_serve) -> None:
    interval = 0.05
    server = start_serve(sample_dataset, "--batch-size", "100", "--status-interval", str(interval))
    wait_until(lambda: status_lines(server.log()), 10, "a first status line")
    # Twenty intervals with nothing happening: a line each, before; now only the first.
    idle_from = time.monotonic()
    wait_until(lambda: time.monotonic() - idle_from > 20 * interval, 5, "twenty idle intervals")
    with ServerDataStream(endpoints=[server.endpoint], timeout=10) as one:
        assert len(list(one.get_epoch_iterator())) == 80
        wait_until(lambda: said_line("1 client;", server), 10, "a line with one client")
        with ServerDataStream(endpoints=[server.endpoint], timeout=10) as two:
            next(iter(two.get_epoch_iterator()))
            wait_until(lambda: said_line("2 clients;", server), 10, "a line with two clients")
    wait_until(lambda: status_lines(server.log())[-1] == "0 clients; 0.0 batches/s", 10, "a line after both left")
    left_at = len(status_lines(server.log()))
    idle_from = time.monotonic()
    wait_until(lambda: time.monotonic() - idle_from > 20 * interval, 5, "twenty idle intervals again")
    said = status_lines(server.log())
    idle = "0 clients; 0.0 batches/s"
    assert said[0] == idle and said[1] != idle, said  # one line for the first idle stretch
    assert len(said) == left_at, said[left_at - 1:]  # and none after the last line said all left
    assert not any(line.startswith("1 clients") for line in said), said


def test_a_local_clients_move_to_the_unix_socket_is_not_logged_at_info(sample_dataset: Path, start_serve) -> None:
    server = start_serve(sample_dataset, "--batch-size", "100")
    with ServerDataStream(endpoints=[server.endpoint], timeout=10) as stream:
        assert len(list(stream.get_epoch_iterator())) == 80
        assert stream.transports[0].startswith("ipc://"), stream.transports
    # The goodbye is logged at INFO after the move, so once it is there the move's line would be too.
    log = server.wait_log("said bye")
    assert " dropped: " in log and not [x for x in log.splitlines() if " INFO " in x and "said bye" not in x
                                        and " dropped: " in x], log
    # A second connection of one client that is no move (both over TCP) is still news.
    with ServerDataStream(endpoints=[server.endpoint], timeout=10, client_id="twin", local=False) as first:
        next(iter(first.get_epoch_iterator()))
        with ServerDataStream(endpoints=[server.endpoint], timeout=10, client_id="twin", local=False) as second:
            next(iter(second.get_epoch_iterator()))
            server.wait_log(r" INFO client twin#\w+ dropped: replaced by a new connection of the same client")


@pytest.mark.parametrize("b_options,named", [
    (("--batch-size", "128"), "--batch-size 64 at {a} and --batch-size 128 at {b}"),
    (("--batch-size", "64", "--no-shuffle"), "--shuffle at {a} and --no-shuffle at {b}"),
    (("--batch-size", "64", "--order-version", "1"), "--order-version 2 at {a} and --order-version 1 at {b}"),
])
def test_servers_of_one_reader_that_disagree_are_named_by_the_option(
    sample_dataset: Path, start_serve, b_options: tuple[str, ...], named: str,
) -> None:
    a = start_serve(sample_dataset, "--batch-size", "64").endpoint
    b = start_serve(sample_dataset, *b_options).endpoint
    with ServerDataStream(endpoints=[a, b], timeout=10) as stream:
        with pytest.raises(FingerprintMismatch) as info:
            next(iter(stream.get_epoch_iterator()))
    message = str(info.value)
    assert named.format(a=f"tcp://{a}", b=f"tcp://{b}") in message, message
    assert "--seed" not in message, message  # the same seed, though only one server uses it
    tail = "serve the same files with the same options"
    if "--order-version" in named:
        tail += " (`fuelline serve --order-version 2` serves order 2)"
    assert message.endswith(tail), message  # the rest is kept


def _with_bad_shards(sample_dataset: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A copy of the sample dataset with one truncated shard (left out at start-up) and one whose
    row group 1 cannot be decoded (its footer reads: left out as each epoch reaches it)."""
    data = tmp_path / "data"
    shutil.copytree(sample_dataset, data)
    truncated, damaged = data / "train" / "part-00003.parquet", data / "train" / "part-00002.parquet"
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    page = pq.read_metadata(damaged).row_group(1).column(0).data_page_offset  # sample_id: every reader reads it
    raw = bytearray(damaged.read_bytes())
    raw[page:page + 64] = b"\xff" * 64  # a page header no reader can parse
    damaged.write_bytes(bytes(raw))
    return data, truncated, damaged


def test_data_losses_include_the_shards_left_out_at_start_up(sample_dataset: Path, tmp_path: Path,
                                                             start_serve) -> None:
    data, truncated, damaged = _with_bad_shards(sample_dataset, tmp_path)
    server = start_serve(data, "--on-bad-shard", "skip")
    # (Over TCP alone: a move to the local socket can tell of a part twice, as its batches come again.)
    with ServerDataStream(("sample_id",), endpoints=[server.endpoint], timeout=10, local=False) as stream:
        ids = {int(x) for batch in stream.get_epoch_iterator() for x in batch[0]}
        losses, first = stream.data_losses, stream.data_losses_in(0)
    assert len(ids) == 8000 - 2000 - 500, len(ids)  # a truncated shard and a row group less
    assert isinstance(losses, list) and str(truncated) in losses[0], losses
    assert "at start-up" in losses[0] and "not a readable Parquet file" in losses[0]
    assert len(first) == 1 and str(damaged) in first[0] and "its 500 rows are left out" in first[0], first
    # (every notice since: the server, reading ahead, may already have told of the next epoch's)
    assert losses[1] == first[0] and set(losses[1:]) == set(first), losses


def test_stream_reports_what_the_servers_left_out_each_epoch(sample_dataset: Path, tmp_path: Path,
                                                             start_serve) -> None:
    data, truncated, damaged = _with_bad_shards(sample_dataset, tmp_path)
    server = start_serve(data, "--on-bad-shard", "skip", "--batch-size", "100")
    out = subprocess.run([*CLI, "stream", server.endpoint, "--epochs", "2", "--json"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    reports = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(reports) == 2
    for report in reports:
        left_out = report["left_out"]
        assert left_out["skipped_shards"] == 1 and left_out["names"] == [str(truncated)], left_out
        assert left_out["rows"] == 500 and len(left_out["losses"]) == 1, left_out
        assert str(damaged) in left_out["losses"][0], left_out
    text = subprocess.run([*CLI, "stream", server.endpoint, "--epochs", "2"], capture_output=True, text=True,
                          timeout=60)
    assert text.returncode == 0, text.stderr
    said = [line for line in text.stdout.splitlines() if "left out" in line]
    assert len(said) == 2 and all(f"1 shard at start-up ({truncated})" in x and "500 rows" in x for x in said), \
        text.stdout


def test_output_piped_into_a_reader_that_stops_early_ends_quietly(sample_dataset: Path) -> None:
    """``fuelline inspect DATA | head -0``: the reader has closed the pipe before the command
    writes; the command ends with status 0 and no traceback, as Unix tools do."""
    proc = subprocess.Popen([sys.executable, "-m", "fuelline.server.cli", "inspect", str(sample_dataset), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.close()  # (before the interpreter has even started: every write meets a closed pipe)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
