"""``narwhal serve`` as a subprocess, for the tests that need a real process (signals, exit codes).

Shared by the end-to-end, reliability and security suites: a config file
rendered from ``{section: {key: value}}``, and :class:`ServeProcess`, which
runs ``python -m narwhal.cli serve`` and reads its structured log from
stderr line by line (the ``listening`` line gives the bound port).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .helpers import MODEL, REPO


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(value)


def toml_config(sections: Mapping[str, Mapping[str, Any]]) -> str:
    """A Narwhal config file's text from ``{section: {key: value}}``."""
    out = []
    for section, keys in sections.items():
        out.append(f"[{section}]")
        out += [f"{key} = {_toml_value(value)}" for key, value in keys.items()]
        out.append("")
    return "\n".join(out)


def serve_config(
    journal: str | os.PathLike[str],
    *,
    prefill: Sequence[str],
    decode: Sequence[str],
    **sections: Mapping[str, Any],
) -> str:
    """The TOML of a ``narwhal serve`` config for tests: loopback, port 0, fast probes, fsync always."""
    base: dict[str, dict[str, Any]] = {
        "model": {"name": MODEL, "aliases": ["llama-3.1-8b"]},
        "ingress": {"listen": "127.0.0.1:0", "auth": "none"},
        "engine": {"prefill": list(prefill), "decode": list(decode)},
        "health": {"probe_interval_s": 0.2, "probe_timeout_s": 1.0},
        "journal": {"path": os.fspath(journal), "fsync": "always"},
        "shutdown": {"grace_s": 20.0},
    }
    for name, keys in sections.items():
        base.setdefault(name, {}).update(keys)
    return toml_config(base)


def write_config(path: Path, journal: Path, *, prefill: Sequence[str], decode: Sequence[str],
                 **sections: Mapping[str, Any]) -> Path:
    """:func:`serve_config` written to ``path``; returns ``path``."""
    path.write_text(serve_config(journal, prefill=prefill, decode=decode, **sections))
    return path


class ServeProcess:
    """``narwhal serve --config FILE --runtime R`` as a subprocess; stderr read line by line."""

    def __init__(self, config_path: str | os.PathLike[str], runtime: str, env: Mapping[str, str] | None = None,
                 *, nofile: int | None = None) -> None:
        self.args = [sys.executable, "-m", "narwhal.cli", "serve", "--config", os.fspath(config_path),
                     "--runtime", runtime]
        self.env = {**os.environ, **(env or {})}
        #: A soft RLIMIT_NOFILE for the process (file-descriptor exhaustion tests).
        self.nofile = nofile
        self.proc: subprocess.Popen[bytes] | None = None
        self.lines: list[str] = []
        self.address: tuple[str, int] | None = None
        self._cond = threading.Condition()
        self._eof = False

    def start(self, *, listening_timeout: float | None = None) -> ServeProcess:
        """Start the process; with ``listening_timeout``, also wait for its ``listening`` line."""
        self.proc = subprocess.Popen(
            self.args, cwd=REPO, env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=self._limit,
        )
        threading.Thread(target=self._pump, name="narwhal-serve-stderr", daemon=True).start()
        if listening_timeout is not None:
            listening = self.wait_for_event("listening", listening_timeout)
            self.address = (str(listening["host"]), int(listening["port"]))
        return self

    def _limit(self) -> None:
        # In the child, before exec.
        if self.nofile is not None:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, hard))

    @property
    def url(self) -> str:
        assert self.address is not None
        return f"http://{self.address[0]}:{self.address[1]}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for raw in self.proc.stderr:
            with self._cond:
                self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def events(self) -> Iterator[dict[str, Any]]:
        with self._cond:
            lines = list(self.lines)
        for line in lines:
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                yield value

    def wait_for_event(self, name: str, timeout: float = 15.0) -> dict[str, Any]:
        """The first log line of event ``name`` (waiting for it), or TimeoutError."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for event in self.events():
                    if event.get("event") == name:
                        return event
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    raise TimeoutError(f"no {name!r} line on stderr; got: {self.lines}")
                self._cond.wait(left)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stderr_text(self, timeout: float = 5.0) -> str:
        """All of stderr once the process has closed it."""
        with self._cond:
            self._cond.wait_for(lambda: self._eof, timeout)
            return "\n".join(self.lines)

    def stop(self) -> None:
        """Kill the process if a test left it running."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    kill = stop
