"""The ``narwhal`` command itself: help, version, ``python -m narwhal``, one-line errors.

Each case runs the command as a subprocess (``python -m narwhal``), as a user would.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import REPO

#: Upper bound of each command's run (they answer in well under a second).
WAIT = 60


def narwhal(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "narwhal", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=WAIT)


def _installed_version() -> str:
    from importlib.metadata import version

    return version("narwhal")


def test_version_prints_the_version_and_exits_0() -> None:
    result = narwhal("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"narwhal {_installed_version()}\n", result.stdout
    assert result.stderr == ""


def test_python_dash_m_narwhal_is_the_narwhal_command(tmp_path: Path) -> None:
    # From outside the source tree too: the installed package, not a file next to the cwd.
    result = narwhal("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout and "--version" in result.stdout


@pytest.mark.parametrize("command", [(), ("serve",), ("demo",), ("journal",), ("sim",)])
def test_help_is_clean_text(command: tuple[str, ...]) -> None:
    result = narwhal(*command, "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert text.strip(), result
    assert "`" not in text, text  # no reStructuredText markup
    assert "SPEC" not in text and "§" not in text, text  # no document the repository does not hold
    if not command:
        for name in ("serve", "demo", "sim", "journal"):
            assert re.search(rf"^  {name}\b", text, re.M), text


def test_no_command_or_an_unknown_one_is_an_error() -> None:
    result = narwhal()
    assert result.returncode == 2 and "usage: narwhal" in result.stderr, result
    result = narwhal("frobnicate")
    assert result.returncode == 2, result
    assert result.stderr.splitlines() == [
        "narwhal: unknown command 'frobnicate' (narwhal --help lists the commands)"
    ], result.stderr


@pytest.mark.parametrize(("listen", "engine", "key"), [
    ("127.0.0.1:99999", "http://127.0.0.1:8100", "ingress.listen"),
    ("127.0.0.1:0", "http://127.0.0.1:99999", "engine.decode[0]"),
])
def test_a_bad_port_is_one_line_naming_the_key_and_the_value_once(tmp_path: Path, listen: str, engine: str,
                                                                    key: str) -> None:
    config = tmp_path / "narwhal.toml"
    config.write_text(f'[model]\nname = "m"\n[ingress]\nlisten = "{listen}"\n[engine]\ndecode = ["{engine}"]\n'
                      f'[journal]\npath = "{tmp_path / "journal.jsonl"}"\n')
    result = narwhal("serve", "--config", str(config))
    assert result.returncode == 2, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"narwhal: bad config: {key}: "), lines
    assert lines[0].count("got") == 1, lines[0]
    assert "99999" in lines[0] and "65535" in lines[0], lines[0]
