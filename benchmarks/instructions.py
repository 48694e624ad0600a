"""Instructions per request of ``narwhal serve``, counted by valgrind's callgrind: the deterministic cost measure.

CPU time on a shared two-core machine swings by more than the differences
the cost bound (5 % over a baseline tree) is about; the instructions the
router runs per request do not. This starts two instant engines
(``benchmarks/instant_engine.py``), then, for each tree, runtime and hash
seed, a router under ``setarch -R valgrind --tool=callgrind`` with
instrumentation off; it sends ``--warm`` sequential keep-alive ``POST
/v1/completions`` (a 1 KB prompt, or ``--prompt-bytes``; ``max_tokens``
8), turns instrumentation on (``callgrind_control -i on``, then ``-z``),
sends ``-n`` more, dumps and prints ``Ir / n``. With ``--concurrency C``
the counted requests go out C at a time on C connections (all sent, then
every answer read); with ``--cache-sim``, callgrind simulates the caches
too, and the L1 and last-level misses per request are printed with the
cycles KCachegrind would estimate from them. Only what the router does between the two toggles
is counted: start-up, imports and shutdown are not.

Health probes (``probe_interval_s`` 3600) and the ``/metrics`` poll
(``routing.metrics_interval_s`` 0, a key a tree that does not know it is
not given) are off, so each request's own work is what is counted. What
still lands in the window in proportion to wall time, not to requests, is
the journal's fsync timer (``journal.fsync = "interval"``, once a second):
under valgrind a request takes tens of milliseconds, so each tick weighs
about fifty times what it does at full speed, and more when the machine
is busy. ``--fsync never`` leaves it out (benchmarks/README.md has both).
A run is flagged when its random rid prefix ends in many decimal digits,
which made a tree before stop 33 parse prefill answers the slow way.

Usage::

    python benchmarks/instructions.py --tree . --tree ../base [--runtime asyncio] [--seeds 1,2,3]
        [-n 400] [--warm 100] [--concurrency 1] [--prompt-bytes 1024] [--fsync never] [--cache-sim] [--keep DIR]

``--tree`` is a checkout built in place (``pip install -e .`` there, or its
own ``setup.py build_ext --inplace``); it is put first on ``PYTHONPATH``,
so this interpreter runs that tree's code. ``--keep`` saves each window's
callgrind file (``callgrind_annotate --inclusive=yes FILE``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def request_bytes(prompt_bytes: int) -> bytes:
    """The request sent: ``prompt_bytes`` of prompt (1 KB: "x"s; longer: prose with line breaks, as a document)."""
    if prompt_bytes <= 1024:
        prompt = "x" * prompt_bytes
    else:
        line = "The router reads every byte of the body before it decides where the prompt goes.\n"
        prompt = (line * (prompt_bytes // len(line) + 1))[:prompt_bytes]
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 8}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: narwhal\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


START_TIMEOUT_S = 120.0
#: A rid prefix ending in this many decimal digits or more (a tree before the
#: prefix was made to end in a letter: narwhal_runtime/app.py) sends prefill
#: answers down wire.loads's exact path: such a run is flagged.
SLOW_DIGITS = 6


class Client:
    """One keep-alive client connection sending the same request (``data``), one at a time."""

    def __init__(self, port: int, data: bytes) -> None:
        self.data = data
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def _more(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the router closed the connection")
        self.buf += data

    def request(self) -> None:
        """Send the request, read the whole answer (Content-Length or chunked); fail unless 200."""
        self.send()
        self.answer()

    def send(self) -> None:
        """Send the request."""
        self.sock.sendall(self.data)

    def answer(self) -> None:
        """Read one whole answer (Content-Length or chunked); fail unless 200."""
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        length = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
        if length:
            while len(self.buf) < int(length.group(1)):
                self._more()
            self.buf = self.buf[int(length.group(1)):]
        else:
            while True:
                while b"\r\n" not in self.buf:
                    self._more()
                size = int(self.buf.partition(b"\r\n")[0].split(b";")[0], 16)
                end = self.buf.index(b"\r\n") + 2 + size + 2
                while len(self.buf) < end:
                    self._more()
                self.buf = self.buf[end:]
                if size == 0:
                    break
        if head.split(b" ", 2)[1] != b"200":
            raise RuntimeError(f"the router answered {head[:200]!r}")


def start_engine(role: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, str(HERE / "instant_engine.py"), "--role", role,
                             "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())["url"]


def knows(tree: Path, key: str) -> bool:
    """Whether the tree's config has ``key`` (a baseline may predate it)."""
    return re.search(rf"^\s+{key}\s*:", (tree / "narwhal_core" / "config.py").read_text(), re.M) is not None


def config(tree: Path, port: int, prefill: str, decode: str, journal: Path, fsync: str | None) -> str:
    lines = ["[model]", 'name = "m"', "[ingress]", f'listen = "127.0.0.1:{port}"', "[engine]",
             f'prefill = ["{prefill}"]', f'decode = ["{decode}"]', "[journal]", f'path = "{journal}"']
    if fsync:
        lines.append(f'fsync = "{fsync}"')
    lines += ["[health]", "probe_interval_s = 3600"]
    if knows(tree, "metrics_interval_s"):
        lines += ["[routing]", "metrics_interval_s = 0"]
    return "\n".join(lines) + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def window(tree: Path, runtime: str, seed: int, args: argparse.Namespace, prefill: str,
           decode: str) -> tuple[dict[str, float], str]:
    """Events per request of one router run (``Ir``; with ``--cache-sim``, the cache misses too), and its rid prefix.

    Its callgrind file is kept in ``args.keep``.
    """
    tmp = Path(tempfile.mkdtemp(prefix="narwhal-instructions-"))
    port = free_port()
    (tmp / "narwhal.toml").write_text(config(tree, port, prefill, decode, tmp / "journal.jsonl", args.fsync))
    env = dict(os.environ, PYTHONHASHSEED=str(seed), PYTHONPATH=str(tree))
    out = tmp / "callgrind.out"
    cmd = ["setarch", "-R", "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
           *(["--cache-sim=yes"] if args.cache_sim else []),
           sys.executable, "-m", "narwhal.cli", "serve", "--config", str(tmp / "narwhal.toml"), "--runtime", runtime]
    with open(tmp / "stderr", "w") as stderr:
        router = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                client = Client(port, args.request)
                break
            except OSError:
                if router.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((tmp / "stderr").read_text()[-2000:]) from None
                time.sleep(0.2)
        for _ in range(args.warm):
            client.request()
        clients = [client] + [Client(port, args.request) for _ in range(args.concurrency - 1)]
        for c in clients[1:]:
            c.request()  # each connection's first request outside the window
        control(router.pid, "-i", "on")
        control(router.pid, "-z")
        for _ in range(args.n // args.concurrency):
            for c in clients:  # all in flight at once, then every answer read
                c.send()
            for c in clients:
                c.answer()
        control(router.pid, "-d")
        control(router.pid, "-i", "off")
    finally:
        router.send_signal(signal.SIGTERM)
        try:
            router.wait(60)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait()
    dump = min(tmp.glob("callgrind.out.*"))  # the dump of the window (the one at exit counts nothing)
    prefix = json.loads((tmp / "journal.jsonl").read_text().partition("\n")[0])["rid"][:-10]
    names: list[str] = []
    totals: list[int] = []
    for line in dump.read_text().splitlines():
        if line.startswith("events:"):
            names = line.split()[1:]
        elif line.startswith(("summary:", "totals:")):
            totals = [int(v) for v in line.split()[1:]]
    if args.keep:
        shutil.copy(dump, Path(args.keep) / f"{tree.name}-{runtime}-{seed}.callgrind")
    shutil.rmtree(tmp, ignore_errors=True)
    counted = args.n // args.concurrency * args.concurrency
    return {name: total / counted for name, total in zip(names, totals)}, prefix


def estimated_cycles(events: dict[str, float]) -> float:
    """Cycles as KCachegrind estimates them from a cache simulation: an L1 miss ~10, a last-level miss ~100."""
    l1 = events["I1mr"] + events["D1mr"] + events["D1mw"]
    last = events["ILmr"] + events["DLmr"] + events["DLmw"]
    return events["Ir"] + 10 * l1 + 100 * last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--tree", action="append", required=True, type=lambda p: Path(p).resolve())
    parser.add_argument("--runtime", action="append", choices=("asyncio", "trio"))
    parser.add_argument("--seeds", default="1,2,3", help="PYTHONHASHSEED values, one run each")
    parser.add_argument("-n", type=int, default=400, help="requests counted")
    parser.add_argument("--prompt-bytes", type=int, default=1024, help="the prompt's size (default: 1 KB)")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="requests in flight in the counted window: that many connections send, then all read")
    parser.add_argument("--warm", type=int, default=100, help="requests before counting")
    parser.add_argument("--fsync", choices=("interval", "never", "always"), help="journal.fsync (default: the tree's)")
    parser.add_argument("--keep", help="a directory for the callgrind files")
    parser.add_argument("--cache-sim", action="store_true",
                        help="simulate the caches too: L1 (instruction, data) and last-level misses, estimated cycles")
    args = parser.parse_args()
    args.request = request_bytes(args.prompt_bytes)
    engines = [start_engine("prefill"), start_engine("decode")]
    try:
        for runtime in args.runtime or ["asyncio", "trio"]:
            for tree in args.tree:
                for seed in (int(s) for s in args.seeds.split(",")):
                    events, prefix = window(tree, runtime, seed, args, engines[0][1], engines[1][1])
                    digits = len(prefix) - len(prefix.rstrip("0123456789"))
                    slow = f"  (rid prefix {prefix}: {digits} digits at its end)" if digits >= SLOW_DIGITS else ""
                    caches = ""
                    if args.cache_sim:
                        caches = (f" I1mr={events['I1mr'] / 1000:.2f}k D1m={(events['D1mr'] + events['D1mw']) / 1000:.2f}k"
                                  f" LLm={(events['ILmr'] + events['DLmr'] + events['DLmw']) / 1000:.2f}k"
                                  f" est.cycles={estimated_cycles(events) / 1000:.1f}k")
                    print(f"{tree.name:12s} {runtime:8s} seed={seed} instructions/request={events['Ir'] / 1000:.1f}k"
                          f"{caches}{slow}", flush=True)
    finally:
        for proc, _ in engines:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
