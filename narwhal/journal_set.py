"""``narwhal journal PATH`` over the per-worker files of a group (docs/operate.md, "Workers").

With ``ingress.workers`` > 1 worker K appends to ``PATH`` with ``.wK``
inserted before the suffix (``journal.jsonl`` -> ``journal.w0.jsonl``;
:func:`narwhal_runtime.workers.worker_journal_path`). Each file is in time
order (one writer, one clock); this module merges them by the records'
``ts`` (wall-clock seconds, the first field of every record) into one stream,
so ``--rid``, ``--terminal``, ``--unfinished`` and ``--summary`` work on the
set as on one file. A problem (a bad or torn line) is reported with its
file's name, where it occurs in that file's order.

``--follow`` polls every file in turn: each round gathers what every file
gained since the last one and emits it sorted by ``ts`` (records of the
same moment in different files may be a round apart, never out of order
within a round). A worker file that appears later joins the stream.
"""

from __future__ import annotations

import heapq
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from .journal_read import POLL_SECONDS, CaughtUp, Event, Problem, Record, follow_events, read_events

__all__ = ["journal_files", "read_merged", "follow_merged"]


def journal_files(path: str) -> list[str]:
    """``path`` (when it exists, or when no worker file does) and its worker files, by worker number."""
    pure = Path(path)
    suffix = pure.suffix
    stem = pure.stem if suffix else pure.name
    workers: list[tuple[int, str]] = []
    try:
        names = os.listdir(pure.parent if str(pure.parent) else ".")
    except OSError:
        names = []
    prefix = f"{stem}.w"
    for name in names:
        if name.startswith(prefix) and name.endswith(suffix):
            number = name[len(prefix): len(name) - len(suffix)] if suffix else name[len(prefix):]
            if number.isdigit():
                workers.append((int(number), str(pure.with_name(name))))
    files = [name for _, name in sorted(workers)]
    if pure.exists() or not files:
        files.insert(0, path)
    return files


def _named(problem: Problem, path: str) -> Problem:
    return Problem(message=f"{path}: {problem.message}", kind=problem.kind, line=problem.line)


def _keyed(path: str) -> Iterator[tuple[float, int, Event]]:
    """One file's events with the key the merge sorts by (a problem: its predecessor's time)."""
    last = float("-inf")
    with open(path, "rb") as file:
        for n, event in enumerate(read_events(file)):
            if isinstance(event, Record):
                last = event.ts
                yield last, n, event
            else:
                yield last, n, _named(event, path)


def read_merged(paths: list[str]) -> Iterator[Event]:
    """Every record and problem of ``paths``, merged by ``ts`` (all files opened first: a missing one fails early)."""
    for path in paths:
        open(path, "rb").close()  # noqa: SIM115 - raises OSError naming it before anything is printed

    def events() -> Iterator[Event]:
        for _, _, event in heapq.merge(*(_keyed(p) for p in paths), key=lambda item: (item[0], item[1])):
            yield event

    return events()


def follow_merged(
    paths: list[str],
    path: str,
    *,
    stop: Callable[[], bool] = lambda: False,
    poll_seconds: float = POLL_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[Event | CaughtUp]:
    """``--follow`` over the set: round by round, what every file gained, sorted by ``ts``."""
    ending = False
    followers: dict[str, Iterator[Event | CaughtUp]] = {}

    def join(name: str) -> None:
        if name not in followers:
            followers[name] = follow_events(name, stop=lambda: ending, sleep=lambda _s: None)

    for name in paths:
        join(name)
    while True:
        yield from _round(followers)
        yield CaughtUp()
        if stop():
            break
        sleep(poll_seconds)
        for name in journal_files(path):
            if os.path.exists(name):
                join(name)
    ending = True
    for name, follower in followers.items():
        for event in follower:  # each ends after its torn-line report
            if isinstance(event, Problem):
                yield _named(event, name)


def _round(followers: dict[str, Iterator[Event | CaughtUp]]) -> Iterator[Event]:
    """One poll of every file: records sorted by ``ts``, problems first."""
    records: list[Record] = []
    for name, follower in followers.items():
        for event in follower:
            if isinstance(event, CaughtUp):
                break
            if isinstance(event, Problem):
                yield _named(event, name)
            else:
                records.append(event)
    records.sort(key=lambda record: record.ts)
    yield from records
