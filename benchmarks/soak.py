"""A bounded soak run: a real router process in front of faulty simulated engines.

Starts simulated engines as processes (``SimProcess``) with about 5 % of
requests hit by mixed faults — errors, dropped connections, omitted KV params
on the prefill engines; errors, drops, mid-stream stalls and mid-stream drops
on the decode engines — and ``narwhal serve`` as a subprocess (``--runtime``,
trio by default). Then drives mixed traffic for ``--seconds``: non-streaming
and streaming, ``/v1/completions`` and ``/v1/chat/completions``, and some
clients that hang up early, from ``--concurrency`` closed-loop workers.

At the end it reports:

* requests sent, and terminal records in the journal (they must be equal,
  one per request, each the last record of its rid),
* terminal records by kind, and the journal's KV outcomes by kind,
* expired KV on the simulated prefill engines (after waiting one lease, so a
  leak shows as expired) and KV still held,
* the router's RSS at start, after warm-up, at its peak (VmHWM) and at the
  end (read from ``/proc/<pid>/status``), and whether memory stayed flat:
  the end RSS within ``--flat-tolerance`` (10 %) of the RSS after warm-up.

Everything listens on 127.0.0.1 and the run stops by itself. Exit status 0
when terminal records equal requests and memory was flat, 1 otherwise. Not
run in CI::

    python benchmarks/soak.py [--seconds 180] [--runtime trio|asyncio] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from narwhal_core.router import NOTHING_HELD  # noqa: E402
from narwhal_sim.testing import SimProcess  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROMPTS = [
    "Narwhals are medium-sized toothed whales that live year-round in the Arctic.",
    "The tusk of a narwhal is an elongated left canine tooth.",
    "Explain prefill and decode disaggregation in two sentences.",
    "Write a haiku about sea ice.",
]


# --------------------------------------------------------------------- engines


def fault_mix(role: str, rate: float) -> dict[str, Any]:
    """About ``rate`` of an engine's requests hit by one of its role's faults."""
    if role == "prefill":
        share = rate / 3
        return {"error_rate": share, "drop_rate": share, "omit_kv_params_rate": share}
    share = rate / 4
    return {
        "error_rate": share,
        "drop_rate": share,
        "stall_after_chunks": 2, "stall_rate": share,
        "drop_after_chunks": 3, "drop_after_chunks_rate": share,
    }


def start_engines(args: argparse.Namespace) -> tuple[list[SimProcess], list[SimProcess]]:
    prefill, decode = [], []
    for i in range(args.prefill):
        prefill.append(SimProcess(role="prefill", speed=args.speed, lease_s=args.lease_s, seed=100 + i,
                                  faults=fault_mix("prefill", args.fault_rate)).start())
    for i in range(args.decode):
        decode.append(SimProcess(role="decode", speed=args.speed, lease_s=args.lease_s, seed=200 + i,
                                 faults=fault_mix("decode", args.fault_rate)).start())
    return prefill, decode


# ---------------------------------------------------------------------- router


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    return "[" + ", ".join(_toml(v) for v in value) + "]"


def write_config(path: Path, journal: Path, prefill: list[str], decode: list[str], args: argparse.Namespace) -> None:
    sections: dict[str, dict[str, Any]] = {
        "model": {"name": MODEL},
        "ingress": {"listen": "127.0.0.1:0", "auth": "none", "busy_poll_us": args.busy_poll_us},
        "engine": {
            "prefill": prefill, "decode": decode, "kv_release": args.kv_release,
            # Stalled engines must be given up on well within the run.
            "prefill_timeout_s": 5.0, "decode_timeout_s": 5.0, "stream_idle_timeout_s": 2.0,
        },
        "admission": {"max_inflight": max(4, args.concurrency), "queue_size": args.concurrency * 4},
        "health": {"probe_interval_s": 1.0, "probe_timeout_s": 1.0},
        "journal": {"path": str(journal), "fsync": "interval"},
        "shutdown": {"grace_s": 15.0},
    }
    lines = []
    for name, keys in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml(v)}" for k, v in keys.items()]
        lines.append("")
    path.write_text("\n".join(lines))


class Router:
    """``narwhal serve`` as a subprocess; stderr is read line by line."""

    def __init__(self, config: Path, runtime: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "narwhal.cli", "serve", "--config", str(config), "--runtime", runtime],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        self.events: list[dict[str, Any]] = []
        self._listening = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._listening.wait(20):
            self.proc.kill()
            raise SystemExit(f"router did not start: {self.events}")
        listening = next(e for e in self.events if e.get("event") == "listening")
        self.url = f"http://{listening['host']}:{listening['port']}"
        self.address = (str(listening["host"]), int(listening["port"]))

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            try:
                event = json.loads(raw)
            except ValueError:
                event = {"event": "text", "line": raw.decode("utf-8", "replace").rstrip()}
            if isinstance(event, dict):
                self.events.append(event)
                if event.get("event") == "listening":
                    self._listening.set()

    def rss_kib(self) -> tuple[int, int]:
        """(VmRSS, VmHWM) in KiB."""
        values = {}
        with open(f"/proc/{self.proc.pid}/status") as status:
            for line in status:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    name, amount = line.split(":", 1)
                    values[name] = int(amount.split()[0])
        return values["VmRSS"], values["VmHWM"]

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                return -9
        return self.proc.returncode


# --------------------------------------------------------------------- traffic


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent = 0
        self.kinds: collections.Counter[str] = collections.Counter()
        self.statuses: collections.Counter[str] = collections.Counter()
        self.client_errors: collections.Counter[str] = collections.Counter()

    def add(self, kind: str, status: str) -> None:
        with self.lock:
            self.sent += 1
            self.kinds[kind] += 1
            self.statuses[status] += 1


def _body(rng: random.Random, route: str, stream: bool) -> dict[str, Any]:
    text = rng.choice(PROMPTS)
    out: dict[str, Any] = {"model": MODEL, "max_tokens": rng.choice((4, 8, 16, 32))}
    if route == "/v1/completions":
        out["prompt"] = text
    else:
        out["messages"] = [{"role": "user", "content": text}]
    if stream:
        out["stream"] = True
        if rng.random() < 0.5:
            out["stream_options"] = {"include_usage": True}
    return out


def _disconnect(address: tuple[str, int], route: str, body: dict[str, Any], rng: random.Random) -> None:
    """Send a request on a raw socket and hang up after a short, random while."""
    data = json.dumps(body).encode()
    head = (f"POST {route} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(head + data)
        sock.settimeout(rng.uniform(0.001, 0.2))
        try:
            sock.recv(4096)
        except (TimeoutError, OSError):
            pass


def worker(index: int, args: argparse.Namespace, address: tuple[str, int], url: str, deadline: float,
           tally: Tally) -> None:
    rng = random.Random(args.seed * 1000 + index)
    with httpx.Client(base_url=url, timeout=30.0) as client:
        while time.monotonic() < deadline:
            route = rng.choice(("/v1/completions", "/v1/chat/completions"))
            stream = rng.random() < 0.5
            body = _body(rng, route, stream)
            kind = f"{'chat' if 'chat' in route else 'completions'}-{'stream' if stream else 'whole'}"
            try:
                if rng.random() < args.disconnect_rate:
                    _disconnect(address, route, body, rng)
                    tally.add("disconnect", "hung_up")
                elif stream:
                    with client.stream("POST", route, json=body) as response:
                        for _ in response.iter_raw():
                            pass
                    tally.add(kind, str(response.status_code))
                else:
                    response = client.post(route, json=body)
                    tally.add(kind, str(response.status_code))
            except httpx.HTTPError as exc:
                # The request was sent (the router journals it); only the answer broke.
                tally.add(kind, type(exc).__name__)
            except OSError as exc:
                with tally.lock:
                    tally.client_errors[type(exc).__name__] += 1


# --------------------------------------------------------------------- results


def read_journal(path: Path) -> tuple[list[dict[str, Any]], int]:
    records, torn = [], 0
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            torn += 1
    return records, torn


def journal_report(records: list[dict[str, Any]]) -> dict[str, Any]:
    terminals: dict[str, dict[str, Any]] = {}
    problems = 0
    for record in records:
        rid = record["rid"]
        if rid in terminals:
            problems += 1  # a record after the terminal one, or a second terminal
        if record.get("terminal") is not None:
            terminals[rid] = record
    unfinished = {r["rid"] for r in records} - set(terminals)
    kinds = collections.Counter(r["terminal"] for r in terminals.values())
    kvs = [leg["kv"] for r in terminals.values() for leg in r["legs"] if leg.get("kv")]
    kv = collections.Counter(k["outcome"] for k in kvs)
    return {
        "terminal_records": len(terminals),
        "terminal_by_kind": dict(sorted(kinds.items())),
        "journal_kv_outcomes": dict(sorted(kv.items())),
        # Releases the abort endpoint answered with "held nothing".
        "journal_kv_nothing_held": sum(k["error"] == NOTHING_HELD for k in kvs),
        "rids_without_terminal": len(unfinished),
        "records_after_terminal": problems,
    }


def kv_accounting(
    journal: dict[str, int], sims: list[dict[str, Any]], nothing_held: int, told: bool
) -> dict[str, Any]:
    """The journal's KV outcomes against the engines' own counts.

    Every block the journal names was held by an engine, and a block it
    does not name must have expired there (the documented race: a client
    leaves while the prefill answer is in flight), or still be held. The
    journal may say ``released`` for a block its engine counts ``pulled``
    (the other documented window: a decode engine pulled, then its leg
    failed before its head; the release is a no-op), never the reverse.
    When the engines ``told`` (``abort_endpoint``: their answer says whether
    they held anything), each such block's record must say the engine held
    nothing (``nothing_held`` of them), and only blocks that were pulled,
    expired or released some other way (a decode engine frees the blocks of
    a request that ends before its pull) may.
    """
    journal_total = sum(journal.values())
    pulled = sum(s["kv_pulled"] for s in sims)
    ended = pulled + sum(s["kv_released"] + s["kv_expired"] + s["kv_held"] for s in sims)
    unnamed = ended - journal_total
    pulled_journalled_released = pulled - journal.get("pulled", 0)
    return {
        "kv_not_in_journal": unnamed,
        "kv_pulled_journalled_released": pulled_journalled_released,
        "kv_accounted": (
            0 <= unnamed <= sum(s["kv_expired"] + s["kv_held"] for s in sims)
            and pulled_journalled_released >= 0
            and (not told or pulled_journalled_released <= nothing_held
                 <= pulled_journalled_released + sum(s["kv_expired"] + s["kv_released"] for s in sims))
        ),
    }


def wait_idle(url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = httpx.get(url + "/metrics", timeout=5).text
        except httpx.HTTPError:
            return False
        values = {}
        for line in text.splitlines():
            if line.startswith(("narwhal_inflight_requests ", "narwhal_queued_requests ")):
                name, value = line.split()
                values[name] = float(value)
        if values and all(v == 0 for v in values.values()):
            return True
        time.sleep(0.2)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="traffic duration (default 180)")
    parser.add_argument("--runtime", choices=("trio", "asyncio"), default="trio")
    parser.add_argument("--concurrency", type=int, default=16, help="closed-loop client workers")
    parser.add_argument("--prefill", type=int, default=2, help="prefill engines")
    parser.add_argument("--decode", type=int, default=2, help="decode engines")
    parser.add_argument("--speed", type=float, default=20.0, help="simulator speed (modelled time / speed)")
    parser.add_argument("--fault-rate", type=float, default=0.05, help="share of engine requests hit by a fault")
    parser.add_argument("--disconnect-rate", type=float, default=0.03, help="share of clients that hang up early")
    parser.add_argument("--kv-release", choices=("abort_endpoint", "decode_abort", "lease"),
                        default="abort_endpoint")
    parser.add_argument("--lease-s", type=float, default=5.0,
                        help="engines' KV lease; the report waits one lease so leaks show as expired")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds of traffic before the reference RSS (default: 15%% of --seconds)")
    parser.add_argument("--flat-tolerance", type=float, default=0.10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--busy-poll-us", type=int, default=0, help="the router's ingress.busy_poll_us (default 0)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object only")
    args = parser.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else max(3.0, 0.15 * args.seconds)

    workdir = Path(tempfile.mkdtemp(prefix="narwhal-soak-"))
    journal = workdir / "journal.jsonl"
    config = workdir / "narwhal.toml"
    prefill, decode = start_engines(args)
    router: Router | None = None
    try:
        write_config(config, journal, [p.url for p in prefill], [d.url for d in decode], args)
        router = Router(config, args.runtime)
        rss_start, _ = router.rss_kib()
        tally = Tally()
        samples: list[tuple[float, int]] = []
        started = time.monotonic()
        deadline = started + args.seconds
        workers = [
            threading.Thread(target=worker, args=(i, args, router.address, router.url, deadline, tally), daemon=True)
            for i in range(args.concurrency)
        ]
        for thread in workers:
            thread.start()
        rss_warm: int | None = None
        while any(t.is_alive() for t in workers):
            time.sleep(1.0)
            rss, _ = router.rss_kib()
            elapsed = time.monotonic() - started
            samples.append((elapsed, rss))
            if rss_warm is None and elapsed >= warmup:
                rss_warm = rss
            if not args.json and int(elapsed) % 10 == 0:
                print(f"  t={elapsed:5.0f}s sent={tally.sent} rss={rss / 1024:.1f} MiB", flush=True)
        for thread in workers:
            thread.join(60)
        idle = wait_idle(router.url, 60)
        rss_end, rss_peak = router.rss_kib()
        if rss_warm is None:
            rss_warm = samples[0][1] if samples else rss_start
        exit_code = router.stop()
        # Leaked KV is held until its lease runs out: wait one lease so it shows as expired.
        time.sleep(args.lease_s + 1.0)
        records, torn = read_journal(journal)
        report = journal_report(records)
        sims = [p.stats() for p in prefill]
        report = {
            "runtime": args.runtime,
            "seconds": args.seconds,
            "concurrency": args.concurrency,
            "kv_release": args.kv_release,
            "requests_sent": tally.sent,
            "requests_by_kind": dict(sorted(tally.kinds.items())),
            "client_statuses": dict(sorted(tally.statuses.items())),
            "client_send_errors": dict(tally.client_errors),
            **report,
            "terminal_equals_sent": report["terminal_records"] == tally.sent,
            "torn_journal_lines": torn,
            "kv_expired": sum(s["kv_expired"] for s in sims),
            "kv_held_at_end": sum(s["kv_held"] for s in sims),
            "kv_released_on_engines": sum(s["kv_released"] for s in sims),
            "kv_pulled_on_engines": sum(s["kv_pulled"] for s in sims),
            **kv_accounting(report["journal_kv_outcomes"], sims, report["journal_kv_nothing_held"],
                            args.kv_release == "abort_endpoint"),
            "engine_faults": {
                k: sum(s.get(k, 0) for s in [p.stats() for p in prefill + decode])
                for k in ("faults_error", "faults_drop", "faults_stall", "faults_drop_after_chunks",
                          "faults_omit_kv_params")
            },
            "router_idle_after_traffic": idle,
            "router_exit_code": exit_code,
            "rss_mib": {
                "start": round(rss_start / 1024, 1),
                "after_warmup": round(rss_warm / 1024, 1),
                "peak": round(rss_peak / 1024, 1),
                "end": round(rss_end / 1024, 1),
            },
            "memory_flat": rss_end <= rss_warm * (1 + args.flat_tolerance),
            "rate_per_s": round(tally.sent / args.seconds, 1),
            "workdir": str(workdir),
        }
        if args.json:
            print(json.dumps(report))
        else:
            print(json.dumps(report, indent=2))
        ok = report["terminal_equals_sent"] and report["memory_flat"] and report["kv_accounted"] and exit_code == 0
        return 0 if ok else 1
    finally:
        if router is not None and router.proc.poll() is None:
            router.proc.kill()
        for sim in prefill + decode:
            sim.stop()


if __name__ == "__main__":
    sys.exit(main())
