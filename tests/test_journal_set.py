"""``narwhal journal PATH`` over the per-worker files of ``ingress.workers`` > 1 (docs/operate.md, "Workers")."""

from __future__ import annotations

import json
from pathlib import Path

from narwhal.journal_set import journal_files

from .test_journal_cli import Follower, append, progress, run, terminal, write

T = 1_700_000_000.0


def _ts(out: bytes) -> list[float]:
    return [json.loads(line)["ts"] for line in out.splitlines()]


def _group(tmp_path: Path) -> Path:
    """Two workers' files, interleaved in time; the configured path itself does not exist."""
    write(tmp_path / "journal.w0.jsonl", progress("a1", T + 1), terminal("a1", ts=T + 4), progress("a2", T + 6))
    write(tmp_path / "journal.w1.jsonl", progress("b1", T + 2), progress("b2", T + 3), terminal("b1", ts=T + 5))
    return tmp_path / "journal.jsonl"


def test_the_set_is_the_path_and_its_worker_files_by_number(tmp_path: Path) -> None:
    path = _group(tmp_path)
    write(tmp_path / "journal.w10.jsonl", progress("c1", T))
    write(tmp_path / "journal.wx.jsonl", progress("d1", T))  # not a worker number
    write(tmp_path / "other.w0.jsonl", progress("e1", T))
    assert journal_files(str(path)) == [str(tmp_path / f"journal.w{k}.jsonl") for k in (0, 1, 10)]
    write(path, progress("p", T))
    assert journal_files(str(path))[0] == str(path)
    assert journal_files(str(tmp_path / "single.jsonl")) == [str(tmp_path / "single.jsonl")]


def test_reads_the_worker_files_as_one_stream_ordered_by_time(tmp_path: Path) -> None:
    code, out, err = run([str(_group(tmp_path))])
    assert code == 0, err
    assert _ts(out) == [T + k for k in range(1, 7)]
    assert [json.loads(line)["rid"] for line in out.splitlines()] == ["a1", "b1", "b2", "a1", "b1", "a2"]


def test_unfinished_and_rid_over_the_set(tmp_path: Path) -> None:
    path = str(_group(tmp_path))
    assert [json.loads(line)["rid"] for line in run([path, "--unfinished"])[1].splitlines()] == ["b2", "a2"]
    assert _ts(run([path, "--rid", "b1"])[1]) == [T + 2, T + 5]


def test_a_bad_line_names_its_file(tmp_path: Path) -> None:
    path = _group(tmp_path)
    append(tmp_path / "journal.w1.jsonl", b"not json\n")
    code, out, err = run([str(path)])
    assert code == 0 and len(out.splitlines()) == 6
    assert "journal.w1.jsonl: line 4" in err


def test_follow_merges_what_each_file_gains(tmp_path: Path) -> None:
    path = _group(tmp_path)
    follower = Follower([str(path), "--follow"])
    first = run([str(path)])[1]
    follower.wait_for(first)
    append(tmp_path / "journal.w1.jsonl", progress("b3", T + 8))
    append(tmp_path / "journal.w0.jsonl", terminal("a2", ts=T + 7))
    follower.wait_for(first + terminal("a2", ts=T + 7) + progress("b3", T + 8))
    write(tmp_path / "journal.w2.jsonl", progress("c1", T + 9))  # a worker file that appears later
    follower.wait_for(first + terminal("a2", ts=T + 7) + progress("b3", T + 8) + progress("c1", T + 9))
    assert follower.stop() == 0
