"""``narwhal journal`` (docs/contract.md, "The journal"; docs/operate.md): filters, crash leftovers, bad
bytes, --follow."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from narwhal.journal_cli import (
    CaughtUp,
    JournalReader,
    Problem,
    Record,
    Selection,
    UnfinishedTracker,
    follow_events,
    main,
    read_events,
)
from narwhal_core import journal
from narwhal_core.journal import ErrorRecord, LegRecord, ProgressRecord, TerminalRecord

WAIT_SECONDS = 10.0  # upper bound for anything a test waits on; normally ~0.2 s


def progress(rid: str, ts: float = 1_700_000_000.0, event: str = "admitted") -> bytes:
    return journal.encode(ProgressRecord(
        ts=ts, rid=rid, event=event, route="/v1/completions", client="team-a",
        client_rid=f"c-{rid}", mode="pd", stream=False,
    ))


def terminal(rid: str, outcome: journal.Terminal = "completed", status: int | None = 200,
             ts: float = 1_700_000_001.0) -> bytes:
    error = None if outcome == "completed" else ErrorRecord(
        type="server_error", code="engine_timeout", param=None, message="it broke",
        leg="decode", engine="http://d1:8000",
    )
    leg = LegRecord(
        phase="prefill", attempt=1, backend_id=f"{rid}-p1", engine="http://p1:8000",
        status=200, outcome="ok", started=ts - 0.5, duration_ms=12.5,
        kv=journal.KvRecord(outcome="pulled", owner=f"{rid}-p1", engine="http://p1:8000",
                            method="decode"),
    )
    return journal.encode(TerminalRecord(
        ts=ts, rid=rid, client_rid=f"c-{rid}", client="team-a", route="/v1/completions",
        model="m", stream=False, mode="pd", terminal=outcome, status=status, error=error,
        legs=(leg,), usage={"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
        received=ts - 1, duration_ms=1000.0, ttft_ms=40.0, stripped=(),
    ))


# A small day of traffic: r1 ok, r2 failed, r3 invalid (never admitted),
# r4 in flight (two progress records), r5 ok, r6 in flight.
LINES = [
    progress("r1"), progress("r2"), terminal("r3", "invalid", 400),
    terminal("r1"), progress("r4"), progress("r4", event="prefill_done"),
    terminal("r2", "failed", 504), progress("r5"), progress("r6"), terminal("r5"),
]


def run(argv: list[str], *, stdin: bytes = b"",
        stop: Callable[[], bool] | None = None) -> tuple[int, bytes, str]:
    out, err = io.BytesIO(), io.StringIO()
    code = main(argv, stdin=io.BytesIO(stdin), stdout=out, stderr=err, stop=stop)
    return code, out.getvalue(), err.getvalue()


def write(path: Path, *chunks: bytes) -> Path:
    path.write_bytes(b"".join(chunks))
    return path


@pytest.fixture
def day(tmp_path: Path) -> Path:
    return write(tmp_path / "journal.jsonl", *LINES)


def rids(out: bytes) -> list[str]:
    return [json.loads(line)["rid"] for line in out.splitlines()]


# --- filters -------------------------------------------------------------


def test_prints_every_record_unchanged_in_file_order(day: Path) -> None:
    code, out, err = run([str(day)])
    assert (code, out, err) == (0, b"".join(LINES), "")


def test_rid_filter(day: Path) -> None:
    code, out, err = run([str(day), "--rid", "r4"])
    assert (code, err) == (0, "")
    assert out == LINES[4] + LINES[5]


def test_terminal_filter(day: Path) -> None:
    code, out, _ = run([str(day), "--terminal", "completed"])
    assert code == 0
    assert out == LINES[3] + LINES[9]
    assert run([str(day), "--terminal", "cancelled"])[:2] == (0, b"")


def test_filters_combine(day: Path) -> None:
    assert run([str(day), "--rid", "r2", "--terminal", "failed"])[1] == LINES[6]
    assert run([str(day), "--rid", "r2", "--terminal", "completed"])[1] == b""
    assert run([str(day), "--rid", "nobody"])[:2] == (0, b"")


def test_unknown_terminal_is_a_usage_error(day: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([str(day), "--terminal", "done"])
    assert (code, out) == (2, b"")
    err = capsys.readouterr().err
    assert "--terminal must be one of completed, invalid, denied, rejected, failed, cancelled" in err
    assert "'done'" in err
    with pytest.raises(ValueError):
        Selection(terminal="done")


@pytest.mark.parametrize("extra", [["--unfinished", "--terminal", "failed"],
                                   ["--follow", "--unfinished"], ["--summary", "--unfinished"]])
def test_contradictory_flags_are_usage_errors(day: Path, extra: list[str]) -> None:
    assert run([str(day), *extra])[:2] == (2, b"")


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: narwhal journal")


# --- after a crash -------------------------------------------------------


def test_unfinished_after_a_crash_with_a_torn_last_line(tmp_path: Path) -> None:
    half = progress("r7")[:40]  # SIGKILL in the middle of a write
    path = write(tmp_path / "j", *LINES, half)
    code, out, err = run([str(path), "--unfinished"])
    assert code == 0
    # Last record of each unfinished rid, in order of first appearance.
    assert out == LINES[5] + LINES[8]
    assert err == f"narwhal journal: line {len(LINES) + 1} is incomplete (torn write?), skipped\n"
    # Records before the torn line are intact, and the torn bytes are never printed.
    code, out, _ = run([str(path)])
    assert (code, out) == (0, b"".join(LINES))
    # A torn last line is what a crash leaves: not a --strict failure.
    assert run([str(path), "--strict"])[0] == 0


def test_unfinished_honours_rid(day: Path) -> None:
    assert run([str(day), "--unfinished", "--rid", "r6"])[1] == LINES[8]
    assert run([str(day), "--unfinished", "--rid", "r1"])[1] == b""


def test_unfinished_keeps_only_requests_in_flight() -> None:
    tracker = UnfinishedTracker()
    stream = io.BytesIO(b"".join(progress(f"r{i}") + terminal(f"r{i}") for i in range(2000))
                        + progress("left"))
    for event in read_events(stream):
        assert isinstance(event, Record)
        tracker.add(event)
    assert len(tracker) == 1
    assert [r.rid for r in tracker.records()] == ["left"]


def test_restarted_writer_after_a_torn_write_keeps_the_next_record(tmp_path: Path) -> None:
    # The killed writer left half a line; the restarted one appended right after it.
    path = write(tmp_path / "j", LINES[0], progress("r9")[:25], LINES[3], LINES[1])
    code, out, err = run([str(path)])
    assert code == 0
    assert out == LINES[0] + LINES[3] + LINES[1]
    assert "line 2 starts with 25 bytes of an incomplete record (torn write?)" in err
    assert run([str(path), "--strict"])[0] == 1


# --- bad lines and bad bytes --------------------------------------------


def test_bad_lines_in_the_middle_are_reported_and_skipped(tmp_path: Path) -> None:
    path = write(
        tmp_path / "j",
        LINES[0],
        b"this is not json\n",                       # 2
        b"[1, 2, 3]\n",                              # 3
        b'{"ts": 1, "terminal": null}\n',            # 4: no rid
        b'{"ts": 1, "rid": "x", "terminal": "won"}\n',  # 5
        b"\n",                                       # 6: blank, silently skipped
        b'{"rid": "x", "terminal": null}\n',         # 7: no ts
        b'{"ts": 2, "rid": "x", "terminal": null, "event": "hand written"}\n',  # 8: fine
        LINES[3],
    )
    code, out, err = run([str(path)])
    assert code == 0
    assert out == LINES[0] + b'{"ts": 2, "rid": "x", "terminal": null, "event": "hand written"}\n' + LINES[3]
    reported = err.splitlines()
    assert [line.split(" ")[3] for line in reported] == ["2", "3", "4", "5", "7"]
    assert all(line.startswith("narwhal journal: line ") and line.endswith(", skipped")
               for line in reported)
    assert "line 2 is not valid JSON" in err
    assert "line 3 is not a JSON object" in err
    assert 'line 4 is not a journal record (no string "rid")' in err
    assert 'line 5 is not a journal record (unknown terminal "won")' in err
    assert run([str(path), "--strict"])[:2] == (1, out)


def test_invalid_utf8_and_nul_bytes_do_not_crash(tmp_path: Path) -> None:
    path = write(
        tmp_path / "j",
        LINES[0],
        b'{"ts": 1, "rid": "\xff\xfe", "terminal": null}\n',  # 2
        b"\x00\x00\x00\x00\n",                                  # 3
        b'{"ts": 1, "rid": "a\x00b", "terminal": null}\n',     # 4: raw NUL in a string
        b"\xc3\x28\x80\n",                                     # 5
        LINES[1],
    )
    code, out, err = run([str(path)])
    assert code == 0
    assert out == LINES[0] + LINES[1]
    assert "line 2 is not valid JSON (not valid UTF-8), skipped" in err
    for n in (3, 4, 5):
        assert f"line {n} is not valid JSON" in err
    assert run([str(path), "--unfinished"])[1] == LINES[0] + LINES[1]


def test_binary_garbage_reports_are_bounded(tmp_path: Path) -> None:
    path = write(tmp_path / "j", b"garbage\n" * 1000, LINES[0])
    code, out, err = run([str(path)])
    assert (code, out) == (0, LINES[0])
    assert len(err.splitlines()) == 102
    assert err.splitlines()[-1] == "narwhal journal: 1000 bad lines skipped in all"


def test_over_long_line_is_skipped_with_bounded_memory() -> None:
    reader = JournalReader(max_line=250)
    events: list[Record | Problem] = []
    for chunk in (LINES[0], b"x" * 140, b"y" * 140, b"z" * 500, b"\n", LINES[1], b"q" * 300 + b"\n"):
        reader.feed(chunk)
        assert reader.pending <= 250 + len(chunk)
        while (event := reader.next_event()) is not None:
            events.append(event)
    assert reader.end_of_input() is None
    assert [type(e).__name__ for e in events] == ["Record", "Problem", "Record", "Problem"]
    assert [e.line for e in events] == [1, 2, 3, 4]
    assert events[1] == Problem(message="line 2 is longer than 250 bytes, skipped", kind="bad", line=2)


def test_byte_at_a_time_equals_all_at_once() -> None:
    data = b"".join(LINES[:4]) + b"nope\n" + LINES[4] + b'{"ts":1,"rid":"torn'
    whole = list(read_events(io.BytesIO(data)))
    trickle = list(read_events(io.BytesIO(data), chunk_size=1))
    assert whole == trickle
    assert whole[-1] == Problem(message="line 7 is incomplete (torn write?), skipped",
                                kind="torn", line=7)


# --- other inputs and outputs -------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"
    assert run([str(path)]) == (2, b"", f"narwhal journal: {path}: No such file or directory\n")
    assert run([str(path), "--follow", "--max-seconds", "0"])[0] == 2


def test_directory_is_an_error(tmp_path: Path) -> None:
    code, out, err = run([str(tmp_path)])
    assert (code, out) == (2, b"")
    assert err.startswith(f"narwhal journal: {tmp_path}: ")


def test_dash_reads_stdin() -> None:
    code, out, err = run(["-", "--rid", "r1"], stdin=b"".join(LINES) + b'{"ts":')
    assert (code, out) == (0, LINES[0] + LINES[3])
    assert "line 11 is incomplete (torn write?), skipped" in err


def test_summary(tmp_path: Path) -> None:
    path = write(tmp_path / "j", *LINES, terminal("r8", "cancelled", None), b"junk\n", b'{"ts"')
    code, out, err = run([str(path), "--summary"])
    assert code == 0
    assert "line 12 is not valid JSON" in err
    assert json.loads(out) == {
        "records": 11,
        "progress": 6,
        "terminal": {"completed": 2, "invalid": 1, "denied": 0, "rejected": 0,
                     "failed": 1, "cancelled": 1},
        "status": {"200": 2, "400": 1, "504": 1, "null": 1},
        "unfinished": 2,
        "skipped_lines": 1,
        "torn_lines": 1,
    }
    assert out.count(b"\n") == 1
    code, out, _ = run([str(path), "--summary", "--terminal", "failed"])
    summary = json.loads(out)
    assert (summary["records"], summary["terminal"]["failed"], summary["status"]) == (1, 1, {"504": 1})


# --- --follow ------------------------------------------------------------


class Follower:
    """``main([... --follow])`` in a thread, stopped by the test."""

    def __init__(self, argv: list[str]) -> None:
        self.out, self.err = io.BytesIO(), io.StringIO()
        self._stop = threading.Event()
        self.code: int | None = None
        self._thread = threading.Thread(target=self._run, args=(argv,), daemon=True)
        self._thread.start()

    def _run(self, argv: list[str]) -> None:
        self.code = main(argv, stdout=self.out, stderr=self.err, stop=self._stop.is_set)

    def wait_for(self, expected: bytes) -> None:
        deadline = time.monotonic() + WAIT_SECONDS
        while self.out.getvalue() != expected:
            assert time.monotonic() < deadline, (self.out.getvalue(), self.err.getvalue())
            time.sleep(0.01)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(WAIT_SECONDS)
        assert not self._thread.is_alive()
        assert self.code is not None
        return self.code


def append(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


def test_follow_picks_up_appended_lines_and_a_completed_torn_line(tmp_path: Path) -> None:
    line = progress("r7")
    path = write(tmp_path / "j", *LINES[:3], line[:30])
    follower = Follower([str(path), "--follow"])
    follower.wait_for(b"".join(LINES[:3]))
    append(path, line[30:])  # the torn line gets its newline
    follower.wait_for(b"".join(LINES[:3]) + line)
    append(path, LINES[3] + LINES[4])
    follower.wait_for(b"".join(LINES[:3]) + line + LINES[3] + LINES[4])
    assert follower.stop() == 0
    assert follower.err.getvalue() == ""


def test_follow_applies_filters(tmp_path: Path) -> None:
    path = write(tmp_path / "j", *LINES)
    follower = Follower([str(path), "--follow", "--terminal", "completed"])
    follower.wait_for(LINES[3] + LINES[9])
    append(path, progress("r8") + terminal("r8", "failed", 502) + terminal("r6"))
    follower.wait_for(LINES[3] + LINES[9] + terminal("r6"))
    assert follower.stop() == 0


def test_follow_reports_a_still_torn_line_when_it_ends(tmp_path: Path) -> None:
    path = write(tmp_path / "j", LINES[0], b'{"ts": 3, "ri')
    started = time.monotonic()
    code, out, err = run([str(path), "--follow", "--max-seconds", "0.3"])
    assert 0.3 <= time.monotonic() - started < WAIT_SECONDS
    assert (code, out) == (0, LINES[0])
    assert err == "narwhal journal: line 2 is incomplete (torn write?), skipped\n"


def test_follow_rereads_a_truncated_file(tmp_path: Path) -> None:
    path = write(tmp_path / "j", *LINES)
    follower = Follower([str(path), "--follow"])
    follower.wait_for(b"".join(LINES))
    path.write_bytes(LINES[1])  # truncate in place, same inode
    follower.wait_for(b"".join(LINES) + LINES[1])
    assert follower.stop() == 0
    assert f"narwhal journal: {path} was truncated; reading it from the start" in follower.err.getvalue()


def test_follow_switches_to_a_rotated_file(tmp_path: Path) -> None:
    path = write(tmp_path / "j", *LINES[:2])
    follower = Follower([str(path), "--follow"])
    follower.wait_for(b"".join(LINES[:2]))
    path.rename(tmp_path / "j.1")
    append(tmp_path / "j.1", LINES[2])  # the writer's last record before it reopens
    write(path, *LINES[3:5])
    follower.wait_for(b"".join(LINES[:5]))
    assert follower.stop() == 0
    assert f"{path} was replaced; reading it from the start" in follower.err.getvalue()


def test_follow_ends_cleanly_on_keyboard_interrupt(day: Path) -> None:
    def interrupt() -> bool:
        raise KeyboardInterrupt

    assert run([str(day), "--follow"], stop=interrupt) == (0, b"".join(LINES), "")


def test_follow_events_sleeps_between_polls(tmp_path: Path) -> None:
    path = write(tmp_path / "j", LINES[0])
    naps: list[float] = []
    events = follow_events(path, stop=lambda: len(naps) >= 3, sleep=naps.append, poll_seconds=0.5)
    assert [type(e) for e in events] == [Record, CaughtUp, CaughtUp, CaughtUp, CaughtUp]
    assert naps == [0.5, 0.5, 0.5]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_follow_exits_zero_on_sigint(tmp_path: Path) -> None:
    path = write(tmp_path / "j", LINES[0])
    code = "import sys; from narwhal.journal_cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path), "--follow"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == LINES[0]  # flushed before waiting
        append(path, LINES[1])
        assert proc.stdout.readline() == LINES[1]
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=WAIT_SECONDS)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (proc.returncode, rest, err) == (0, b"", b"")


def test_broken_pipe_is_quiet(tmp_path: Path) -> None:
    path = write(tmp_path / "j", *(LINES * 2000))
    code = "import sys; from narwhal.journal_cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=WAIT_SECONDS) == 0
    assert err == b""
