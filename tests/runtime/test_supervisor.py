"""The supervisor's decisions (docs/operate.md, "Workers"), with stand-in workers that start in milliseconds.

The supervisor runs as a real process; its workers are a small script that
behaves like ``narwhal serve`` seen from outside (a ``listening`` log line,
a drain on SIGTERM, an exit status), so signals, restarts and exit statuses
are tested without starting routers (tests/e2e/test_workers.py does that).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from ..helpers import REPO, poll

#: A stand-in worker: ``listening`` on stderr; the first SIGTERM or SIGINT starts a drain of DRAIN_S seconds
#: (``draining``) that ends with exit status EXIT; a second exits 128 + its number at once. CRASH_AFTER_S: exit 7 by itself.
WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    index = int(sys.argv[sys.argv.index("--worker-index") + 1])
    port = int(sys.argv[sys.argv.index("--worker-port") + 1])
    drain_s, exit_status = float(os.environ["DRAIN_S"]), int(os.environ["EXIT"])
    crash = float(os.environ.get("CRASH_AFTER_S", "0"))
    stops = []
    def on_term(signum, frame):
        stops.append(time.monotonic())
        if len(stops) == 1:
            print(json.dumps({"event": "draining"}), file=sys.stderr, flush=True)
        if len(stops) == 2:
            sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    hold = float(os.environ.get("HOLD_S", "0"))
    if hold:  # a busy worker: signals wait, pending, until HOLD_S after the first arrived
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    signal.signal(signal.SIGHUP, lambda signum, frame: print(json.dumps({"event": "keys_reloaded"}),
                                                             file=sys.stderr, flush=True))
    print(json.dumps({"event": "listening", "host": "127.0.0.1", "port": port, "runtime": "stand-in"}),
          file=sys.stderr, flush=True)
    started = time.monotonic()
    while True:
        time.sleep(0.01)
        if hold and signal.sigpending():
            time.sleep(hold)
            hold = 0
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
        if crash and time.monotonic() - started > crash:
            sys.exit(7)
        if stops and time.monotonic() - stops[0] >= drain_s:
            print(json.dumps({"event": "drained"}), file=sys.stderr, flush=True)
            sys.exit(exit_status)
""")

SUPERVISOR = textwrap.dedent("""
    import sys
    from narwhal_core import parse_config
    from narwhal_runtime.supervisor import Supervisor
    config = parse_config(
        '[model]\\nname = "m"\\n[ingress]\\nlisten = "127.0.0.1:0"\\n'
        '[engine]\\ndecode = ["http://127.0.0.1:9"]\\n[journal]\\npath = "j.jsonl"\\n', env={})
    sys.exit(Supervisor("unused.toml", config, runtime="trio", workers=2,
                        command=[sys.executable, sys.argv[1]]).run())
""")


class _Group:
    def __init__(self, tmp_path: Path, **env: str) -> None:
        worker = tmp_path / "worker.py"
        worker.write_text(WORKER)
        self.log = tmp_path / "supervisor.log"
        self._log = self.log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SUPERVISOR, str(worker)], cwd=tmp_path, stdin=subprocess.DEVNULL,
            stderr=self._log, env={**os.environ, "PYTHONPATH": os.fspath(REPO), "DRAIN_S": "0", "EXIT": "0", **env},
        )

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if name is None or event.get("event") == name:
                out.append(event)
        return out

    def wait(self, timeout: float = 20.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
        # A real worker drains when its supervisor dies (it asks the kernel for SIGTERM then); the stand-in
        # does not, and would outlive the test.
        for event in self.events("worker_started"):
            try:
                os.kill(event["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_one_ready_line_once_both_listen_and_a_drain_exits_0(tmp_path: Path) -> None:
    group = _Group(tmp_path)
    try:
        listening = poll(lambda: group.events("listening"), timeout=20)[0]
        assert listening["workers"] == 2 and len(listening["pids"]) == 2
        workers = group.events("worker_listening")
        assert sorted(e["worker"] for e in workers) == [0, 1]
        assert {e["port"] for e in workers} == {listening["port"]} and listening["port"] > 0
        group.proc.send_signal(signal.SIGTERM)
        assert group.wait() == 0
        assert {e["status"] for e in group.events("worker_exited")} == {0}
        assert not group.events("worker_started")[2:], "nobody is restarted while the group stops"
    finally:
        group.close()


def test_a_second_signal_cuts_the_drains_short_and_exits_128_plus_it(tmp_path: Path) -> None:
    # The workers hold their signals pending for 0.5 s after the first arrives, as a busy worker might:
    # forwarded as SIGINT, the second stop cannot merge with the first (two pending SIGTERMs are one), in
    # whatever order the two are then delivered. (Forwarded as SIGTERM, both workers would drain 30 s.)
    group = _Group(tmp_path, DRAIN_S="30", HOLD_S="0.5")
    try:
        poll(lambda: group.events("listening"), timeout=20)
        group.proc.send_signal(signal.SIGTERM)
        poll(lambda: group.events("signal"), timeout=10)
        group.proc.send_signal(signal.SIGTERM)
        assert group.wait() == 128 + signal.SIGTERM
        assert [e["forwarded"] for e in group.events("signal")] == [2, 2]
        statuses = [e["status"] for e in group.events("worker_exited")]
        assert len(statuses) == 2 and set(statuses) <= {128 + signal.SIGINT, 128 + signal.SIGTERM}, statuses
    finally:
        group.close()


def test_a_worker_failing_its_drain_sets_the_exit_status(tmp_path: Path) -> None:
    group = _Group(tmp_path, EXIT="3")
    try:
        poll(lambda: group.events("listening"), timeout=20)
        group.proc.send_signal(signal.SIGTERM)
        assert group.wait() == 3
    finally:
        group.close()


def test_a_worker_that_keeps_dying_is_restarted_with_a_growing_delay(tmp_path: Path) -> None:
    group = _Group(tmp_path, CRASH_AFTER_S="0.05")
    try:
        poll(lambda: len([e for e in group.events("worker_started") if e["worker"] == 0]) >= 4, timeout=20)
        exits = [e for e in group.events("worker_exited") if e["worker"] == 0]
        starts = [e for e in group.events("worker_started") if e["worker"] == 0]
        assert exits[0]["status"] == 7 and exits[0]["level"] == "error"
        delays = [start["ts"] - exit_["ts"] for exit_, start in zip(exits, starts[1:])]
        assert 0.2 <= delays[0] < delays[1] < delays[2], delays  # 0.25 s, 0.5 s, 1 s
        assert len({e["pid"] for e in starts}) == len(starts)
        group.proc.send_signal(signal.SIGTERM)
        # 0, or 7 when a worker crashed again while the group stopped; one still starting (no handler
        # yet) dies of the SIGTERM itself, which is no failure.
        assert group.wait() in (0, 7)
    finally:
        group.close()


def test_sighup_is_forwarded_to_every_worker(tmp_path: Path) -> None:
    group = _Group(tmp_path)
    try:
        poll(lambda: group.events("listening"), timeout=20)
        group.proc.send_signal(signal.SIGHUP)
        hup = poll(lambda: [e for e in group.events("signal") if e["signal"] == "SIGHUP"], timeout=10)[0]
        assert hup["forwarded"] == 2
        poll(lambda: sorted(e["worker"] for e in group.events("keys_reloaded")) == [0, 1], timeout=10)
        assert not group.events("worker_exited")
    finally:
        group.close()
