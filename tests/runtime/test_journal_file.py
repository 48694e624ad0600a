"""The journal file both runtimes hold (narwhal_runtime/journal_file.py): its fsync timer on trio and asyncio."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import trio

from narwhal_runtime.journal_file import JournalFile


def run_timer(runtime: str, journal: JournalFile, seconds: float) -> None:
    """Run the fsync timer for ``seconds``, cancel it, close the journal."""
    if runtime == "trio":

        async def main() -> None:
            with trio.move_on_after(seconds):
                await journal.run_sync_timer()
            await journal.aclose()

        trio.run(main)
    else:

        async def amain() -> None:
            timer = asyncio.ensure_future(journal.run_sync_timer())
            await asyncio.sleep(seconds)
            timer.cancel()
            await asyncio.gather(timer, return_exceptions=True)
            await journal.aclose()

        asyncio.run(amain())


def open_journal(runtime: str, path: Path, interval: float = 0.01) -> JournalFile:
    if runtime == "trio":
        return JournalFile(str(path), "interval", interval, sleep=trio.sleep, in_thread=trio.to_thread.run_sync)
    return JournalFile(str(path), "interval", interval, sleep=asyncio.sleep, in_thread=asyncio.to_thread)


@pytest.mark.parametrize("runtime", ["trio", "asyncio"])
def test_the_timer_fsyncs_in_a_worker_thread_and_close_writes_out(runtime: str, tmp_path: Path) -> None:
    journal = open_journal(runtime, tmp_path / "j.jsonl")
    threads: list[str] = []
    fsync_now = journal.writer.fsync_now

    def fsync_in_thread() -> None:
        threads.append(threading.current_thread().name)
        fsync_now()

    journal.writer.fsync_now = fsync_in_thread  # type: ignore[method-assign]
    assert journal.writer.write_lines([b'{"a":1}\n', b'{"b":2}\n'])
    run_timer(runtime, journal, 0.1)
    assert threads and threads[0] != threading.main_thread().name  # the close's own fsync runs here
    assert (tmp_path / "j.jsonl").read_bytes() == b'{"a":1}\n{"b":2}\n'
    assert journal.writer._owned is False  # closed


def test_an_fsync_queued_behind_the_close_does_nothing(tmp_path: Path) -> None:
    # A cancelled timer can leave its worker-thread job queued: once closed, it must not fsync the descriptor.
    journal = open_journal("asyncio", tmp_path / "j.jsonl")
    journal.writer.write(b'{"a":1}\n')
    asyncio.run(journal.aclose())
    calls: list[int] = []
    journal.writer.fsync_now = lambda: calls.append(1)  # type: ignore[method-assign]
    journal._fsync()
    assert calls == []


def test_close_waits_for_a_running_fsync(tmp_path: Path) -> None:
    journal = open_journal("asyncio", tmp_path / "j.jsonl")
    started, release = threading.Event(), threading.Event()
    order: list[str] = []

    def slow_fsync() -> None:
        started.set()
        release.wait(5)
        order.append("fsync")

    journal.writer.fsync_now = slow_fsync  # type: ignore[method-assign]
    worker = threading.Thread(target=journal._fsync)
    worker.start()
    assert started.wait(5)
    closer = threading.Thread(target=lambda: (asyncio.run(journal.aclose()), order.append("close")))
    closer.start()
    closer.join(0.1)
    assert order == []  # the close waits for the fsync
    release.set()
    worker.join(5)
    closer.join(5)
    assert order == ["fsync", "fsync", "close"]  # the timer's fsync, then the close's own
