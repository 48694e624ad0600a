"""``narwhal journal``: read a Narwhal journal (docs/operate.md, "The journal").

The journal is JSON Lines written one record at a time by a process that may
be killed at any moment, so this reader takes the file as it finds it:

* A last line without its newline is a *torn write*: it is reported on
  stderr and skipped; with ``--follow`` it waits for its newline instead.
* A complete line that is not a journal record (not JSON, not an object,
  no ``rid``...) is reported with its line number and skipped. When a
  restarted writer appended a whole record right after a torn one, the
  record after the torn bytes is kept.
* Nothing is held in memory per line read: the file is streamed in chunks,
  and only ``--unfinished`` / ``--summary`` keep state, one entry per
  request still in flight.
* The per-worker files of ``ingress.workers`` > 1 (``journal.w0.jsonl``...
  next to ``journal.jsonl``) are read as one stream ordered by the records'
  ``ts`` (:mod:`narwhal.journal_set`).

The reading machinery is pull-based like the core (:class:`JournalReader`:
``feed`` bytes, drain ``next_event``); the I/O lives in :func:`read_events`
and :func:`follow_events`, and :func:`main` only wires them to the flags.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, Final, TextIO

import attrs

from narwhal_core import wire
from narwhal_core.journal import TERMINALS

from .journal_read import (
    CHUNK_BYTES, MAX_LINE_BYTES, POLL_SECONDS, CaughtUp, Event, JournalReader, Problem, Record, follow_events,
    read_events,
)
from .journal_set import follow_merged, journal_files, read_merged

__all__ = [
    "MAX_LINE_BYTES",
    "CHUNK_BYTES",
    "POLL_SECONDS",
    "MAX_REPORTS",
    "Record",
    "Problem",
    "CaughtUp",
    "Selection",
    "JournalReader",
    "UnfinishedTracker",
    "Summary",
    "read_events",
    "follow_events",
    "main",
]

#: Problems reported one by one before the rest are only counted.
MAX_REPORTS: Final = 100

_PROG: Final = "narwhal journal"


@attrs.frozen(kw_only=True)
class Selection:
    """The ``--rid`` / ``--terminal`` filters; both must match (AND)."""

    #: Only records of this request.
    rid: str | None = None
    #: Only terminal records with this ``terminal`` value.
    terminal: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.terminal is not None and self.terminal not in TERMINALS:
            raise ValueError(
                f"unknown terminal {self.terminal!r} (expected one of {', '.join(TERMINALS)})"
            )

    def matches_rid(self, record: Record) -> bool:
        """Whether the record passes ``--rid``."""
        return self.rid is None or record.rid == self.rid

    def matches(self, record: Record) -> bool:
        """Whether the record passes every filter."""
        if not self.matches_rid(record):
            return False
        return self.terminal is None or record.terminal == self.terminal


class UnfinishedTracker:
    """Requests with a progress record and no terminal record yet (``--unfinished``).

    Holds one record per unfinished request, so its memory follows the
    number of requests in flight, not the size of the journal. A progress
    record arriving after its request's terminal record (which the writer
    never does: docs/contract.md, "The journal") opens the request again.
    """

    def __init__(self) -> None:
        # dict order is first appearance; updating a key keeps its place.
        self._last: dict[str, Record] = {}

    def add(self, record: Record) -> None:
        """Account for one record, in file order."""
        if record.terminal is None:
            self._last[record.rid] = record
        else:
            self._last.pop(record.rid, None)

    def __len__(self) -> int:
        return len(self._last)

    def records(self) -> list[Record]:
        """The last record of each unfinished request, by first appearance."""
        return list(self._last.values())


class Summary:
    """Counts for ``--summary``."""

    def __init__(self) -> None:
        self.records = 0
        self.progress = 0
        self.terminal: dict[str, int] = dict.fromkeys(TERMINALS, 0)
        self.status: collections.Counter[int | None] = collections.Counter()

    def add(self, record: Record) -> None:
        """Count one selected record."""
        self.records += 1
        if record.terminal is None:
            self.progress += 1
        else:
            self.terminal[record.terminal] += 1
            self.status[record.status] += 1

    def to_json(self, *, unfinished: int, skipped: int, torn: int) -> dict[str, Any]:
        """The summary as one JSON object; ``status`` counts terminal records only."""
        statuses = sorted(self.status, key=lambda s: (s is None, s or 0))
        return {
            "records": self.records,
            "progress": self.progress,
            "terminal": dict(self.terminal),
            "status": {("null" if s is None else str(s)): self.status[s] for s in statuses},
            "unfinished": unfinished,
            "skipped_lines": skipped,
            "torn_lines": torn,
        }



class _Reporter:
    """Problems to stderr, the first :data:`MAX_REPORTS` one by one."""

    def __init__(self, stderr: TextIO) -> None:
        self._stderr = stderr
        self.bad = 0
        self.torn = 0
        self._reported = 0

    def report(self, problem: Problem) -> None:
        if problem.kind == "bad":
            self.bad += 1
        elif problem.kind == "torn":
            self.torn += 1
        if problem.kind == "bad" and self._reported >= MAX_REPORTS:
            if self._reported == MAX_REPORTS:
                self._say("more bad lines follow; only counting them from here")
                self._reported += 1
            return
        if problem.kind == "bad":
            self._reported += 1
        self._say(problem.message)

    def finish(self) -> None:
        if self._reported > MAX_REPORTS:
            self._say(f"{self.bad} bad lines skipped in all")

    def _say(self, message: str) -> None:
        print(f"{_PROG}: {message}", file=self._stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Read a Narwhal journal (JSON Lines): print matching records, one per line.",
    )
    parser.add_argument("file", metavar="FILE", help="the journal file, or - for stdin")
    parser.add_argument("--rid", metavar="ID", help="only records of this router request ID")
    parser.add_argument(
        "--terminal", metavar="T",
        help=f"only terminal records with this terminal value ({', '.join(TERMINALS)})",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--follow", "-f", action="store_true",
        help="keep printing records as they are appended, until interrupted",
    )
    mode.add_argument(
        "--unfinished", action="store_true",
        help="print the last record of each request with no terminal record (after a crash)",
    )
    mode.add_argument(
        "--summary", action="store_true",
        help="print counts by terminal value and status, and unfinished requests, as one JSON object",
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 if any complete line had to be skipped",
    )
    # For tests and scripts: end --follow after this many seconds.
    parser.add_argument("--max-seconds", type=float, metavar="S", help=argparse.SUPPRESS)
    return parser


def main(
    argv: list[str],
    *,
    stdin: BinaryIO | None = None,
    stdout: BinaryIO | None = None,
    stderr: TextIO | None = None,
    stop: Callable[[], bool] | None = None,
) -> int:
    """Run ``narwhal journal`` with the arguments after ``journal``; return the exit status.

    Exit status: 0 (also when lines were skipped), 1 with ``--strict`` when a
    complete line was skipped, 2 for a usage error or an unreadable file.
    ``stdin``/``stdout``/``stderr`` default to the process's; ``stop`` ends
    ``--follow`` when it returns true (checked at each end of the file).
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed usage or help
        return exc.code if isinstance(exc.code, int) else 2
    if args.terminal is not None and args.terminal not in TERMINALS:
        parser.print_usage(sys.stderr)
        print(f"{_PROG}: error: --terminal must be one of {', '.join(TERMINALS)}, "
              f"not {args.terminal!r}", file=sys.stderr)
        return 2
    if args.terminal is not None and args.unfinished:
        parser.print_usage(sys.stderr)
        print(f"{_PROG}: error: --terminal cannot be combined with --unfinished "
              "(an unfinished request has no terminal record)", file=sys.stderr)
        return 2
    if args.max_seconds is not None and args.max_seconds < 0:
        parser.print_usage(sys.stderr)
        print(f"{_PROG}: error: --max-seconds must not be negative", file=sys.stderr)
        return 2

    out = stdout if stdout is not None else sys.stdout.buffer
    err = stderr if stderr is not None else sys.stderr
    selection = Selection(rid=args.rid, terminal=args.terminal)
    reporter = _Reporter(err)
    try:
        _run(args, selection, reporter, out, stdin, stop)
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):
            _silence_stdout(out)
            return 0  # the reader (head, less) has had enough
        # Opening the journal names it; a failed write to stdout does not.
        where = f"{os.fsdecode(exc.filename)}: " if exc.filename is not None else ""
        print(f"{_PROG}: {where}{exc.strerror or exc}", file=err)
        return 2
    except KeyboardInterrupt:
        _flush(out)
        reporter.finish()
        return 0 if args.follow else 130
    reporter.finish()
    return 1 if args.strict and reporter.bad else 0


def _run(
    args: argparse.Namespace,
    selection: Selection,
    reporter: _Reporter,
    out: BinaryIO,
    stdin: BinaryIO | None,
    stop: Callable[[], bool] | None,
) -> None:

    events: Iterator[Event | CaughtUp]
    files = [] if args.file == "-" else journal_files(args.file)
    if args.file == "-":
        events = read_events(stdin if stdin is not None else sys.stdin.buffer)
    elif len(files) > 1 or files != [args.file]:  # the per-worker files of ingress.workers > 1
        events = (follow_merged(files, args.file, stop=_stopper(stop, args.max_seconds)) if args.follow
                  else read_merged(files))
    elif args.follow:
        events = follow_events(args.file, stop=_stopper(stop, args.max_seconds))
    else:
        events = _read_file(args.file)

    tracker = UnfinishedTracker() if (args.unfinished or args.summary) else None
    summary = Summary() if args.summary else None
    for event in events:
        if isinstance(event, CaughtUp):
            out.flush()  # --follow: show what we have before waiting
        elif isinstance(event, Problem):
            reporter.report(event)
        else:
            if tracker is not None and selection.matches_rid(event):
                tracker.add(event)
            if not selection.matches(event):
                continue
            if summary is not None:
                summary.add(event)
            elif not args.unfinished:
                out.write(event.raw)
    if args.unfinished and tracker is not None:
        for record in tracker.records():
            out.write(record.raw)
    if summary is not None and tracker is not None:
        body = summary.to_json(unfinished=len(tracker), skipped=reporter.bad, torn=reporter.torn)
        out.write(wire.dumps(body) + b"\n")
    out.flush()


def _read_file(path: str) -> Iterator[Event]:
    # Opened before the first event is asked for, so a missing file fails
    # before anything is printed.
    file = open(path, "rb")  # noqa: SIM115 - closed by the generator below

    def events() -> Iterator[Event]:
        with file:
            yield from read_events(file)

    return events()


def _stopper(stop: Callable[[], bool] | None, max_seconds: float | None) -> Callable[[], bool]:
    if max_seconds is None:
        return stop if stop is not None else (lambda: False)
    deadline = time.monotonic() + max_seconds
    if stop is None:
        return lambda: time.monotonic() >= deadline
    return lambda: stop() or time.monotonic() >= deadline


def _flush(out: BinaryIO) -> None:
    try:
        out.flush()
    except OSError:
        pass


def _silence_stdout(out: BinaryIO) -> None:
    # Python would report the broken pipe again when it flushes stdout at exit.
    if out is sys.stdout.buffer:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
