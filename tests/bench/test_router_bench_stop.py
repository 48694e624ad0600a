"""``router_bench.py`` stops every process it started when it is told to stop, even told twice.

``timeout`` passes a SIGTERM on to the benchmark while whoever stopped it
may send its own: the second one used to interrupt the clean-up, and the
engines (started last, stopped last) were left running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

#: A child that takes a second to stop on SIGTERM: the window for the second signal.
SLOW_TO_STOP = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.0), sys.exit(0)))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)

#: The benchmark's way of running: two processes started, then stopped in its ``finally``.
BENCH = (
    "import sys, time\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "import router_bench\n"
    "from pathlib import Path\n"
    "procs = [router_bench.Proc(name, [sys.executable, '-c', sys.argv[2]], None, Path(sys.argv[3]))\n"
    "         for name in ('engine', 'router')]\n"
    "print(*(p.pid for p in procs), flush=True)\n"
    "router_bench.exit_on_sigterm()\n"
    "try:\n"
    "    time.sleep(60)\n"
    "finally:\n"
    "    router_bench.Proc.stop_all()\n"
)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_a_second_sigterm_does_not_leave_the_engines_running(tmp_path: Path) -> None:
    bench = subprocess.Popen([sys.executable, "-c", BENCH, str(BENCHMARKS), SLOW_TO_STOP, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True)
    assert bench.stdout is not None
    pids = [int(pid) for pid in bench.stdout.readline().split()]
    try:
        deadline = time.monotonic() + 10
        while not all("ready" in (tmp_path / f"{name}.log").read_text() for name in ("engine", "router")):
            assert time.monotonic() < deadline, "the children never started"
            time.sleep(0.02)
        bench.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # it is stopping the router (started last), which takes a second
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(15) == 143
        deadline = time.monotonic() + 5
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in pids if _running(pid)] == []
    finally:
        bench.kill()
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
