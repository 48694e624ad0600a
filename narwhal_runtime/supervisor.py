"""``narwhal serve --workers N``: one supervisor, N worker processes on one port (docs/operate.md, "Workers").

Each worker is ``narwhal serve`` itself, started again with hidden flags
(its index, the group's port, the metrics directory): a whole process of its
own, so its signals, drain and exit status are exactly those of a single
``narwhal serve`` (:class:`narwhal_runtime.app.Run`). The supervisor imports
no adapter; it

* reserves the port (:func:`narwhal_runtime.listening.reserve_port`: port 0
  becomes one port for the whole group) and makes the metrics directory
  (:mod:`narwhal_runtime.group_metrics`);
* starts the workers, each in a process group of its own (a Ctrl-C at the
  terminal reaches the supervisor only, which forwards it once);
* relays their log lines to its standard error with ``"worker": K`` added,
  renaming each worker's ``listening`` to ``worker_listening``, and prints
  its own ``listening`` line once every worker listens;
* restarts a worker that exits while the group serves, after a backoff
  (``worker_exited`` with its status, then ``worker_started``); a worker that
  fails before the group was ever ready stops the group (start-up failure);
* forwards SIGHUP (key reload) and SIGTERM/SIGINT (drain; a second cuts the
  drains short, exit status 128 + its number), waits for every worker and
  exits: 0 after a clean drain, else the first failing worker's status.
  Each stop is forwarded as the other stop signal than the one before it
  (SIGTERM, then SIGINT, ...): a worker counts both alike, and two pending
  signals of one kind are one for the kernel, so a second SIGTERM forwarded
  before a busy worker ran its handler for the first would be lost.

Worker threads only read pipes and wait for exits; every decision is taken
on the main thread, from one queue (signal handlers put to it: a
``SimpleQueue``'s ``put`` is safe there).
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

import orjson

from narwhal_core import Config

from .app import STOPPED_BY_SIGNAL, listen_failure
from .listening import reserve_port
from .log import log_event
from .workers import worker_config

__all__ = ["Supervisor", "BACKOFF_BASE_S", "BACKOFF_MAX_S", "STEADY_S"]

#: Delay before restarting a worker that died; doubles while restarts come quickly.
BACKOFF_BASE_S = 0.25
#: Longest delay before a restart.
BACKOFF_MAX_S = 8.0
#: A worker that served this long before dying is restarted after the base delay again.
STEADY_S = 10.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def exit_status(returncode: int) -> int:
    """A child's exit status as a shell shows it: killed by a signal is 128 + its number."""
    return STOPPED_BY_SIGNAL - returncode if returncode < 0 else returncode


class _Worker:
    """One worker slot: its current process, when it started, its restart backoff."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen[bytes] | None = None
        self.generation = 0
        self.started_at = 0.0
        self.listening = False
        self.backoff = BACKOFF_BASE_S
        self.restart_at: float | None = None


class Supervisor:
    """Runs the group until it has drained; :meth:`run` returns the exit status."""

    def __init__(self, config_path: str, config: Config, *, runtime: str, workers: int,
                 command: Sequence[str] | None = None) -> None:
        self.config_path = config_path
        self.config = config
        self.runtime = runtime
        self.count = workers
        #: How a worker is started (``narwhal serve`` with the worker flags appended).
        self.command = list(command) if command is not None else [sys.executable, "-m", "narwhal"]
        self._events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._workers = [_Worker(k) for k in range(workers)]
        self._stops = 0
        #: The stop signals forwarded so far, in order (:meth:`_stop_signal_to_forward`).
        self._forwarded_stops: list[int] = []
        self._status = 0
        self._failure: int | None = None
        self._ready = False
        self.port = 0
        self._metrics_dir = ""

    def run(self) -> int:
        """Reserve the port, start the workers, supervise them until the group stopped."""
        worker_config(self.config, index=0, workers=self.count, port=0)  # a ConfigError before anything starts
        ingress = self.config.ingress
        try:
            reserved, self.port = reserve_port(ingress.listen_host, ingress.listen_port)
        except OSError as exc:
            print(f"narwhal: {listen_failure(ingress.listen, exc)}", file=sys.stderr)
            return 1
        self._metrics_dir = tempfile.mkdtemp(prefix="narwhal-metrics-")
        previous = {sig: signal.signal(sig, self._on_signal) for sig in _SIGNALS}
        try:
            for worker in self._workers:
                self._start(worker)
            self._supervise()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for sock in reserved:
                sock.close()
            shutil.rmtree(self._metrics_dir, ignore_errors=True)
        log_event("stopped", workers=self.count)
        if self._failure is not None:
            return self._failure
        return self._status

    # -- the main loop

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._events.put(("signal", signum))

    def _supervise(self) -> None:
        while any(w.proc is not None for w in self._workers) or self._restart_due() is not None:
            due = self._restart_due()
            timeout = 0.5 if due is None else max(0.0, min(0.5, due - time.monotonic()))
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                event = None
            if event is not None:
                self._handle(event)
            now = time.monotonic()
            for worker in self._workers:
                if worker.restart_at is not None and worker.restart_at <= now:
                    worker.restart_at = None
                    self._start(worker)

    def _restart_due(self) -> float | None:
        times = [w.restart_at for w in self._workers if w.restart_at is not None]
        return min(times) if times else None

    def _handle(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "signal":
            self._signal(event[1])
            return
        worker = self._workers[event[1]]
        if event[2] != worker.generation:
            return  # about a process already replaced
        if kind == "line":
            self._relay(worker, event[3])
        elif kind == "exit":
            self._exited(worker, event[3])

    def _signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            log_event("signal", signal=name, forwarded=self._forward(signum))
            return
        self._stops += 1
        if self._stops == 2:
            self._status = STOPPED_BY_SIGNAL + signum
        for worker in self._workers:
            worker.restart_at = None  # a stopping group restarts nobody
        log_event("signal", signal=name, forwarded=self._forward(self._stop_signal_to_forward(signum)))

    def _stop_signal_to_forward(self, signum: int) -> int:
        """``signum``, or the other stop signal if the last one forwarded was ``signum`` (module docstring)."""
        forwarded = self._forwarded_stops
        if forwarded and forwarded[-1] == signum:
            signum = signal.SIGINT if signum == signal.SIGTERM else signal.SIGTERM
        forwarded.append(signum)
        return signum

    def _forward(self, signum: int) -> int:
        sent = 0
        for worker in self._workers:
            if worker.proc is not None and worker.proc.poll() is None:
                try:
                    worker.proc.send_signal(signum)
                    sent += 1
                except OSError:
                    pass  # it has just exited: its exit event is on its way
        return sent

    # -- workers

    def _start(self, worker: _Worker) -> None:
        worker.generation += 1
        worker.listening = False
        worker.started_at = time.monotonic()
        argv = [
            *self.command, "serve", "--config", self.config_path, "--runtime", self.runtime,
            "--workers", str(self.count), "--worker-index", str(worker.index),
            "--worker-port", str(self.port), "--worker-metrics-dir", self._metrics_dir,
            "--supervisor-pid", str(os.getpid()),
        ]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, process_group=0)
        worker.proc = proc
        log_event("worker_started", worker=worker.index, pid=proc.pid)
        threading.Thread(
            target=self._pump, args=(worker.index, worker.generation, proc),
            name=f"narwhal-worker-{worker.index}", daemon=True,
        ).start()

    def _pump(self, index: int, generation: int, proc: subprocess.Popen[bytes]) -> None:
        stream: IO[bytes] | None = proc.stderr
        assert stream is not None
        with stream:
            for line in stream:
                self._events.put(("line", index, generation, line))
        self._events.put(("exit", index, generation, proc.wait()))

    def _relay(self, worker: _Worker, line: bytes) -> None:
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError:
            value = None
        if not isinstance(value, dict) or "event" not in value:
            _write(line if line.endswith(b"\n") else line + b"\n")  # a traceback, a start-up failure line
            return
        value["worker"] = worker.index
        if value["event"] == "listening":
            value["event"] = "worker_listening"
            value["pid"] = worker.proc.pid if worker.proc is not None else None
            worker.listening = True
        _write(orjson.dumps(value) + b"\n")
        if worker.listening and not self._ready and all(w.listening for w in self._workers):
            self._ready = True
            self._announce(value)

    def _announce(self, worker_line: dict[str, Any]) -> None:
        """The group's ``listening`` line: every worker listens."""
        fields = {k: v for k, v in worker_line.items() if k not in ("ts", "level", "event", "worker", "pid")}
        pids = [w.proc.pid for w in self._workers if w.proc is not None]
        log_event("listening", **{**fields, "journal": self.config.journal.path, "workers": self.count, "pids": pids})

    def _exited(self, worker: _Worker, returncode: int) -> None:
        status = exit_status(returncode)
        pid = worker.proc.pid if worker.proc is not None else None
        uptime = time.monotonic() - worker.started_at
        worker.proc = None
        log_event("worker_exited", level="info" if self._stops else "error",
                  worker=worker.index, pid=pid, status=status, uptime_s=round(uptime, 3))
        if self._stops:
            # A worker still starting when the signal came had no handler yet and nothing to drain.
            killed_starting = not worker.listening and status - STOPPED_BY_SIGNAL in self._forwarded_stops
            if status != 0 and not killed_starting and self._failure is None and self._status == 0:
                self._failure = status
            return
        if not self._ready and not worker.listening:
            # A worker that cannot start (journal, port, config): the others would fail alike.
            self._failure = status or 1
            self._stops = 1
            self._forward(self._stop_signal_to_forward(signal.SIGTERM))
            for other in self._workers:
                other.restart_at = None
            return
        if uptime >= STEADY_S:
            worker.backoff = BACKOFF_BASE_S
        worker.restart_at = time.monotonic() + worker.backoff
        worker.backoff = min(worker.backoff * 2, BACKOFF_MAX_S)


def _write(line: bytes) -> None:
    try:
        sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()
    except (OSError, ValueError):
        pass
