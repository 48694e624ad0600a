"""``narwhal serve --workers 2`` (docs/operate.md, "Workers"): real processes on loopback.

A supervisor and two worker processes share one port (``SO_REUSEPORT``) in
front of simulated engines in this process. Which worker answered a request
shows in the journal: each worker appends to its own file
(``journal.w0.jsonl``, ``journal.w1.jsonl``) and each process draws its rids
from its own random prefix, so a rid names the process that served it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal_sim.testing import SimThread

from ..helpers import COMPLETIONS, MODEL, REPO, poll, read_journal, rid_of
from .support import ServeProcess, serve_config

#: Bounded waits: a worker is a Python process that imports the router first.
START_S = 30.0


def _start(tmp_path: Path, runtime: str, prefill: SimThread, decode: SimThread, **sections: Any) -> ServeProcess:
    config = tmp_path / "narwhal.toml"
    config.write_text(serve_config(tmp_path / "journal.jsonl", prefill=[prefill.url], decode=[decode.url],
                                   **sections))
    process = ServeProcess(config, runtime)
    process.args += ["--workers", "2"]
    return process.start(listening_timeout=START_S)


def _complete(url: str, text: str) -> httpx.Response:
    # A new connection per request: the kernel spreads connections, not requests, across the workers.
    return httpx.post(url + COMPLETIONS, json={"model": MODEL, "prompt": text, "max_tokens": 4}, timeout=20)


def _terminal_rids(path: Path) -> set[str]:
    if not path.exists():
        return set()
    return {r["rid"] for r in read_journal(path) if r.get("terminal") is not None}


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _journal_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.fspath(REPO)}
    return subprocess.run([sys.executable, "-m", "narwhal", "journal", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=30)


def test_two_workers_share_the_port_serve_metrics_as_a_group_and_drain_on_sigterm(tmp_path, runtime) -> None:
    with SimThread(role="prefill", speed=0) as prefill, SimThread(role="decode", speed=0) as decode:
        process = _start(tmp_path, runtime, prefill, decode)
        try:
            listening = process.wait_for_event("listening")
            assert listening["workers"] == 2 and len(set(listening["pids"])) == 2
            workers = [e for e in process.events() if e.get("event") == "worker_listening"]
            assert {e["port"] for e in workers} == {listening["port"]}  # port 0: one port for the group
            assert {e["runtime"] for e in workers} == {runtime}

            rids = {rid_of(r) for r in (_complete(process.url, f"request {i}") for i in range(24))}
            assert len(rids) == 24
            files = [tmp_path / "journal.w0.jsonl", tmp_path / "journal.w1.jsonl"]
            served = [_terminal_rids(f) for f in files]
            assert served[0] and served[1], "both workers must have served"
            assert served[0] | served[1] == rids and not served[0] & served[1]
            # Each worker draws its rids from its own prefix.
            assert {r[:10] for r in served[0]}.isdisjoint({r[:10] for r in served[1]})

            # /metrics adds up both workers (a sibling's snapshot is at most a second old).
            def group_total() -> str | None:
                text = httpx.get(process.url + "/metrics", timeout=10).text
                done = _metric(text, "narwhal_requests_total{")
                return text if done == 24 and _metric(text, "narwhal_workers_reporting") == 2 else None

            poll(group_total, timeout=10)
            assert httpx.get(process.url + "/ready", timeout=10).status_code == 200

            # narwhal journal PATH reads the workers' files as one stream, in time order.
            merged = _journal_cli(os.fspath(tmp_path / "journal.jsonl"))
            assert merged.returncode == 0, merged.stderr
            records = [json.loads(line) for line in merged.stdout.splitlines()]
            assert [r["ts"] for r in records] == sorted(r["ts"] for r in records)
            assert {r["rid"] for r in records if r["terminal"] is not None} == rids
            assert len(records) == sum(len(read_journal(f)) for f in files)

            # SIGHUP reaches every worker: each rereads its keys.
            os.kill(process.pid, signal.SIGHUP)
            poll(lambda: {e.get("worker") for e in process.events() if e.get("event") == "keys_reloaded"} == {0, 1},
                 timeout=10)

            os.kill(process.pid, signal.SIGTERM)
            assert process.wait(START_S) == 0
            exits = [e for e in process.events() if e.get("event") == "worker_exited"]
            assert sorted(e["worker"] for e in exits) == [0, 1]
            assert {e["status"] for e in exits} == {0}
            assert {e.get("worker") for e in process.events() if e.get("event") == "drained"} == {0, 1}
        finally:
            process.stop()


class _Traffic:
    """Requests on new connections, one after another, until stopped; remembers who answered what."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answered: list[str] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                response = _complete(self.url, f"traffic {n}")
            except httpx.HTTPError:
                self.failed += 1  # the killed worker's connections
                continue
            if response.status_code == 200:
                self.answered.append(rid_of(response))


def test_a_killed_worker_is_restarted_and_the_other_loses_no_record(tmp_path) -> None:
    with SimThread(role="prefill", speed=0) as prefill, SimThread(role="decode", speed=0) as decode:
        process = _start(tmp_path, "trio", prefill, decode)
        try:
            started = {e["worker"]: e["pid"] for e in process.events() if e.get("event") == "worker_started"}
            w0, w1 = tmp_path / "journal.w0.jsonl", tmp_path / "journal.w1.jsonl"
            with _Traffic(process.url) as traffic:
                poll(lambda: len(_terminal_rids(w0)) >= 3 and len(_terminal_rids(w1)) >= 3, timeout=20)
                before = {r["rid"][:10] for r in read_journal(w0)}
                os.kill(started[0], signal.SIGKILL)
                exited = process.wait_for_event("worker_exited", timeout=10)
                assert exited["worker"] == 0 and exited["pid"] == started[0]
                assert exited["status"] == 128 + signal.SIGKILL

                def restarted() -> dict[str, Any] | None:
                    return next((e for e in process.events() if e.get("event") == "worker_started"
                                 and e["worker"] == 0 and e["pid"] != started[0]), None)

                again = poll(restarted, timeout=15)
                # A new process serves as worker 0: records under a new rid prefix in its file.
                poll(lambda: {r["rid"][:10] for r in read_journal(w0)} - before, timeout=20)
            assert again["pid"] != started[0]
            # Every answer worker 1 gave has its terminal record: the kill cost it nothing.
            from_w1 = {r["rid"][:10] for r in read_journal(w1)}
            answered_by_w1 = {rid for rid in traffic.answered if rid[:10] in from_w1}
            assert answered_by_w1 and answered_by_w1 <= _terminal_rids(w1)
            os.kill(process.pid, signal.SIGTERM)
            assert process.wait(START_S) == 0
        finally:
            process.stop()


def test_a_worker_that_cannot_start_stops_the_group(tmp_path) -> None:
    config = tmp_path / "narwhal.toml"
    config.write_text(serve_config(tmp_path / "missing" / "journal.jsonl",
                                   prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"]))
    process = ServeProcess(config, "trio")
    process.args += ["--workers", "2"]
    process.start()
    try:
        assert process.wait(START_S) == 1
        text = process.stderr_text()
        assert "cannot open journal" in text and "journal.w" in text
        assert '"event":"listening"' not in text
    finally:
        process.stop()
