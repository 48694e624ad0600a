"""Side-by-side router benchmark: Narwhal (trio, asyncio) against vllm-router and sglang-router.

One command, bounded in time, 127.0.0.1 only::

    . .venv/bin/activate
    python benchmarks/router_bench.py            # full: 3 runs x 5 s windows (~6 min on a quiet machine)
    python benchmarks/router_bench.py --quick    # 1 run x 2 s windows (~1 min)
    python benchmarks/router_bench.py --scenario slow-streams   # 10,000 slow streams through Narwhal: RSS (~8 min)
    python benchmarks/router_bench.py --scenario paired --baseline DIR   # this tree / DIR in interleaved pairs (~7 min)

What it starts (every listener on 127.0.0.1):

* two instant engines (``benchmarks/instant_engine.py``: a prefill and a
  decode engine speaking vLLM's NIXL and SGLang's bootstrap PD protocols;
  ``--engine sim`` uses ``python -m narwhal_sim --speed 0`` instead), pinned
  to the load core;
* the targets, each pinned to the router core: ``direct`` (the load
  generator calls the decode engine itself: the baseline), ``narwhal-trio``
  and ``narwhal-asyncio`` (``narwhal serve --runtime ...``), ``vllm-router``
  (``--vllm-pd-disaggregation --policy round_robin``) and ``sglang-router``
  (``launch --pd-disaggregation --policy round_robin``); on request
  (``--targets``), ``narwhal-trio-pure`` / ``narwhal-asyncio-pure`` (the
  core's pure Python sources) and ``narwhal-trio-poll`` /
  ``narwhal-asyncio-poll`` (``ingress.busy_poll_us = 200``), ``narwhal-trio-traced`` /
  ``narwhal-asyncio-traced`` (``[tracing] endpoint`` set: spans exported to a sink in
  this process; ``-traced10``: the same at ``tracing.sample_ratio = 0.1``). The peers come from
  PyPI into a separate venv, ``benchmarks/.peers-venv``, created on first use
  (never into the project's dependencies). A target that fails to start,
  to answer, or to do PD is reported as such in the table, and the others go on;
* the load generator, ``wrk`` (Debian's, ``/usr/bin/wrk``) with
  ``benchmarks/wrk/post_json.lua``, pinned to the load core.

Scenarios (each a wrk window per target, the targets in a rotated order per
run, after a warm-up window):

* ``pd-c1``  non-streaming completion through the PD legs, concurrency 1, 16 tokens, ~1 KB body;
* ``pd-c32`` the same at concurrency 32;
* ``stream`` a streamed completion of 256 tokens (257 SSE events with ``[DONE]``), concurrency 8;
* on request (``--scenarios``): ``pd-48k``, the ``pd-c32`` request with a
  ~48 KB prompt, and ``pd-48k-chat``, a chat request of the same size (a
  long system prompt, a short exchange, and a last user message), both at
  concurrency 32. Every request is a different body
  (``benchmarks/wrk/post_prompts.lua``): one of a few 40 KB beginnings taken
  in turn, then a number unique to the request and 8 KB more, so a
  prefix-aware router finds most of each prompt already sent to an engine
  and adds the rest as new.

A target may name its routing policy after ``@``: ``narwhal-trio@prefix``
writes ``[routing] policy = "prefix"`` into that Narwhal's config;
``vllm-router@cache_aware`` starts vllm-router with ``--policy
cache_aware`` (in PD mode the prefill and the decode policy both follow
it), and ``vllm-router@cache_aware/power_of_two`` with ``--prefill-policy
cache_aware --decode-policy power_of_two`` (sglang-router alike). Without
``@`` a target runs as before: Narwhal's default policy, the peers'
``round_robin``. With a long-prompt scenario the report adds the routing
cost of each ``@prefix`` Narwhal against the same runtime's
``least_loaded`` and vllm-router's ``cache_aware``, and the share of each
prompt the prefix index found on the engine chosen (from the journal).

Per target and scenario: requests/s, p50/p99 latency (wrk, per request),
added p50/p99 against ``direct`` in the same run, the router's CPU time per
request (``/proc/<pid>/stat`` utime+stime, all threads, children excluded,
read just before and just after the load window), CPU per relayed SSE event
for streams, and how busy the router core and the load core were. Each figure is the median
over ``--runs`` runs. Then the ratios of Narwhal's CPU per request and added
p50 to each peer's, the issue's targets, and each router's RSS.

``--scenario slow-streams`` opens ``--streams`` (10,000) concurrent streams
through Narwhal (engine pacing ``--token-interval-ms`` per token) from an
asyncio client in this process, and reports the router's RSS with 0, 25 %,
50 % and 100 % of them open and after they finish, twice (``--rounds``)
through the same router process. The router needs two descriptors per
stream: below a hard ``RLIMIT_NOFILE`` of 2 x streams + 500 (20,000 on the
project's machines, not raisable without CAP_SYS_RESOURCE) the count is
capped, and the report says so.

On a shared machine each window is measured again (``--retries``) when
other processes took more than ``--max-other`` % of a core it used; the
``other%`` column shows how disturbed the kept window was.

``--scenario paired`` (``benchmarks/paired_ab.py``) compares this tree's
Narwhal with ``--baseline``'s in pairs of short windows back to back, and
gives the median ratio of router CPU per request with a 95 % interval.

``--profile TARGET`` adds one py-spy window (pd-c32, or ``--profile-scenario``) on a Narwhal target
and prints where its time goes (py-spy from the peers venv; the SVG is kept
in the work directory).

Everything a run writes (configs, bodies, process logs, journals, the JSON
results) goes to a fresh directory under /tmp, printed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import random
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from narwhal_build import PURE_ENV, core_build  # noqa: E402
PEERS_VENV = HERE / ".peers-venv"
#: The peers and the profiler, pinned so a rerun measures the same code.
PEER_PACKAGES = ("vllm-router==0.1.17", "sglang-router==0.3.2", "py-spy==0.4.3")
WRK_SCRIPT = HERE / "wrk" / "post_json.lua"
#: The long-prompt scenarios' wrk script: a different body per request, from a spec file.
PROMPTS_SCRIPT = HERE / "wrk" / "post_prompts.lua"
INSTANT_ENGINE = HERE / "instant_engine.py"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROMPT = "Narwhals are medium-sized toothed whales that live year-round in the Arctic. " * 11  # ~850 chars
ALL_TARGETS = ("direct", "narwhal-trio", "narwhal-asyncio", "vllm-router", "sglang-router")
#: Also measurable, not run by default: Narwhal with its core as pure Python
#: (``NARWHAL_PURE_PYTHON=1``) beside the compiled build the install made.
PURE_TARGETS = ("narwhal-trio-pure", "narwhal-asyncio-pure")
#: Also measurable, not run by default: Narwhal with ``ingress.busy_poll_us``
#: set to :data:`BUSY_POLL_US` (the event loop polls instead of sleeping for
#: that long after each event: lower latency at low load, for CPU).
POLL_TARGETS = ("narwhal-trio-poll", "narwhal-asyncio-poll")
BUSY_POLL_US = 200
#: Also measurable, with ``--baseline DIR``: Narwhal from another source tree
#: (a checkout of an earlier commit with its core built in place, ``python
#: setup.py build_ext --inplace``), for an A/B of two versions in one run.
BASE_TARGETS = ("narwhal-trio-base", "narwhal-asyncio-base")
#: Also measurable, not run by default: Narwhal with ``[tracing] endpoint`` set, exporting every
#: request's spans (wrk sends no traceparent: each request gets a trace of Narwhal's own) to a
#: sink in this process that takes OTLP/HTTP posts and drops them (:func:`trace_sink`).
TRACED_TARGETS = ("narwhal-trio-traced", "narwhal-asyncio-traced", "narwhal-trio-traced10", "narwhal-asyncio-traced10")
#: ``tracing.sample_ratio`` of the ``-traced10`` targets: one trace in ten exported.
TRACED10_RATIO = 0.1
KNOWN_TARGETS = ALL_TARGETS + PURE_TARGETS + POLL_TARGETS + BASE_TARGETS + TRACED_TARGETS
PEERS = ("vllm-router", "sglang-router")
#: ``--baseline``: where the ``-base`` targets import Narwhal from (set once by ``main``).
BASELINE_TREE = ""
SCENARIOS = {
    # name: (stream, concurrency, max_tokens, label)
    "pd-c1": (False, 1, 16, "non-stream PD, c=1"),
    "pd-c32": (False, 32, 16, "non-stream PD, c=32"),
    "stream": (True, 8, 256, "stream 256 tok, c=8"),
    "pd-48k": (False, 32, 16, "48 KB prompt PD, c=32"),
    "pd-48k-chat": (False, 32, 16, "48 KB chat PD, c=32"),
}
#: What runs without ``--scenarios``.
DEFAULT_SCENARIOS = ("pd-c1", "pd-c32", "stream")
#: The long-prompt scenarios and their path: each request's body is built by
#: :data:`PROMPTS_SCRIPT` from :func:`long_prompt_spec`.
LONG_PROMPTS = {"pd-48k": "/v1/completions", "pd-48k-chat": "/v1/chat/completions"}
#: A long prompt: one of LONG_PREFIXES shared beginnings of LONG_SHARED bytes, then its own LONG_TAIL bytes.
LONG_PREFIXES = 4
LONG_SHARED = 40 * 1024
LONG_TAIL = 8 * 1024
#: Narwhal's ``routing.policy`` values, and the peers' ``--policy`` choices (``vllm-router --help``, 0.1.17).
NARWHAL_POLICIES = ("least_loaded", "round_robin", "prefix")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- processes


class Proc:
    """A child process pinned to a core, with its output in a log file."""

    registry: list[Proc] = []
    #: nice value for every child (``--nice``): the machine may be shared with other work
    nice = 0

    def __init__(self, name: str, cmd: list[str], core: int | None, logdir: Path, env: dict[str, str] | None = None,
                 stdout_pipe: bool = False) -> None:  # fmt: skip
        self.name = name
        self.cmd = cmd
        self.core = core
        self.log_path = logdir / f"{name.replace('/', '+')}.log"  # a target's policy may hold a slash
        self._log = open(self.log_path, "wb")

        nice = Proc.nice

        def pin() -> None:
            if core is not None:
                os.sched_setaffinity(0, {core})
            if nice:
                os.setpriority(os.PRIO_PROCESS, 0, nice)
            os.setpgrp()  # so a signal to our terminal's group does not hit it before we stop it cleanly

        self.popen = subprocess.Popen(
            cmd, stdout=subprocess.PIPE if stdout_pipe else self._log, stderr=self._log,
            stdin=subprocess.DEVNULL, env=env, preexec_fn=pin, cwd=str(logdir),
        )  # fmt: skip
        Proc.registry.append(self)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 5) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        clean = [_strip_ansi(line)[:300] for line in lines[-n:]]
        return " | ".join(clean)

    def stop(self, timeout: float = 10.0) -> None:
        if self.alive():
            try:
                self.popen.send_signal(signal.SIGTERM)
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._log.close()

    @classmethod
    def stop_all(cls) -> None:
        for proc in reversed(cls.registry):
            try:
                proc.stop()
            except Exception:  # noqa: BLE001 - cleanup must go on
                pass
        cls.registry.clear()


def exit_on_sigterm() -> None:
    """On SIGTERM exit with status 143, the ``finally`` of :func:`main` stopping every process started.

    Later SIGTERMs are ignored: a second one (``timeout`` passing one on
    beside the sender's own) must not cut :meth:`Proc.stop_all` short, or
    the engines are left running.
    """

    def on_term(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_term)


def _strip_ansi(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        if text[i] == "\x1b":
            j = i + 1
            while j < len(text) and not text[j].isalpha():
                j += 1
            i = j + 1
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


def io_calls(pid: int) -> tuple[int, int]:
    """A process's read and write system calls so far (``/proc/PID/io``: syscr, syscw)."""
    try:
        with open(f"/proc/{pid}/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines() if ": " in line)
        return int(fields["syscr"]), int(fields["syscw"])
    except (OSError, KeyError, ValueError):
        return 0, 0


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads, children excluded), in seconds."""
    return sum(cpu_split(pid))


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of a process and of its live children (``narwhal serve --workers N``: the workers)."""
    total = cpu_seconds(pid)
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            continue
        for child in children:
            try:
                total += tree_cpu_seconds(child)
            except OSError:
                pass  # (it ended meanwhile)
    return total


def cpu_split(pid: int) -> tuple[float, float]:
    """utime and stime of a process (all its threads, children excluded), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def core_busy(cores: list[int | None]) -> dict[int, float]:
    """Busy seconds so far of each named core, from /proc/stat: user + nice + system + steal.

    Interrupt and softirq time are left out: loopback packets are processed
    there, for our own processes as much as for others.
    """
    out: dict[int, float] = {}
    want = {c for c in cores if c is not None}
    with open("/proc/stat") as f:
        for line in f:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *vals = line.split()
            core = int(name[3:])
            if core in want:
                v = [int(x) for x in vals]
                out[core] = (v[0] + v[1] + v[2] + v[7]) / CLK_TCK
    return out


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in KiB."""
    rss = hwm = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    return rss, hwm


def listening_addresses(pid: int) -> list[str]:
    """Addresses ``pid`` listens on (TCP), from /proc: to check everything binds 127.0.0.1."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return []
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A = LISTEN
                continue
            hexaddr, hexport = cols[1].split(":")
            if v6:
                raw = bytes.fromhex(hexaddr)
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                host = socket.inet_ntop(socket.AF_INET6, words)
            else:
                host = socket.inet_ntoa(bytes.fromhex(hexaddr)[::-1])
            found.append(f"{host}:{int(hexport, 16)}")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(method: str, url: str, body: bytes | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# ---------------------------------------------------------------------------- setup


def ensure_peers(log_dir: Path) -> tuple[Path | None, str]:
    """The peers venv's bin directory, creating it on first use; or (None, why not)."""
    bin_dir = PEERS_VENV / "bin"
    if all((bin_dir / exe).exists() for exe in ("vllm-router", "sglang-router", "py-spy")):
        return bin_dir, ""
    log(f"creating {PEERS_VENV.relative_to(REPO)} and installing {' '.join(PEER_PACKAGES)} (first use only)")
    try:
        if not (bin_dir / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True, timeout=300,
                           capture_output=True)  # fmt: skip
        # keep the venv out of git whatever the repository's .gitignore says
        (PEERS_VENV / ".gitignore").write_text("*\n")
        with open(log_dir / "peers-install.log", "wb") as out:
            subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", *PEER_PACKAGES],
                           check=True, timeout=900, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        return None, f"could not install the peers ({exc}); see {log_dir / 'peers-install.log'}"
    return bin_dir, ""


def start_engine(kind: str, role: str, core: int | None, logdir: Path, token_interval_ms: float = 0.0) -> tuple[Proc, dict[str, Any]]:  # fmt: skip
    if kind == "instant":
        cmd = [sys.executable, str(INSTANT_ENGINE), "--role", role, "--listen", "127.0.0.1:0",
               "--token-interval-ms", repr(token_interval_ms)]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "narwhal_sim", "--role", role, "--listen", "127.0.0.1:0", "--speed", "0",
               "--log", "none"]  # fmt: skip
    proc = Proc(f"engine-{role}", cmd, core, logdir, stdout_pipe=True)
    assert proc.popen.stdout is not None
    deadline = time.monotonic() + 20
    line = b""
    os.set_blocking(proc.popen.stdout.fileno(), False)
    while time.monotonic() < deadline and proc.alive():
        try:
            line = proc.popen.stdout.readline()
        except BlockingIOError:
            line = b""
        if line:
            break
        time.sleep(0.02)
    if not line:
        raise SystemExit(f"router_bench: the {role} engine did not start: {proc.tail()}")
    info = json.loads(line)
    return proc, info


def narwhal_config(path: Path, port: int, prefill: str, decode: str, journal: Path,
                   extra: dict[str, dict[str, Any]] | None = None) -> None:  # fmt: skip
    """Narwhal's config: the shipped defaults but for the addresses (and ``extra`` keys per section)."""
    sections: dict[str, dict[str, Any]] = {
        "model": {"name": MODEL},
        "ingress": {"listen": f"127.0.0.1:{port}"},
        "engine": {"prefill": [prefill], "decode": [decode]},
        "journal": {"path": str(journal)},
    }
    for section, keys in (extra or {}).items():
        sections.setdefault(section, {}).update(keys)
    text = []
    for section, keys in sections.items():
        text.append(f"[{section}]")
        text.extend(f"{k} = {json.dumps(v)}" for k, v in keys.items())
        text.append("")
    path.write_text("\n".join(text))


_TRACE_SINK: list[str] = []


def trace_sink() -> str:
    """The URL of an OTLP/HTTP sink on 127.0.0.1 (started once): 200 to every POST, its body read and dropped."""
    if not _TRACE_SINK:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Sink(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - the http.server name
                self.rfile.read(int(self.headers.get("content-length", "0")))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        _TRACE_SINK.append(f"http://127.0.0.1:{server.server_address[1]}")
    return _TRACE_SINK[0]


# ---------------------------------------------------------------------------- long prompts

#: Words of the long prompts: ASCII without quotes or backslashes, so a prompt is its own JSON string.
_VOCAB = tuple(
    "the a sea ice whale narwhal tusk arctic water winter dive hunt fish deep cold light pod calf migrate "
    "coast fjord current surface breath sound echo signal ocean depth pressure season summer research "
    "survey sample record measure report table figure result method data model estimate population "
    "range habitat north south east west under over near far long short slow fast bright dark is are "
    "was were has have swims dives feeds rests travels returns follows leads sings listens".split()
)


def _prose(seed: int, size: int) -> str:
    """``size`` bytes of sentences from :data:`_VOCAB`, the same for the same seed."""
    rng = random.Random(seed)
    sentences: list[str] = []
    n = 0
    while n < size:
        sentence = " ".join(rng.choice(_VOCAB) for _ in range(rng.randint(6, 16))).capitalize() + "."
        sentences.append(sentence)
        n += len(sentence) + 1
    return " ".join(sentences)[:size]


def long_prompt_spec(scen: str) -> tuple[str, bytes]:
    """A long-prompt scenario's spec for :data:`PROMPTS_SCRIPT`, and its request 0's body (to validate).

    :data:`LONG_PREFIXES` shared beginnings of :data:`LONG_SHARED` bytes of
    prompt (a completion's prompt; a chat's system prompt, a user message and
    an assistant answer), then the request's number and :data:`LONG_TAIL`
    bytes: what follows the number is new to any cache, so every request
    both hits (its beginning) and adds (its end).
    """
    path = LONG_PROMPTS[scen]
    fields = json.dumps({"model": MODEL, "max_tokens": 16, "temperature": 0.7, "top_p": 0.95, "user": "bench"})
    fields = fields[:-1]  # the closing brace comes with the end
    tail = ": " + _prose(10_000, LONG_TAIL)
    heads = []
    if path == "/v1/completions":
        for k in range(LONG_PREFIXES):
            heads.append(f'{fields}, "prompt": "[Document {k}] {_prose(k, LONG_SHARED)} Request ')
        end = '"}'
    else:
        for k in range(LONG_PREFIXES):
            messages = [
                {"role": "system", "content": f"[Assistant {k}] {_prose(k, LONG_SHARED - 4096)}"},
                {"role": "user", "content": _prose(100 + k, 2048)},
                {"role": "assistant", "content": _prose(200 + k, 2048)},
            ]  # fmt: skip
            heads.append(f'{fields}, "messages": {json.dumps(messages)[:-1]}, {{"role": "user", "content": "Question ')
        end = '"}]}'
    sample = (heads[0] + "0" + tail + end).encode()
    json.loads(sample)  # the pieces make valid JSON
    lines = [f"P {path}", *(f"H {h}" for h in heads), f"T {tail}", f"E {end}"]
    return "\n".join(lines) + "\n", sample


def target_parts(name: str) -> tuple[str, str]:
    """A target's name without its ``@policy``, and that policy (empty when none is named)."""
    base, _, policy = name.partition("@")
    return base, policy


def peer_policy_args(policy: str) -> list[str]:
    """A peer's policy flags: ``--policy P``, or per phase for ``PREFILL/DECODE``; round_robin by default."""
    if not policy:
        return ["--policy", "round_robin"]
    prefill, _, decode = policy.partition("/")
    if not decode:
        return ["--policy", prefill]
    return ["--policy", prefill, "--prefill-policy", prefill, "--decode-policy", decode]


class Target:
    def __init__(self, name: str) -> None:
        self.name = name
        self.base, self.policy = target_parts(name)
        #: Narwhal's journal (the prefix index's hits are read from its ``routing`` records).
        self.journal: Path | None = None
        self.proc: Proc | None = None
        self.url = ""
        self.error: str | None = None
        self.chunks: int | None = None  # SSE events per validated stream
        self.rss: tuple[int, int] | None = None
        self.rss_start: int | None = None
        #: scenario -> why it could not be measured (the target goes on with the other scenarios)
        self.scen_errors: dict[str, str] = {}


def start_target(name: str, core: int | None, work: Path, engines: dict[str, dict[str, Any]],
                 peers_bin: Path | None, peers_error: str,
                 narwhal_extra: dict[str, dict[str, Any]] | None = None) -> Target:  # fmt: skip
    t = Target(name)
    prefill, decode = engines["prefill"]["url"], engines["decode"]["url"]
    if name == "direct":
        t.url = decode
        return t
    port = free_port()
    t.url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    base, policy = t.base, t.policy
    if base.startswith("narwhal-"):
        runtime = base.split("-")[1]
        env[PURE_ENV] = "1" if base.endswith("-pure") else ""
        if base.endswith("-base"):
            if not BASELINE_TREE:
                t.error = "no --baseline tree given"
                return t
            env["PYTHONPATH"] = BASELINE_TREE
        cfg = work / f"{name}.toml"
        extra = {section: dict(keys) for section, keys in (narwhal_extra or {}).items()}
        if base.endswith("-poll"):
            extra.setdefault("ingress", {})["busy_poll_us"] = BUSY_POLL_US
        if name.endswith(("-traced", "-traced10")):
            extra.setdefault("tracing", {})["endpoint"] = trace_sink()  # type: ignore[assignment]
        if name.endswith("-traced10"):
            extra["tracing"]["sample_ratio"] = TRACED10_RATIO  # type: ignore[assignment]
        if policy:
            extra.setdefault("routing", {})["policy"] = policy
        t.journal = work / f"{name}-journal.jsonl"
        narwhal_config(cfg, port, prefill, decode, t.journal, extra)
        cmd = [sys.executable, "-m", "narwhal.cli", "serve", "--config", str(cfg), "--runtime", runtime]
    elif base in PEERS:
        if peers_bin is None:
            t.error = peers_error or "peers not installed"
            return t
        prom = str(free_port())
        if base == "vllm-router":
            cmd = [str(peers_bin / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
                   "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
                   *peer_policy_args(policy), "--prometheus-host", "127.0.0.1", "--prometheus-port", prom]  # fmt: skip
        else:
            cmd = [str(peers_bin / "sglang-router"), "launch", "--host", "127.0.0.1", "--port", str(port),
                   "--pd-disaggregation", "--prefill", prefill, "none", "--decode", decode,
                   *peer_policy_args(policy), "--prometheus-host", "127.0.0.1", "--prometheus-port", prom]  # fmt: skip
    else:
        raise ValueError(name)
    env["NO_COLOR"] = "1"
    t.proc = Proc(name, cmd, core, work, env=env)
    return t


def wait_ready(t: Target, timeout: float) -> None:
    """Wait until ``t`` answers a completion (or mark it failed)."""
    if t.error is not None or t.proc is None:
        return
    deadline = time.monotonic() + timeout
    body = json.dumps({"model": MODEL, "prompt": "ready?", "max_tokens": 1}).encode()
    last = ""
    while time.monotonic() < deadline:
        if not t.proc.alive():
            t.error = f"exited with {t.proc.popen.returncode} at start: {t.proc.tail(3)}"
            return
        try:
            status, data = http("POST", t.url + "/v1/completions", body, timeout=2)
            if status == 200:
                break
            last = f"answered {status}: {data[:200]!r}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.2)
    else:
        t.error = f"not ready in {timeout:.0f} s ({last}); log: {t.proc.tail(3)}"
        return
    bad = [a for a in listening_addresses(t.proc.pid) if not a.startswith("127.")]
    if bad:
        t.error = f"listens on non-loopback {bad}: stopped"
        t.proc.stop()


def engine_stats(engines: dict[str, dict[str, Any]], kind: str) -> dict[str, int]:
    out: dict[str, int] = collections.Counter()
    for role in ("prefill", "decode"):
        path = "/instant/stats" if kind == "instant" else "/sim/stats"
        _, data = http("GET", engines[role]["url"] + path)
        for k, v in json.loads(data).items():
            if isinstance(v, int):
                out[f"{role}.{k}"] += v
    return out


def validate(t: Target, engines: dict[str, dict[str, Any]], kind: str, bodies: dict[str, bytes],
             scenarios: list[str]) -> None:  # fmt: skip
    """One request per scenario run: the answer is whole and, through a router, both PD legs ran."""
    if t.error is not None:
        return
    for scen in scenarios:
        stream, _, max_tokens, _ = SCENARIOS[scen]
        before = engine_stats(engines, kind)
        try:
            status, data = http("POST", t.url + LONG_PROMPTS.get(scen, "/v1/completions"), bodies[scen], timeout=10)
        except OSError as exc:
            t.error = f"{scen}: request failed: {exc}"
            return
        if status != 200:
            t.error = f"{scen}: answered {status}: {data[:200]!r}"
            return
        if stream:
            events = [line for line in data.split(b"\n") if line.startswith(b"data: ")]
            tokens = [e for e in events if e != b"data: [DONE]"]
            if len(tokens) != max_tokens or events[-1] != b"data: [DONE]":
                t.error = f"{scen}: stream has {len(tokens)} token events (want {max_tokens}) + {events[-1][:40]!r}"
                return
            t.chunks = len(events)
        else:
            doc = json.loads(data)
            choice = doc["choices"][0]
            text = choice["message"].get("content") if "message" in choice else choice.get("text")
            if not text or doc.get("kv_transfer_params"):
                t.error = f"{scen}: bad answer {data[:200]!r}"
                return
        if t.name == "direct":
            continue
        after = engine_stats(engines, kind)
        delta = {k: after[k] - before.get(k, 0) for k in after}
        if kind == "instant":
            pd = (delta.get("prefill.vllm_prefill", 0) + delta.get("prefill.sglang_prefill", 0)) >= 1 and (
                delta.get("decode.vllm_decode", 0) + delta.get("decode.sglang_decode", 0)) >= 1  # fmt: skip
        else:
            pd = delta.get("prefill.requests", 0) >= 1 and delta.get("decode.requests", 0) >= 1
        if not pd:
            t.error = f"{scen}: no PD legs seen at the engines ({ {k: v for k, v in delta.items() if v} })"
            return


# ---------------------------------------------------------------------------- load


#: Numbers the long prompts of each wrk run from a new point: a router never sees a tail twice.
_WRK_RUNS = itertools.count(1)


def run_wrk(url: str, body_file: Path, concurrency: int, seconds: float, core: int | None) -> dict[str, Any]:
    """A wrk window: the same body every request, or (a ``.prompts`` spec) a long prompt each."""
    seconds = max(1, round(seconds))  # wrk takes whole seconds
    script, script_args = WRK_SCRIPT, [str(body_file)]
    if body_file.suffix == ".prompts":
        script, script_args = PROMPTS_SCRIPT, [str(body_file), str(next(_WRK_RUNS) * 10_000_000)]
    cmd = ["wrk", "-t1", f"-c{concurrency}", f"-d{seconds}s", "--timeout", "10s", "-s", str(script),
           url + "/v1/completions", "--", *script_args]  # fmt: skip
    if core is not None:
        cmd = ["taskset", "-c", str(core), *cmd]
    if Proc.nice:
        cmd = ["nice", "-n", str(Proc.nice), *cmd]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 30)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    for line in out.stdout.splitlines():
        if line.startswith("ROUTER_BENCH "):
            result = json.loads(line[len("ROUTER_BENCH "):])
            result["wrk_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
            return result
    detail = " ".join((out.stderr.strip() + " " + out.stdout.strip()).split())
    raise RuntimeError(f"wrk gave no result (exit {out.returncode}): {detail[:300]}")


def measure(t: Target, scen: str, body_file: Path, seconds: float, warmup: float, router_core: int | None,
            load_core: int | None, engine_pids: list[int]) -> dict[str, Any]:  # fmt: skip
    _, conc, _, _ = SCENARIOS[scen]
    if warmup > 0:
        run_wrk(t.url, body_file, conc, warmup, load_core)
    pid = t.proc.pid if t.proc is not None else None
    eng0 = sum(cpu_seconds(p) for p in engine_pids)
    user0, sys0 = cpu_split(pid) if pid else (0.0, 0.0)
    cpu0 = user0 + sys0
    io0 = io_calls(pid) if pid else (0, 0)
    self0 = resource.getrusage(resource.RUSAGE_SELF)
    journal0 = journal_size(t)
    busy0 = core_busy([router_core, load_core])
    w0 = time.monotonic()
    res = run_wrk(t.url, body_file, conc, seconds, load_core)
    wall = time.monotonic() - w0
    busy1 = core_busy([router_core, load_core])
    journal1 = journal_size(t)
    self1 = resource.getrusage(resource.RUSAGE_SELF)
    user1, sys1 = cpu_split(pid) if pid else (0.0, 0.0)
    cpu1 = user1 + sys1
    io1 = io_calls(pid) if pid else (0, 0)
    eng1 = sum(cpu_seconds(p) for p in engine_pids)
    ours_load = res["wrk_cpu_s"] + eng1 - eng0 + (self1.ru_utime + self1.ru_stime) - (self0.ru_utime + self0.ru_stime)
    other = None
    if router_core is not None and load_core is not None:
        # CPU that other processes of the machine took on the cores this window uses (the router
        # core only when there is a router): the larger share of the two
        load_other = (busy1[load_core] - busy0[load_core]) - ours_load
        router_other = (busy1[router_core] - busy0[router_core]) - (cpu1 - cpu0)
        other = 100.0 * max(load_other, router_other if pid else 0.0) / wall
    n = res["requests"]
    errors = sum(res["errors"].values())
    lat = res["latency_us"]
    m: dict[str, Any] = {
        "requests": n,
        "errors": errors,
        "rps": n / (res["duration_us"] / 1e6) if res["duration_us"] else 0.0,
        "p50_us": lat["p50"],
        "p99_us": lat["p99"],
        "mean_us": lat["mean"],
        "router_cpu_s": cpu1 - cpu0,
        "router_core_pct": 100.0 * (cpu1 - cpu0) / wall if pid else None,
        "load_core_pct": 100.0 * (res["wrk_cpu_s"] + eng1 - eng0) / wall,
        "cpu_us_per_req": 1e6 * (cpu1 - cpu0) / n if (pid and n) else None,
        # the kernel's share of the router's CPU (stime / (utime + stime)), in the router's system calls
        "sys_pct": 100.0 * (sys1 - sys0) / (cpu1 - cpu0) if (pid and cpu1 > cpu0) else None,
        "other_pct": max(0.0, other) if other is not None else None,
        "rss_kib_after": rss_kib(pid)[0] if pid else None,
        # read(2)/write(2)-family calls per request (recv/send on trio's plain sockets are not counted)
        "reads_per_req": (io1[0] - io0[0]) / n if (pid and n) else None,
        "writes_per_req": (io1[1] - io0[1]) / n if (pid and n) else None,
    }
    if SCENARIOS[scen][0] and t.chunks and m["cpu_us_per_req"] is not None:
        m["cpu_us_per_chunk"] = m["cpu_us_per_req"] / t.chunks
    if t.policy == "prefix" and t.journal is not None and scen in LONG_PROMPTS:
        m["uncached_tokens"] = uncached_tokens(t.journal, journal0, journal1)
    return m


def journal_size(t: Target) -> int:
    try:
        return t.journal.stat().st_size if t.journal is not None else 0
    except OSError:
        return 0


def uncached_tokens(journal: Path, start: int, end: int) -> float | None:
    """Mean prompt tokens the prefix index did not find on the engine chosen, over the journal's records in a window.

    The journal's ``routing`` record lists the prefill candidates weighed,
    the chosen first, with the tokens of the prompt each was expected not
    to hold (docs/operate.md, "The journal").
    """
    found: list[int] = []
    with open(journal, "rb") as f:
        f.seek(start)
        data = f.read(max(0, end - start))
    for line in data.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by the window's edge
        routing = record.get("routing") if isinstance(record, dict) else None
        if isinstance(routing, dict) and routing.get("candidates"):
            found.append(routing["candidates"][0]["uncached_tokens"])
    return statistics.mean(found) if found else None


# ---------------------------------------------------------------------------- report


def med(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def fmt(v: float | None, spec: str = ".0f", scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


def summarise(results: dict[str, dict[str, list[dict[str, Any]]]], targets: list[Target]) -> dict[str, dict[str, dict[str, Any]]]:  # fmt: skip
    """Median per (target, scenario) of each figure; added latency against direct run by run."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for scen in SCENARIOS:
        direct_runs = results.get("direct", {}).get(scen, [])
        for t in targets:
            runs = results.get(t.name, {}).get(scen, [])
            if not runs:
                continue
            s: dict[str, Any] = {}
            for key in ("rps", "p50_us", "p99_us", "cpu_us_per_req", "cpu_us_per_chunk", "sys_pct", "router_core_pct",
                        "load_core_pct", "other_pct", "uncached_tokens"):  # fmt: skip
                s[key] = med([r.get(key) for r in runs])
            s["errors"] = sum(r["errors"] for r in runs)
            s["requests"] = sum(r["requests"] for r in runs)
            if direct_runs and t.name != "direct":
                pairs = list(zip(runs, direct_runs))
                s["add_p50_us"] = med([r["p50_us"] - d["p50_us"] for r, d in pairs])
                s["add_p99_us"] = med([r["p99_us"] - d["p99_us"] for r, d in pairs])
            out.setdefault(t.name, {})[scen] = s
    return out


def print_table(summary: dict[str, dict[str, dict[str, Any]]], targets: list[Target], runs: int,
                args: argparse.Namespace, results_of: dict[str, dict[str, list[dict[str, Any]]]]) -> list[str]:  # fmt: skip
    lines: list[str] = []
    p = lines.append
    w = max([16, *(len(t.name) for t in targets)])  # the target column
    p("")
    pacing = f", streamed tokens paced {args.paced_ms:g} ms apart" if args.paced_ms else ""
    p(f"Router benchmark: median of {runs} run(s), {args.duration:g} s windows, engines: {args.engine} "
      f"(speed 0{pacing}), router core {args.router_core}, load core {args.load_core}")  # fmt: skip
    head = (f"{'scenario':<21} {'target':<{w}} {'req/s':>8} {'p50 µs':>8} {'p99 µs':>8} {'+p50 µs':>8} "
            f"{'+p99 µs':>8} {'CPU µs/req':>10} {'CPU µs/chunk':>12} {'sys%':>5} {'router%':>7} {'load%':>6} "
            f"{'other%':>6}  notes")  # fmt: skip
    p(head)
    p("-" * len(head))
    chosen = [x for x in args.scenarios.split(",") if x in SCENARIOS]
    for scen, (_, _, _, label) in SCENARIOS.items():
        if scen not in chosen:
            continue
        for t in targets:
            s = summary.get(t.name, {}).get(scen)
            if s is None:
                why = t.error or t.scen_errors.get(scen)
                if why:
                    p(f"{label:<21} {t.name:<{w}} {'-':>8}  not measured: {' '.join(why.split())[:160]}")
                continue
            notes = []
            if s["errors"]:
                notes.append(f"{s['errors']} errors/{s['requests']}")
            if s["load_core_pct"] is not None and s["load_core_pct"] > 90:
                notes.append("load core saturated")
            if s["other_pct"] is not None and s["other_pct"] > 10:
                notes.append("machine busy with other work")
            p(f"{label:<21} {t.name:<{w}} {fmt(s['rps']):>8} {fmt(s['p50_us']):>8} {fmt(s['p99_us']):>8} "
              f"{fmt(s.get('add_p50_us')):>8} {fmt(s.get('add_p99_us')):>8} {fmt(s['cpu_us_per_req'], '.1f'):>10} "
              f"{fmt(s.get('cpu_us_per_chunk'), '.2f'):>12} {fmt(s.get('sys_pct')):>5} {fmt(s['router_core_pct']):>7} "
              f"{fmt(s['load_core_pct']):>6} {fmt(s['other_pct']):>6}  {'; '.join(notes)}")  # fmt: skip
        p("")
    # ratios
    p("Ratios, Narwhal / peer (same run; < 1 means Narwhal uses less):")
    narwhals = [t.name for t in targets if t.name.startswith("narwhal-")]
    peers = [t.name for t in targets if t.base in PEERS]
    any_ratio = False
    for n in narwhals:
        for peer in peers:
            parts = []
            for scen, key, label in (("pd-c1", "cpu_us_per_req", "CPU/req c=1"),
                                     ("pd-c32", "cpu_us_per_req", "CPU/req c=32"),
                                     ("stream", "cpu_us_per_chunk", "CPU/chunk"),
                                     ("pd-c1", "add_p50_us", "+p50 c=1"),
                                     ("pd-c32", "add_p99_us", "+p99 c=32")):  # fmt: skip
                a = summary.get(n, {}).get(scen, {}).get(key)
                b = summary.get(peer, {}).get(scen, {}).get(key)
                parts.append(f"{label} {a / b:.2f}" if a is not None and b else f"{label} -")
            if any(not x.endswith(" -") for x in parts):
                any_ratio = True
            p(f"  {n:<{w}} / {peer:<14} " + "   ".join(parts))
    if not any_ratio:
        p("  (none: a Narwhal target or every peer is missing)")
    bases = [n for n in narwhals if target_parts(n)[0].endswith("-base")]
    if bases:
        p("")
        p(f"A/B, this tree / --baseline {BASELINE_TREE} (same run; < 1 means this tree uses less):")
        for base in bases:
            n = base.replace("-base", "", 1)
            parts = []
            for scen, key, label in (("pd-c1", "cpu_us_per_req", "CPU/req c=1"),
                                     ("pd-c32", "cpu_us_per_req", "CPU/req c=32"),
                                     ("stream", "cpu_us_per_chunk", "CPU/chunk"),
                                     ("pd-c1", "add_p50_us", "+p50 c=1"),
                                     ("pd-c32", "add_p50_us", "+p50 c=32")):  # fmt: skip
                a = summary.get(n, {}).get(scen, {}).get(key)
                b = summary.get(base, {}).get(scen, {}).get(key)
                parts.append(f"{label} {a / b:.3f}" if a is not None and b else f"{label} -")
            p(f"  {n:<{w}} / {base:<22} " + "   ".join(parts))
            for scen in ("pd-c1", "pd-c32"):
                a = summary.get(n, {}).get(scen, {}).get("cpu_us_per_req")
                b = summary.get(base, {}).get(scen, {}).get("cpu_us_per_req")
                if a is not None and b:
                    p(f"    {n} {scen}: CPU/req {a:.1f} µs vs {b:.1f} µs before = {a / b:.3f}x; target within 10 %: "
                      f"{'MET' if a / b <= 1.10 else 'NOT MET'}")  # fmt: skip
    lines.extend(routing_cost_lines(summary, targets))
    # the issue's targets
    p("")
    p("Targets (issue 7), against vllm-router in PD mode:")
    v = summary.get("vllm-router", {})
    for n, limit in (("narwhal-asyncio", 0.8), ("narwhal-trio", 1.5)):
        a = summary.get(n, {}).get("pd-c32", {}).get("cpu_us_per_req")
        b = v.get("pd-c32", {}).get("cpu_us_per_req")
        if a is None or not b:
            p(f"  {n}: CPU/req c=32 <= {limit}x vllm-router: not measured")
        else:
            p(f"  {n}: CPU/req c=32 {a:.1f} µs = {a / b:.2f}x vllm-router ({b:.1f} µs); target <= {limit}x: "
              f"{'MET' if a / b <= limit else 'NOT MET'}")  # fmt: skip
    for n in narwhals:
        a = summary.get(n, {}).get("pd-c1", {}).get("add_p50_us")
        b = v.get("pd-c1", {}).get("add_p50_us")
        if a is None or b is None:
            p(f"  {n}: added p50 c=1 <= vllm-router's: not measured")
        else:
            p(f"  {n}: added p50 c=1 {a:.0f} µs vs vllm-router {b:.0f} µs: {'MET' if a <= b else 'NOT MET'}")
        for peer in peers:
            a = summary.get(n, {}).get("stream", {}).get("cpu_us_per_chunk")
            b = summary.get(peer, {}).get("stream", {}).get("cpu_us_per_chunk")
            if a is not None and b:
                p(f"  {n}: CPU/chunk {a:.2f} µs vs {peer} {b:.2f} µs: {'MET' if a <= b else 'NOT MET'}")
    p("")
    p("RSS: after start, after the last window of each scenario (max over runs), at the end / peak VmHWM:")
    for t in targets:
        if t.rss is not None:
            per = []
            for scen in SCENARIOS:
                vals = [kib for r in results_of.get(t.name, {}).get(scen, []) if (kib := r.get("rss_kib_after"))]
                if vals:
                    per.append(f"{scen} {max(vals) / 1024:.1f}")
            start = f"{t.rss_start / 1024:.1f}" if t.rss_start else "-"
            p(f"  {t.name:<{w}} start {start} MiB; {', '.join(per)} MiB; end {t.rss[0] / 1024:.1f} MiB / "
              f"peak {t.rss[1] / 1024:.1f} MiB")  # fmt: skip
        elif t.name != "direct":
            p(f"  {t.name:<{w}} -  ({t.error or 'not running'})")
    p("")
    p("Latency is wrk's, per request (a stream: to its last byte); +p50/+p99 = target minus direct in the same run.")
    p("CPU = router process utime+stime (all threads, no children) over the load window / requests; "
      "chunk = one relayed SSE event.")  # fmt: skip
    p("sys% = the kernel's share of that CPU (stime / (utime + stime)): the router's system calls.")
    p("router% / load% = CPU used on the router core / on the load core (wrk + both engines) over the window;")
    p("other% = CPU that other processes of the machine took on the busier of those cores (busy in /proc/stat "
      "minus ours): above ~10 % the figures are disturbed.")  # fmt: skip
    for line in lines:
        print(line)
    return lines


def routing_cost_lines(summary: dict[str, dict[str, dict[str, Any]]], targets: list[Target]) -> list[str]:
    """Each ``@prefix`` Narwhal's CPU per request on the long prompts, against its runtime's least_loaded and vllm-router's cache_aware.

    The targets: at most 1.2x the same runtime's ``least_loaded`` (named
    ``@least_loaded``, else the plain target, whose default it is) and at
    most vllm-router's ``cache_aware`` (each ``vllm-router@cache_aware...``
    measured), in the same run.
    """
    scens = [s for s in LONG_PROMPTS if any(s in summary.get(t.name, {}) for t in targets)]
    prefixes = [t for t in targets if t.base.startswith("narwhal-") and t.policy == "prefix"]
    if not scens or not prefixes:
        return []
    names = {t.name for t in targets}
    caches = [t.name for t in targets if t.base == "vllm-router" and t.policy.startswith("cache_aware")]
    out = ["", "Routing cost on long prompts (CPU µs/request, same run; the prompt's tokens ~"
           f"{(LONG_SHARED + LONG_TAIL) // 4}, uncached = on the engine chosen, from the journal):"]  # fmt: skip
    for t in prefixes:
        loaded = f"{t.base}@least_loaded" if f"{t.base}@least_loaded" in names else t.base
        for scen in scens:
            cpu = summary.get(t.name, {}).get(scen, {}).get("cpu_us_per_req")
            if cpu is None:
                out.append(f"  {t.name} {scen}: not measured")
                continue
            unc = summary[t.name][scen].get("uncached_tokens")
            out.append(f"  {t.name} {scen}: {cpu:.1f} µs/req, uncached {fmt(unc)} tokens/req")
            for other, limit in [(loaded, 1.2), *((c, 1.0) for c in caches)]:
                b = summary.get(other, {}).get(scen, {}).get("cpu_us_per_req")
                if b is None or other not in names:
                    out.append(f"    vs {other}: not measured")
                    continue
                out.append(f"    vs {other} {b:.1f} µs: {cpu / b:.2f}x; target <= {limit:g}x: "
                           f"{'MET' if cpu / b <= limit else 'NOT MET'}")  # fmt: skip
    return out


# ---------------------------------------------------------------------------- profile


def profile(t: Target, peers_bin: Path | None, work: Path, body_file: Path, seconds: float,
            load_core: int | None, scen: str = "pd-c32") -> list[str]:  # fmt: skip
    """Two py-spy windows under ``scen``'s load: a flame graph (SVG), then raw stacks summarised here."""
    if t.proc is None or t.error:
        return [f"profile: {t.name} is not running"]
    spy = str(peers_bin / "py-spy") if peers_bin and (peers_bin / "py-spy").exists() else shutil.which("py-spy")
    if spy is None:
        return ["profile: py-spy not found (it is installed in benchmarks/.peers-venv)"]
    outputs = {"flamegraph": work / f"profile-{t.name}.svg", "raw": work / f"profile-{t.name}.txt"}
    for kind, out in outputs.items():
        # the raw window also samples native frames: C time (GC, orjson, re, syscalls) gets its own name
        spy_proc = subprocess.Popen(
            [spy, "record", "--pid", str(t.proc.pid), "--duration", str(int(seconds)), "--rate", "250",
             "--format", kind, "--output", str(out), *(["--native"] if kind == "raw" else ["--nonblocking"])],
            stdout=subprocess.DEVNULL, stderr=open(work / "py-spy.log", "ab"),
        )  # fmt: skip
        time.sleep(0.5)
        run_wrk(t.url, body_file, SCENARIOS[scen][1], seconds, load_core)
        try:
            spy_proc.wait(seconds + 30)
        except subprocess.TimeoutExpired:
            spy_proc.kill()
    raw = outputs["raw"]
    lines = [f"Profile of {t.name} under {scen} (py-spy --native, 250 Hz; "
             f"flame graph: {outputs['flamegraph']}); samples of idle threads waiting on a lock left out"]  # fmt: skip
    if not raw.exists():
        return lines + [f"  (py-spy wrote no profile; see {work / 'py-spy.log'})"]
    self_time: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        if any(f.startswith("PyThread_acquire_lock") for f in frames):
            continue  # an idle worker thread (trio's thread cache, the journal's fsync thread)
        total += n
        names = [f.partition(" (")[0] for f in frames]
        if any(x.startswith(("gc_collect", "collect_with_callback", "gc_collect_main")) for x in names):
            incl["[Python cyclic GC]"] += n
        self_time[_frame(frames[-1])] += n
        for fr in {_module(f) for f in frames}:
            incl[fr] += n
    if not total:
        return lines + ["  (no samples)"]
    lines.append("  self time by function (idle = waiting in epoll):")
    for name, n in self_time.most_common(20):
        lines.append(f"    {100 * n / total:5.1f} %  {name}")
    lines.append("  inclusive time by file (a sample counts once per file on its stack):")
    for name, n in incl.most_common(20):
        lines.append(f"    {100 * n / total:5.1f} %  {name}")
    return lines


def _frame(frame: str) -> str:
    # py-spy raw frames: "function (path/to/file.py:line)"; native ones: "function (library.so)" or an address
    name, _, loc = frame.partition(" (")
    path = loc.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({_short(path)})" if path else name


def _module(frame: str) -> str:
    _, _, loc = frame.partition(" (")
    return _short(loc.rstrip(")").rsplit(":", 1)[0]) or "[native]"


def _short(path: str) -> str:
    for marker in ("site-packages/", "/lib/python3.11/", str(REPO) + "/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


# ---------------------------------------------------------------------------- table mode


def table_mode(args: argparse.Namespace, work: Path) -> int:
    if shutil.which("wrk") is None:
        raise SystemExit("router_bench: wrk is not installed (apt-get install wrk)")
    names = [n for n in args.targets.split(",") if n]
    for n in names:
        base, policy = target_parts(n)
        if base not in KNOWN_TARGETS:
            raise SystemExit(f"router_bench: unknown target {n!r} (choose from {', '.join(KNOWN_TARGETS)}, "
                             f"a Narwhal or a peer with @POLICY)")  # fmt: skip
        if policy and (base == "direct" or (base.startswith("narwhal-") and policy not in NARWHAL_POLICIES)):
            raise SystemExit(f"router_bench: {n!r}: a Narwhal policy is one of {', '.join(NARWHAL_POLICIES)}; "
                             f"direct has none")  # fmt: skip
    scenarios = [s for s in args.scenarios.split(",") if s]
    for scen in scenarios:
        if scen not in SCENARIOS:
            raise SystemExit(f"router_bench: unknown scenario {scen!r} (choose from {', '.join(SCENARIOS)})")
    if "direct" not in names:
        names.insert(0, "direct")
    peers_bin, peers_error = None, ""
    if any(target_parts(n)[0] in PEERS for n in names) or args.profile:
        peers_bin, peers_error = ensure_peers(work)
        if peers_bin is None:
            log(peers_error)
    bodies, body_files = write_bodies(work)
    log(f"work directory {work}; body {len(bodies['pd-c1'])} bytes"
        + "".join(f", {s} ~{len(bodies[s])} bytes" for s in scenarios if s in LONG_PROMPTS))  # fmt: skip
    engines: dict[str, dict[str, Any]] = {}
    engine_procs: list[Proc] = []
    for role in ("prefill", "decode"):
        proc, info = start_engine(args.engine, role, args.load_core, work, token_interval_ms=args.paced_ms)
        engines[role] = info
        engine_procs.append(proc)
    log(f"engines ({args.engine}): prefill {engines['prefill']['url']}, decode {engines['decode']['url']}")
    targets = [start_target(n, args.router_core, work, engines, peers_bin, peers_error) for n in names]
    for t in targets:
        wait_ready(t, args.start_timeout)
        validate(t, engines, args.engine, bodies, scenarios)
        log(f"{t.name:<16} {'FAILED: ' + t.error if t.error else 'ready at ' + t.url}")
        if t.error is None and t.proc is not None:
            t.rss_start = rss_kib(t.proc.pid)[0]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    engine_pids = [p.pid for p in engine_procs]
    for run in range(args.runs):
        order = [t for t in targets if t.error is None]
        k = run % max(1, len(order))
        order = order[k:] + order[:k]
        for scen in scenarios:
            for t in order:
                if t.error is not None:
                    continue
                if t.proc is not None and not t.proc.alive():
                    t.error = f"died during the runs (exit {t.proc.popen.returncode}): {t.proc.tail(3)}"
                    log(f"{t.name}: {t.error}")
                    continue
                try:
                    m = None
                    if time.monotonic() > args.stop_at:
                        t.scen_errors[scen] = "skipped: --time-limit nearly reached"
                        continue
                    calm = time.monotonic() < args.soft_stop_at  # past it: no more waiting or retrying
                    for attempt in range(1 + (args.retries if calm else 0)):
                        # on a shared machine: wait (bounded) for the other work to calm down, and
                        # measure again when it disturbed the window; keep the least disturbed one
                        if calm:
                            quiet_wait(args.router_core, args.load_core, args.max_other, args.quiet_wait)
                        mm = measure(t, scen, body_files[scen], args.duration, args.warmup, args.router_core,
                                     args.load_core, engine_pids)  # fmt: skip
                        mm["attempts"] = attempt + 1
                        if m is None or (mm["other_pct"] or 0) < (m["other_pct"] or 0):
                            m = mm
                        if (m["other_pct"] or 0) <= args.max_other:
                            break
                    assert m is not None
                except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
                    t.scen_errors[scen] = f"load failed: {exc}"
                    log(f"{t.name} {scen}: load failed: {exc}")
                    continue
                if t.proc is not None and not t.proc.alive():
                    t.error = f"crashed under load in {scen} (exit {t.proc.popen.returncode}): {t.proc.tail(3)}"
                    log(f"{t.name}: {t.error}")
                    continue
                results.setdefault(t.name, {}).setdefault(scen, []).append(m)
                log(f"run {run + 1}/{args.runs} {scen:<11} {t.name:<16} {m['rps']:8.0f} req/s  p50 {m['p50_us']:6d} µs"
                    f"  p99 {m['p99_us']:6d} µs  CPU {fmt(m['cpu_us_per_req'], '.1f'):>7} µs/req (sys {fmt(m['sys_pct'])}%)"
                    f"  router {fmt(m['router_core_pct'])}%  load {m['load_core_pct']:.0f}%  other {fmt(m['other_pct'])}%"
                    f"  RSS {fmt(m['rss_kib_after'], '.1f', 1 / 1024)} MiB"
                    f"  reads/writes per req {fmt(m['reads_per_req'], '.1f')}/{fmt(m['writes_per_req'], '.1f')}"
                    f"{'  errors ' + str(m['errors']) if m['errors'] else ''}")  # fmt: skip
    for t in targets:
        if t.proc is not None and t.proc.alive():
            t.rss = rss_kib(t.proc.pid)
    profile_lines: list[str] = []
    if args.profile:
        chosen = next((x for x in targets if x.name == args.profile), None)
        if chosen is None:
            profile_lines = [f"profile: {args.profile} is not among the targets"]
        else:
            log(f"profiling {chosen.name} with py-spy")
            profile_lines = profile(chosen, peers_bin, work, body_files[args.profile_scenario],
                                    max(3.0, args.duration), args.load_core, args.profile_scenario)  # fmt: skip
    summary = summarise(results, targets)
    lines = print_table(summary, targets, args.runs, args, results)
    for line in profile_lines:
        print(line)
    machine = machine_conditions(args)
    print(f"Machine: {machine}")
    out = {
        "args": vars(args), "machine": machine, "summary": summary, "runs": results,
        "targets": {t.name: {"url": t.url, "error": t.error, "chunks": t.chunks, "rss_kib": t.rss,
                             "cmd": t.proc.cmd if t.proc else None} for t in targets},
        "engines": engines, "table": lines, "profile": profile_lines,
    }  # fmt: skip
    (work / "results.json").write_text(json.dumps(out, indent=1, default=str))
    print(f"Results and logs: {work}")
    return 0


def write_bodies(work: Path) -> tuple[dict[str, bytes], dict[str, Path]]:
    """Each scenario's request body (to validate with) and the file wrk reads it from, written to ``work``."""
    bodies: dict[str, bytes] = {}
    body_files: dict[str, Path] = {}
    for scen, (stream, _, max_tokens, _) in SCENARIOS.items():
        if scen in LONG_PROMPTS:
            spec, bodies[scen] = long_prompt_spec(scen)
            body_files[scen] = work / f"body-{scen}.prompts"
            body_files[scen].write_text(spec)
            continue
        doc: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.7,
                               "top_p": 0.95, "user": "bench"}  # fmt: skip
        if stream:
            doc["stream"] = True
        bodies[scen] = json.dumps(doc).encode()
        body_files[scen] = work / f"body-{scen}.json"
        body_files[scen].write_bytes(bodies[scen])
    return bodies, body_files


def quiet_wait(router_core: int | None, load_core: int | None, max_other: float, max_wait: float) -> float:
    """Wait up to ``max_wait`` s until our two cores are at most ``max_other`` % busy (we are idle here)."""
    cores = [c for c in (router_core, load_core) if c is not None] or sorted(os.sched_getaffinity(0))
    deadline = time.monotonic() + max_wait
    while True:
        b0 = core_busy(list(cores))
        time.sleep(0.3)
        b1 = core_busy(list(cores))
        pct = 100.0 * sum(b1[c] - b0[c] for c in cores) / (0.3 * len(cores))
        if pct <= max_other or time.monotonic() >= deadline:
            return pct


def busy_elsewhere(seconds: float = 1.0) -> float:
    """Share (%) of the machine's CPUs busy over ``seconds`` before anything starts: other work."""
    cores = sorted(os.sched_getaffinity(0))
    b0 = core_busy(list(cores))
    time.sleep(seconds)
    b1 = core_busy(list(cores))
    return 100.0 * sum(b1[c] - b0[c] for c in cores) / (seconds * len(cores))


def code_state() -> str:
    """The commit measured, and whether the work tree differed from it (others may be editing)."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()  # fmt: skip
        changed = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no",
                                  "--", "narwhal", "narwhal_core", "narwhal_trio", "narwhal_asyncio"],
                                 capture_output=True, text=True, timeout=10).stdout.split("\n")  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "code: unknown (no git)"
    files = [line[3:] for line in changed if line.strip()]
    return f"code: {head}" + (f" with uncommitted changes to {', '.join(files)}" if files else " (clean)")


def machine_conditions(args: argparse.Namespace) -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "?"
    load = os.getloadavg()
    # The interpreter's build matters (see benchmarks/README.md): name the binary.
    python = f"Python {sys.version.split()[0]} ({os.path.realpath(sys.executable)})"
    # The core as installed: compiled by setup.py where it could be (the -pure targets run the sources).
    import narwhal_core  # noqa: F401 - loads the modules core_build() inspects

    python += f", core {core_build()[0]}"
    return (f"{os.cpu_count()} CPUs ({model}), Linux {os.uname().release}, {python}, "
            f"loadavg {load[0]:.2f}; router core {args.router_core}, load core {args.load_core}, nice {args.nice}; "
            f"busy with other work before the start: {args.busy_before:.0f} %; {args.code_at_start}"
            + ("" if code_state() == args.code_at_start else f" (at the end: {code_state()})"))  # fmt: skip


# ---------------------------------------------------------------------------- slow streams


class _StreamClient(asyncio.Protocol):
    """One streamed completion on its own connection: notes its first body byte and its end."""

    def __init__(self, request: bytes, state: dict[str, Any], first: asyncio.Future[None],
                 done: asyncio.Future[None]) -> None:  # fmt: skip
        import httptools

        self.request = request
        self.state = state
        self.first = first
        self.done = done
        self.parser = httptools.HttpResponseParser(self)
        self.opened = False
        self.status = 0
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # noqa: BLE001
            self._finish(f"bad response: {exc}")
            self.transport.close()

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if not self.opened:
            self.opened = True
            self.state["open"] += 1
            self.state["max_open"] = max(self.state["max_open"], self.state["open"])
            if not self.first.done():
                self.first.set_result(None)

    def on_message_complete(self) -> None:
        self._finish(None if self.status == 200 else f"status {self.status}")
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done.done():
            return
        where = "before the response" if not self.status else ("before the first event" if not self.opened
                                                                 else "mid-stream")  # fmt: skip
        self._finish(f"connection lost {where}{f' ({type(exc).__name__})' if exc else ''}")

    def _finish(self, error: str | None) -> None:
        if not self.first.done():
            self.first.set_result(None)
        if self.done.done():
            return
        if self.opened:
            self.state["open"] -= 1
        if error:
            self.state["errors"][error] += 1
            self.state["error_times"].append(round(time.monotonic() - self.state["t0"], 1))
        else:
            self.state["completed"] += 1
        self.done.set_result(None)


async def _slow_streams(url: str, pid: int, n: int, tokens: int, connect_parallel: int, milestones: list[int],
                        timeout: float) -> dict[str, Any]:  # fmt: skip
    loop = asyncio.get_running_loop()
    host, port = url.split("//", 1)[1].split(":")
    body = json.dumps({"model": MODEL, "prompt": PROMPT[:200], "max_tokens": tokens, "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: %s:%s\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (host.encode(), port.encode(), len(body), body))  # fmt: skip
    t0 = time.monotonic()
    state: dict[str, Any] = {"open": 0, "max_open": 0, "completed": 0, "errors": collections.Counter(),
                             "error_times": [], "t0": t0}  # fmt: skip
    samples: list[dict[str, Any]] = []

    def sample(label: str) -> dict[str, Any]:
        try:
            rss, hwm = rss_kib(pid)
            cpu: float | None = cpu_seconds(pid)
        except OSError:  # the router is gone: the caller reports it
            rss = hwm = 0
            cpu = None
        s = {"label": label, "t": round(time.monotonic() - t0, 2), "open": state["open"], "completed":
             state["completed"], "errors": sum(state["errors"].values()), "rss_kib": rss, "hwm_kib": hwm,
             "cpu_s": cpu}  # fmt: skip
        samples.append(s)
        log(f"slow-streams {label:<14} t={s['t']:6.1f}s open {state['open']:6d} completed {state['completed']:6d}"
            f"  RSS {rss / 1024:7.1f} MiB")  # fmt: skip
        return s

    sample("0 open")
    sem = asyncio.Semaphore(connect_parallel)
    transports: list[Any] = []

    async def one() -> None:
        # a connect slot is held until the stream's first event: the ramp follows the router's pace
        async with sem:
            first: asyncio.Future[None] = loop.create_future()
            done: asyncio.Future[None] = loop.create_future()
            try:
                tr, _ = await loop.create_connection(lambda: _StreamClient(request, state, first, done), host, int(port))
            except OSError as exc:
                state["errors"][f"connect: {exc.strerror or exc}"] += 1
                return
            transports.append(tr)
            await first

    tasks = [asyncio.ensure_future(one()) for _ in range(n)]
    reached: list[int] = []
    deadline = t0 + timeout
    next_ms = 0
    timeline_at = t0
    while time.monotonic() < deadline:
        now = time.monotonic()
        while next_ms < len(milestones) and state["open"] >= milestones[next_ms]:
            sample(f"{milestones[next_ms]} open")
            reached.append(milestones[next_ms])
            next_ms += 1
        if next_ms < len(milestones) and state["completed"] > 0:
            sample(f"peak {state['max_open']}")  # streams end before the next milestone: it cannot be reached
            next_ms = len(milestones)
        if state["completed"] + sum(state["errors"].values()) >= n:
            break
        if now - timeline_at >= 5.0:
            timeline_at = now
            sample("timeline")
        await asyncio.sleep(0.02)
    ended = state["completed"] + sum(state["errors"].values())
    if ended < n:
        log(f"slow-streams: {n - ended} streams still open at the deadline: closing them")
        state["errors"]["still open at the deadline"] += n - ended
    for task in tasks:
        task.cancel()
    for tr in transports:
        tr.close()
    await asyncio.sleep(2.0)
    after = sample("after finish")
    await asyncio.sleep(5.0)
    after2 = sample("after +5 s")
    return {"samples": samples, "completed": state["completed"], "errors": dict(state["errors"]),
            "max_open": state["max_open"], "reached": reached, "after": after, "after_5s": after2,
            "seconds": round(time.monotonic() - t0, 1), "error_times_s": state["error_times"][:200]}  # fmt: skip


def slow_streams_mode(args: argparse.Namespace, work: Path) -> int:
    names = [n for n in args.targets.split(",") if n and n != "direct"]
    if args.targets == ",".join(ALL_TARGETS):
        names = ["narwhal-trio", "narwhal-asyncio"]
    n = args.streams
    # The router holds two descriptors per open stream (the client's connection and the decode leg's),
    # and RLIMIT_NOFILE's hard limit cannot be raised without CAP_SYS_RESOURCE (20,000 on the
    # project's machines): past it, streams fail for a reason that is not the router's memory.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    fd_note = ""
    if hard != resource.RLIM_INFINITY and 2 * n + 500 > hard:
        capped = (hard - 500) // 2
        fd_note = (f"capped at {capped} streams (asked {n}): the router needs 2 file descriptors per stream and "
                   f"the hard RLIMIT_NOFILE is {hard} (raising it needs CAP_SYS_RESOURCE)")  # fmt: skip
        log(f"slow-streams: {fd_note}")
        milestones = sorted({n // 4, n // 2, capped})
        n = capped
    else:
        milestones = sorted({n // 4, n // 2, n})
    interval_ms = args.token_interval_ms
    tokens = max(2, int(args.stream_seconds * 1000 / interval_ms))
    peers_bin, peers_error = (None, "")
    if any(target_parts(x)[0] in PEERS for x in names):
        peers_bin, peers_error = ensure_peers(work)
    engines: dict[str, dict[str, Any]] = {}
    for role in ("prefill", "decode"):
        _, info = start_engine("instant", role, args.load_core, work, token_interval_ms=interval_ms)
        engines[role] = info
    extra = {
        "admission": {"max_inflight": n + 1000, "queue_size": n + 1000},
        "engine": {"max_inflight_per_engine": n + 1000},
        "ingress": {"max_connections": 2 * n + 1000},
    }
    report: list[str] = [
        "",
        f"Slow streams: {n} concurrent streams of {tokens} tokens, one every {interval_ms:g} ms "
        f"(~{tokens * interval_ms / 1000:.0f} s each), {args.connect_parallel} connects in flight at most"
        + (f"; {fd_note}" if fd_note else ""),
        f"{'target':<18} " + " ".join(f"{m:>9}" for m in [0, *milestones]) + f" {'after':>9} {'after+5s':>9}"
        f" {'KiB/stream':>10}  completed  errors",
    ]  # fmt: skip
    for name in names:
        t = start_target(name, args.router_core, work, engines, peers_bin, peers_error, narwhal_extra=extra)
        wait_ready(t, args.start_timeout)
        if t.error:
            report.append(f"{name:<18} not measured: {t.error[:200]}")
            log(f"{name}: {t.error}")
            continue
        assert t.proc is not None
        time.sleep(1.0)
        all_rounds = []
        for rnd in range(1, args.rounds + 1):
            log(f"slow-streams through {name} ({t.url}), round {rnd}/{args.rounds}")
            timeout = args.stream_seconds + 180
            res = asyncio.run(_slow_streams(t.url, t.proc.pid, n, tokens, args.connect_parallel, milestones, timeout))
            all_rounds.append(res)
            alive = t.proc.alive()
            by_label = {s["label"]: s["rss_kib"] for s in res["samples"]}
            cells = [by_label.get("0 open")] + [by_label.get(f"{m} open") for m in milestones]
            slope = None
            if cells[0] is not None and cells[-1] is not None:
                slope = (cells[-1] - cells[0]) / n
            label = name if args.rounds == 1 else f"{name} #{rnd}"
            row = (f"{label:<18} " + " ".join(f"{c / 1024:8.1f}M" if c else f"{'-':>9}" for c in cells)
                   + f" {res['after']['rss_kib'] / 1024:8.1f}M {res['after_5s']['rss_kib'] / 1024:8.1f}M"
                   + f" {fmt(slope, '.1f'):>10}  {res['completed']:>9}  {res['errors'] or '-'}")  # fmt: skip
            if not alive:
                row += f"  ROUTER DIED: {t.proc.tail(3)}"
                report.append(row)
                break
            if len(res["reached"]) < len(milestones):
                row += f"  (peak open {res['max_open']}: streams finished before all milestones)"
            report.append(row)
        res = {"rounds": all_rounds}
        t.proc.stop()
        (work / f"slow-streams-{name}.json").write_text(json.dumps(res, indent=1, default=str))
    report.append("RSS (VmRSS) of the router process with that many streams open (first event received), after all "
                  "ended, and 5 s later; KiB/stream = (RSS at the last milestone - RSS at 0) / streams. "
                  "#2: a second batch through the same router process.")  # fmt: skip
    for line in report:
        print(line)
    print(f"Machine: {machine_conditions(args)}")
    print(f"Results and logs: {work}")
    return 0


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="router_bench.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--scenario", choices=("table", "slow-streams", "paired"), default="table",
                        help="the side-by-side table, 10,000 slow streams through Narwhal (RSS), or a paired "
                             "A/B of router CPU against --baseline (benchmarks/paired_ab.py)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="1 run, 2 s windows (slow-streams: 2,000 streams, 20 s)")
    parser.add_argument("--runs", type=int, default=3, help="runs; each figure is the median")
    parser.add_argument("--duration", type=int, default=None,
                        help="seconds of each measured load window (table: 5; paired: 2)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="seconds of warm-up load before each window (0: none; table: 1); paired: once per "
                             "router and scenario before the rounds (2)")  # fmt: skip
    parser.add_argument("--targets", default=",".join(ALL_TARGETS), help="comma-separated targets")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="source tree (built in place) the narwhal-*-base targets run from")
    parser.add_argument("--scenarios", default=None,
                        help=f"comma-separated scenarios, of {', '.join(SCENARIOS)} (table: "
                             f"{','.join(DEFAULT_SCENARIOS)}; paired: pd-c1,pd-c32)")  # fmt: skip
    parser.add_argument("--engine", choices=("instant", "sim"), default="instant",
                        help="instant: benchmarks/instant_engine.py; sim: python -m narwhal_sim --speed 0")  # fmt: skip
    cores = sorted(os.sched_getaffinity(0))
    parser.add_argument("--router-core", type=int, default=cores[-1] if len(cores) > 1 else None)
    parser.add_argument("--load-core", type=int, default=cores[0] if len(cores) > 1 else None)
    parser.add_argument("--start-timeout", type=float, default=30.0, help="seconds a target may take to start")
    parser.add_argument("--profile", default=None, metavar="TARGET", help="py-spy a Narwhal target under load")
    parser.add_argument("--profile-scenario", default="pd-c32", choices=tuple(SCENARIOS),
                        help="the load --profile runs")  # fmt: skip
    parser.add_argument("--streams", type=int, default=10_000, help="slow-streams: concurrent streams")
    parser.add_argument("--token-interval-ms", type=float, default=1000.0, help="slow-streams: engine pacing")
    parser.add_argument("--paced-ms", type=float, default=0.0,
                        help="table: the instant engines send streamed tokens this many ms apart (0: all at once)")
    parser.add_argument("--stream-seconds", type=float, default=60.0, help="slow-streams: length of each stream")
    parser.add_argument("--rounds", type=int, default=None,
                        help="slow-streams: batches of streams through the same router (does RSS come back?) (2); "
                             "paired: pairs of windows per runtime and scenario (20)")  # fmt: skip
    parser.add_argument("--runtimes", default="trio,asyncio", help="paired: the runtimes compared")
    parser.add_argument("--order", choices=("abba", "random"), default="abba",
                        help="paired: which side of a pair goes first (abba: alternating; random: from --seed)")
    parser.add_argument("--seed", type=int, default=1, help="paired: seed of the order and of the bootstrap")
    parser.add_argument("--policy", default="", choices=("",) + NARWHAL_POLICIES,
                        help="paired: the routing.policy both trees run (default: each tree's own default)")
    parser.add_argument("--bound", type=float, default=0.05, help="paired: the cost bound, this tree / baseline - 1")
    parser.add_argument("--resamples", type=int, default=10_000, help="paired: bootstrap resamples")
    parser.add_argument("--connect-parallel", type=int, default=256, help="slow-streams: connects in flight")
    parser.add_argument("--nice", type=int, default=-10 if os.geteuid() == 0 else 0,
                        help="nice value of every process started (negative needs root): less disturbance "
                             "from other work on a shared machine")  # fmt: skip
    parser.add_argument("--max-other", type=float, default=10.0,
                        help="a window where other processes took more than this %% of our two cores is measured "
                             "again (--retries), after waiting up to --quiet-wait s for them to calm down")  # fmt: skip
    parser.add_argument("--retries", type=int, default=2, help="extra attempts at a disturbed window")
    parser.add_argument("--quiet-wait", type=float, default=10.0, help="seconds to wait for a quiet machine")
    parser.add_argument("--time-limit", type=float, default=1800.0, help="stop everything after this many seconds")
    parser.add_argument("--out", default=None, help="work directory (default: a new one under /tmp)")
    args = parser.parse_args(argv)
    paired = args.scenario == "paired"
    if args.duration is None:
        args.duration = 2 if paired else 5
    if args.warmup is None:
        args.warmup = 2 if paired else 1
    if args.scenarios is None:
        args.scenarios = "pd-c1,pd-c32" if paired else ",".join(DEFAULT_SCENARIOS)
    if args.rounds is None:
        args.rounds = 20 if paired else 2
    if args.quick:
        args.runs = 1
        args.duration = min(args.duration, 2)
        args.warmup = min(args.warmup, 1.0)
        if args.streams == 10_000:
            args.streams = 2_000
        args.stream_seconds = min(args.stream_seconds, 20.0)
    global BASELINE_TREE
    BASELINE_TREE = str(Path(args.baseline).resolve()) if args.baseline else ""
    args.code_at_start = code_state()  # the code the targets load (others may be editing the tree)
    args.busy_before = busy_elsewhere()
    if args.busy_before > 10:
        log(f"warning: the machine is {args.busy_before:.0f} % busy with other work: figures will be disturbed")
    Proc.nice = args.nice
    if args.nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, args.nice)
        except OSError:
            Proc.nice = args.nice = 0
    if args.router_core is None:
        log("only one core: nothing is pinned, and the router shares its core with the load")
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="router_bench-"))
    work.mkdir(parents=True, exist_ok=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(hard, 2 * args.streams + 10_000)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))  # children inherit it
    except (ValueError, OSError):  # raising the hard limit needs CAP_SYS_RESOURCE
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    def on_alarm(signum: int, frame: Any) -> None:
        raise TimeoutError(f"router_bench: --time-limit {args.time_limit:g} s reached")

    started = time.monotonic()
    args.soft_stop_at = started + 0.6 * args.time_limit
    args.stop_at = started + 0.85 * args.time_limit
    signal.signal(signal.SIGALRM, on_alarm)
    exit_on_sigterm()
    signal.alarm(int(args.time_limit))
    try:
        if args.scenario == "slow-streams":
            return slow_streams_mode(args, work)
        if paired:
            import paired_ab  # beside this file; it takes this module's machinery from the call

            return paired_ab.paired_mode(sys.modules[__name__], args, work)
        return table_mode(args, work)
    finally:
        signal.alarm(0)
        Proc.stop_all()


if __name__ == "__main__":
    sys.exit(main())
