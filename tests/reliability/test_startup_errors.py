"""``narwhal serve`` that cannot start: one plain line naming what and why, exit status 1, no traceback.

The process runs as a user would run it (``python -m narwhal serve``), on both
runtimes: a port some other socket holds, a journal in a directory that does
not exist (reported before anything listens), a listen host that does not
resolve.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers import REPO, busy_port
from ..serving import serve_config

#: Upper bound of one start attempt (it fails in well under a second).
WAIT = 60


def _serve(config: Path, runtime: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "narwhal", "serve", "--config", str(config), "--runtime", runtime],
        cwd=REPO, capture_output=True, text=True, timeout=WAIT, stdin=subprocess.DEVNULL,
    )


def _config(tmp_path: Path, journal: Path, listen: str) -> Path:
    path = tmp_path / "narwhal.toml"
    keys = tmp_path / "keys.toml"
    keys.write_text("")  # nobody gets in: a listen address off loopback needs keys
    # Engines are never reached: start-up fails first.
    path.write_text(serve_config(journal, prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"],
                                 ingress={"listen": listen, "auth": "api_keys", "api_keys_file": str(keys)}))
    return path


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr and "ExceptionGroup" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("runtime", ["trio", "asyncio"])
def test_a_busy_port_is_one_line_and_exit_1(tmp_path: Path, runtime: str) -> None:
    with busy_port() as port:
        journal = tmp_path / "journal.jsonl"
        result = _serve(_config(tmp_path, journal, f"127.0.0.1:{port}"), runtime)
    assert _one_line(result) == f"narwhal: cannot listen on 127.0.0.1:{port}: Address already in use"


@pytest.mark.parametrize("runtime", ["trio", "asyncio"])
def test_a_journal_that_cannot_be_opened_is_named_before_listening(tmp_path: Path, runtime: str) -> None:
    journal = tmp_path / "no-such-directory" / "journal.jsonl"
    # The port is busy too: the journal is checked first, so it is what the line names.
    with busy_port() as port:
        result = _serve(_config(tmp_path, journal, f"127.0.0.1:{port}"), runtime)
    assert _one_line(result) == f"narwhal: cannot open journal {journal}: No such file or directory"
    assert not journal.parent.exists()


@pytest.mark.parametrize("runtime", ["trio", "asyncio"])
def test_a_listen_host_that_does_not_resolve_is_one_line(tmp_path: Path, runtime: str) -> None:
    # ".invalid" never resolves (RFC 2606).
    result = _serve(_config(tmp_path, tmp_path / "journal.jsonl", "narwhal-test.invalid:0"), runtime)
    line = _one_line(result)
    assert line.startswith("narwhal: cannot listen on narwhal-test.invalid:0: "), line
