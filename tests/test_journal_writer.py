"""The journal file writer alone: batches, counts, a full disk (Linux's ``/dev/full``) and recovery."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from narwhal_runtime import journal_writer
from narwhal_runtime.journal_writer import JournalWriter


def _line(n: int) -> bytes:
    return b'{"rid":"r%d","terminal":"ok"}\n' % n


def test_write_lines_is_one_write_of_whole_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "journal.jsonl"
    writer = JournalWriter(str(path), fsync="never")
    calls: list[int] = []
    real_write = os.write

    def counting_write(fd: int, data: bytes | memoryview) -> int:
        calls.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(journal_writer.os, "write", counting_write)
    assert writer.write_lines([_line(1), _line(2), _line(3)])
    assert writer.write(_line(4))
    writer.close()
    assert len(calls) == 2
    assert writer.written == 4
    assert path.read_bytes() == b"".join(_line(n) for n in (1, 2, 3, 4))


def test_full_disk_keeps_batches_pending_in_order_and_recovers(tmp_path: Path) -> None:
    writer = JournalWriter("/dev/full", fsync="never")
    writer._owned = False  # never fsync or close /dev/full's descriptor as a journal
    assert not writer.write_lines([_line(1), _line(2)])
    assert not writer.ok and writer.error is not None
    assert not writer.write(_line(3))
    assert writer.written == 0 and writer.dropped == 0
    # The disk has room again: the same writer, now on a real file.
    os.close(writer._fd)
    path = tmp_path / "journal.jsonl"
    writer._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    writer._owned = True
    assert writer.retry()
    assert writer.ok and writer.error is None
    assert writer.write_lines([_line(4)])
    writer.close()
    assert writer.written == 4
    assert path.read_bytes() == b"".join(_line(n) for n in (1, 2, 3, 4))


def test_a_full_pending_buffer_counts_every_record_of_a_dropped_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_writer, "MAX_PENDING_BYTES", 100)
    writer = JournalWriter("/dev/full", fsync="never")
    try:
        assert not writer.write(_line(1))  # pending: 30 bytes
        assert not writer.write_lines([_line(n) for n in range(2, 6)])  # 4 more records would pass the bound
        assert writer.dropped == 4
        assert writer.written == 0
    finally:
        writer.close()
