"""``narwhal serve --check-config``: serve's start-up checks, with serve's messages, and nothing more.

Each case runs the command as a subprocess, as an operator (or a CI job, or
a pod) would; a bad config is also given to ``narwhal serve`` itself, which
must refuse it with the very same line and exit status.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .helpers import REPO, busy_port, write_keys_file

WAIT = 60
KEY_ENV = "NARWHAL_CHECK_TEST_ENGINE_KEY"


def narwhal(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "narwhal", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=WAIT, env={**os.environ, KEY_ENV: "engine-secret", **(env or {})})


def config_text(tmp_path: Path, *, listen: str, engine: str, journal: Path, extra: str = "") -> str:
    return (f'[model]\nname = "m"\n'
            f'[ingress]\nlisten = "{listen}"\nauth = "api_keys"\napi_keys_file = "{tmp_path / "keys.toml"}"\n'
            f'[engine]\nprefill = ["{engine}"]\ndecode = ["{engine}"]\nengine_api_key_env = "{KEY_ENV}"\n'
            f'[journal]\npath = "{journal}"\n{extra}')


@pytest.fixture
def engine() -> Iterator[socket.socket]:
    """A listening socket standing for an engine: it must see no connection."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        sock.setblocking(False)
        yield sock


def test_a_valid_config_is_one_line_exit_0_without_listening_or_contacting_engines(
        tmp_path: Path, engine: socket.socket) -> None:
    write_keys_file(tmp_path / "keys.toml", {"team-a": "key-a"})
    journal = tmp_path / "journal.jsonl"
    port = engine.getsockname()[1]
    with busy_port() as taken:  # serve could not listen there: the check does not try
        config = tmp_path / "narwhal.toml"
        config.write_text(config_text(tmp_path, listen=f"0.0.0.0:{taken}", engine=f"http://127.0.0.1:{port}",
                                      journal=journal))
        result = narwhal("serve", "--config", str(config), "--check-config")
    assert result.returncode == 0, result
    assert result.stderr == ""
    assert result.stdout.splitlines() == [
        f"narwhal: config {config} is valid (listen 0.0.0.0:{taken}, auth api_keys, 1 prefill engine and "
        f"1 decode engine, journal {journal}); no socket was opened and no engine contacted"
    ], result.stdout
    with pytest.raises(BlockingIOError):
        engine.accept()  # no probe reached the engine
    assert not journal.exists()  # checked, not created


def _bad_cases(tmp_path: Path) -> dict[str, tuple[str, dict[str, str]]]:
    """name -> (config text, extra environment) of configs serve refuses before it listens."""

    def text(journal: Path = tmp_path / "journal.jsonl", extra: str = "") -> str:
        return config_text(tmp_path, listen="127.0.0.1:0", engine="http://127.0.0.1:9", journal=journal,
                           extra=extra)

    return {
        "unknown_key": (text(extra="[shutdown]\ngrace = 5\n"), {}),
        "credential_empty": (text(), {KEY_ENV: ""}),
        "journal_directory_missing": (text(journal=tmp_path / "no" / "j.jsonl"), {}),
    }


@pytest.mark.parametrize(("case", "status", "line"), [
    ("unknown_key", 2, "narwhal: bad config: shutdown.grace: unknown key (did you mean grace_s?)"),
    ("credential_empty", 2, f"narwhal: bad config: engine.engine_api_key_env: environment variable {KEY_ENV} is empty"),
    ("journal_directory_missing", 1, "narwhal: cannot open journal {tmp}/no/j.jsonl: No such file or directory"),
])
def test_a_bad_config_gets_serves_line_and_exit_status(tmp_path: Path, case: str, status: int, line: str) -> None:
    write_keys_file(tmp_path / "keys.toml", {"team-a": "key-a"})
    text, env = _bad_cases(tmp_path)[case]
    config = tmp_path / "narwhal.toml"
    config.write_text(text)
    checked = narwhal("serve", "--config", str(config), "--check-config", env=env)
    assert (checked.returncode, checked.stdout, checked.stderr.splitlines()) == (
        status, "", [line.format(tmp=tmp_path)]), checked
    served = narwhal("serve", "--config", str(config), env=env)
    assert (served.returncode, served.stderr) == (checked.returncode, checked.stderr), served


def test_a_bad_keys_file_is_refused_as_serve_refuses_it(tmp_path: Path) -> None:
    (tmp_path / "keys.toml").write_text('[[keys]]\nclient = "a"\nsha256 = "not-hex"\n')
    config = tmp_path / "narwhal.toml"
    config.write_text(config_text(tmp_path, listen="127.0.0.1:0", engine="http://127.0.0.1:9",
                                  journal=tmp_path / "journal.jsonl"))
    checked = narwhal("serve", "--config", str(config), "--check-config")
    assert checked.returncode == 2, checked
    assert checked.stderr.splitlines() == [
        "narwhal: bad config: ingress.api_keys_file: keys[0].sha256: must be 64 hex digits"], checked.stderr
    served = narwhal("serve", "--config", str(config))
    assert (served.returncode, served.stderr) == (2, checked.stderr), served


def test_a_missing_config_file_is_exit_2_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.toml"
    checked = narwhal("serve", "--config", str(missing), "--check-config")
    assert checked.returncode == 2, checked
    assert checked.stderr.splitlines() == [
        f"narwhal: bad config: config: cannot read {missing}: No such file or directory"], checked.stderr
    served = narwhal("serve", "--config", str(missing))
    assert (served.returncode, served.stderr) == (2, checked.stderr), served


def test_an_existing_journal_is_opened_for_appending_and_left_unchanged(tmp_path: Path) -> None:
    write_keys_file(tmp_path / "keys.toml", {"team-a": "key-a"})
    journal = tmp_path / "journal.jsonl"
    journal.write_text('{"old": 1}\n')
    before = journal.stat()
    config = tmp_path / "narwhal.toml"
    config.write_text(config_text(tmp_path, listen="127.0.0.1:0", engine="http://127.0.0.1:9", journal=journal))
    assert narwhal("serve", "--config", str(config), "--check-config").returncode == 0
    assert journal.read_text() == '{"old": 1}\n' and journal.stat().st_mtime_ns == before.st_mtime_ns


def test_a_journal_path_serve_cannot_open_is_exit_1_with_serves_line(tmp_path: Path) -> None:
    write_keys_file(tmp_path / "keys.toml", {"team-a": "key-a"})
    journal = tmp_path / "journal.jsonl"
    journal.mkdir()  # refused even to root, unlike a mode
    config = tmp_path / "narwhal.toml"
    config.write_text(config_text(tmp_path, listen="127.0.0.1:0", engine="http://127.0.0.1:9", journal=journal))
    checked = narwhal("serve", "--config", str(config), "--check-config")
    assert (checked.returncode, checked.stderr) == (1, f"narwhal: cannot open journal {journal}: Is a directory\n")
    served = narwhal("serve", "--config", str(config))
    assert (served.returncode, served.stderr) == (1, checked.stderr), served
