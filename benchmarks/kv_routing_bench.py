"""KV-event routing side by side: Narwhal's ``kv`` and ``prefix``, vLLM Router's ``kv_aware`` and ``cache_aware``.

One command, bounded in time, every listener on loopback::

    python benchmarks/kv_routing_bench.py                  # 4 targets x 2 KV pressures at the knee (~20 min)
    python benchmarks/kv_routing_bench.py --duration 60    # shorter runs (~10 min)

It is ``routing_bench.py`` (same fleet, same trace window, same knee rate,
same figures: ``narwhal bench`` replays, every figure in simulated time)
with what KV-event routing needs on top:

* **the modelled pace** (``--speed``, default 1, where ``routing_bench.py``
  runs at 4): an engine started with ``--tokenizer`` tokenizes each prompt on
  its serving loop (some 2 µs per token here: 50 ms for a 25k-token prompt),
  time in which it runs no step, and vLLM Router's ``kv_aware`` adds a
  ``/tokenize`` per request. At 4x that cost counts four times in simulated
  time (in a short run at 4x every target's TTFT p50 tripled); at 1x it is
  what a real engine's API process spends, though a real one tokenizes
  beside the engine core rather than in its way;

* **a tokenizer both sides load**: :func:`build_tokenizer` writes a
  Hugging Face ``tokenizer.json`` to the work directory. The trace's prompt
  text is lower-case letters and spaces with a ``[block N]`` head per 2,048
  characters (docs/bench.md), four characters to a token in the trace's
  own count; the tokenizer cuts letters and spaces into pieces of four and
  every other character into one, with a word-level vocabulary holding
  every such piece (552k entries, 12 MB, 0.6 s to load), so a prompt's
  token count is the trace's (+1 %) and no trace text maps to the unknown
  token (two different prompts never share ids they should not). The
  engines get it as ``--tokenizer``, Narwhal as ``[model] tokenizer``;
* **engines that publish KV events** (docs/simulator.md, "KV events"):
  each engine listens on a loopback address of its own (``127.0.0.<n>``,
  from ``--host-base``) so that one endpoint template names every engine's
  stream, as on a real fleet (``tcp://{host}:5557``). The simulator's PUB
  socket binds only for a ``*`` host (all interfaces) or a free port, so
  it binds a free port on its own address and a :class:`KvRelay` in this
  process republishes it at ``tcp://<host>:--kv-port``; the replay socket
  binds ``tcp://<host>:--kv-port+1`` in the engine itself;
* **vLLM Router's layout**: vLLM Router 0.1.17 reads each event as a msgpack
  map tagged by ``"type"`` (``src/kv_index/wire.rs`` in vllm-project/router;
  fed the simulator's arrays it logs ``KV event must be a tagged map`` and
  indexes nothing), the layout of vLLM 0.28 (``KVCacheEvent`` without
  ``array_like``: vllm-project/vllm#42892), while the simulator writes the array layout of earlier
  vLLM (``b4e69e0af33f``), which Narwhal reads. The relay also publishes
  every batch re-encoded as maps at ``tcp://<host>:--kv-port+2``: the same
  events, in the layout vLLM Router reads. It has no replay in PD mode
  (``--kv-event-replay-source`` goes with ``--kv-event-source``, the
  non-PD sources);
* **KV pressure** (``--pressures``): the prefill pool's KV (``--num-gpu-blocks``
  x ``--prefill``) as a multiple of the run's working set, the prompt tokens
  of its distinct trace blocks (512 tokens each): ``high`` 0.25 and ``low``
  2.0, never fewer blocks per engine than the longest admitted prompt needs
  (:func:`pool_blocks`). At the knee the 120 s window holds 3.49M tokens of
  distinct blocks: ``high`` is 13,626 blocks per engine, where one LRU cache of
  the pool could hit 12 % of the prompt tokens against 31 % without a limit
  (``routing_bound.py``; ``routing_bench.py``'s 28,000 blocks: 25 %), and
  ``low`` 109,008 (31 %: nothing is evicted that would hit).

Targets (``--targets``): ``narwhal-kv`` (``routing.policy = "kv"``, with
``[model] tokenizer``, ``[engine] kv_events`` and ``kv_events_replay``: a
Narwhal that refuses this config is reported as skipped),
``narwhal-prefix`` (the approximate index), ``vllm-pd-kv_aware``
(``vllm-router --policy kv_aware --pd-kv-events URL=ENDPOINT`` per prefill
engine; it tokenizes by asking a prefill engine's ``/v1/completions/render``,
which the simulator does not serve, then ``/tokenize``) and
``vllm-pd-cache_aware`` (its best policy without events in
``routing_bench.py``'s runs).

**Two workers** (``--targets narwhal-kv-w2,narwhal-prefix-w2``, not run by
default): the same two Narwhal configurations as two worker processes
(``ingress.workers = 2``, docs/operate.md, "Workers"). Each worker has its
own router: with ``prefix`` its index holds only the prompts that worker
sent, about half of what each engine caches, while with ``kv`` every worker
reads every prefill engine's events and knows all of it. It is the case
KV events exist for (several router processes or replicas in front of one
fleet); the issue's targets are for one process and are judged on the
default targets. Router CPU counts the supervisor and its workers.

Per Narwhal run it also reads the journal (docs/operate.md): how many
decisions the ``kv`` index made and how many the approximate fallback, and
the prompt tokens the chosen engines held by that index, so a ``kv`` row
that only ever fell back shows it. Writes ``kv_routing.json``,
``kv_routing_summary.json``, ``kv_routing.md`` and ``ttft_cdf_<pressure>.png``
to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import routing_bench as rb  # noqa: E402
from router_bench import Proc, ensure_peers, log  # noqa: E402
from routing_report import _n, markdown, plot  # noqa: E402

TARGETS = ("narwhal-kv", "narwhal-prefix", "vllm-pd-kv_aware", "vllm-pd-cache_aware")
#: Asked for by name only (``--targets``): Narwhal as two worker processes (``ingress.workers = 2``), each
#: with its own router and index, each seeing about half of the requests (module doc, "Two workers").
WORKER_TARGETS = ("narwhal-kv-w2", "narwhal-prefix-w2")
#: The issue's targets: kv's TTFT p90 over prefix's at high pressure, its largest loss at low pressure,
#: and against vLLM Router's kv_aware (TTFT p90 ratio, goodput ratio).
KV_OVER_PREFIX_HIGH = 1 / 1.5
KV_LOSS_LOW = 1.05
KV_OVER_VLLM_P90 = 0.7
KV_OVER_VLLM_GOODPUT = 1.2


# ---------------------------------------------------------------------------- the tokenizer


def build_tokenizer(directory: Path) -> Path:
    """A ``tokenizer.json`` in ``directory`` cutting the trace's text four characters to a token (module doc)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    if path.exists():
        return directory
    vocab = {"[UNK]": 0}
    for ch in "0123456789[]":
        vocab[ch] = len(vocab)
    for n in range(1, 5):
        for piece in itertools.product("abcdefghijklmnopqrstuvwxyz ", repeat=n):
            vocab["".join(piece)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[a-z ]{1,4}|[^a-z ]"), behavior="isolated")
    tok.save(str(path))
    return directory


# ---------------------------------------------------------------------------- the relay


def as_maps(payload: bytes) -> bytes:
    """A ``KVEventBatch`` with array events re-encoded with map events (vLLM 0.28's layout, module doc)."""
    import msgpack

    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    events = []
    for e in batch[1]:
        if isinstance(e, dict):  # (a simulated family that sends maps already, from 0.24.0 on)
            events.append(e)
            continue
        tag, fields = e[0], list(e[1:])
        if tag == "BlockStored":
            names = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
            events.append({"type": tag, **dict(zip(names, fields + [None] * (len(names) - len(fields))))})
        elif tag == "BlockRemoved":
            events.append({"type": tag, "block_hashes": fields[0], "medium": fields[1] if len(fields) > 1 else None})
        else:
            events.append({"type": tag})
    packed: bytes = msgpack.packb([batch[0], events, *batch[2:]], use_bin_type=True)
    return packed


class KvRelay:
    """One engine's event stream republished at fixed loopback endpoints: as sent, and as maps."""

    def __init__(self, source: str, as_sent: str, maps: str) -> None:
        import zmq

        ctx = zmq.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.connect(source)
        self._pubs = []
        for endpoint in (as_sent, maps):
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, 0)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(endpoint)
            self._pubs.append(pub)
        self.batches = 0
        self.problems = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-relay {as_sent}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(200):
                continue
            frames = self._sub.recv_multipart()
            self._pubs[0].send_multipart(frames)
            try:
                self._pubs[1].send_multipart([frames[0], frames[1], as_maps(frames[2])])
            except Exception:  # noqa: BLE001 - a batch it cannot re-encode is counted, not fatal
                self.problems += 1
            self.batches += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for sock in (self._sub, *self._pubs):
            sock.close(0)


# ---------------------------------------------------------------------------- the fleet


class KvFleet(rb.Fleet):
    """The routing bench's fleet, each engine on its own loopback address, with a tokenizer and KV events."""

    def __init__(self, args: argparse.Namespace, tokenizer: Path) -> None:
        super().__init__(args)
        self.tokenizer = tokenizer
        self.relays: list[KvRelay] = []

    def host(self, role: str, index: int) -> str:
        return f"127.0.0.{self.args.host_base + index + (self.args.prefill if role == 'decode' else 0)}"

    def engine_options(self, role: str, index: int) -> dict[str, Any]:
        host = self.host(role, index)
        return {**super().engine_options(role, index), "host": host, "tokenizer": str(self.tokenizer),
                "block_size": rb.BLOCK_TOKENS, "kv_events_endpoint": f"tcp://{host}:0",
                "kv_events_replay_endpoint": f"tcp://{host}:{self.args.kv_port + 1}"}  # fmt: skip

    def start(self) -> None:
        super().start()
        port = self.args.kv_port
        for engine in self.engines:
            source = engine.stats()["kv_events_endpoint"]
            self.relays.append(KvRelay(source, f"tcp://{engine.host}:{port}", f"tcp://{engine.host}:{port + 2}"))

    def stop(self) -> None:
        for relay in self.relays:
            relay.close()
        super().stop()

    def batches(self) -> int:
        return sum(r.batches for r in self.relays)


def pool_blocks(ratio: float, requests: list[Any], prefill: int) -> int:
    """KV blocks per engine for a prefill pool holding ``ratio`` x the requests' distinct trace blocks."""
    distinct = {block for r in requests for block in r.hash_ids}
    longest = max((r.input_length for r in requests if r.input_length < rb.MAX_MODEL_LEN), default=0)
    wanted = ratio * len(distinct) * 512 / rb.BLOCK_TOKENS / prefill
    return max(int(wanted + 0.5), -(-longest // rb.BLOCK_TOKENS) + 64)


def register_targets(args: argparse.Namespace, tokenizer: Path) -> None:
    """The KV targets' config (Narwhal) and arguments (vLLM Router), in ``routing_bench``'s tables."""
    port = args.kv_port
    rb.NARWHAL_FLEET_CONFIGS["narwhal-kv"] = lambda fleet: {
        "model": {"tokenizer": str(tokenizer)},
        "engine": {"kv_events": f"tcp://{{host}}:{port}", "kv_events_replay": f"tcp://{{host}}:{port + 1}"},
        "routing": {"policy": "kv", "mode": "always"},
    }
    two = {"ingress": {"workers": 2}}
    rb.NARWHAL_FLEET_CONFIGS["narwhal-kv-w2"] = lambda fleet: {**rb.NARWHAL_FLEET_CONFIGS["narwhal-kv"](fleet), **two}
    rb.NARWHAL_FLEET_CONFIGS["narwhal-prefix-w2"] = lambda fleet: {**rb.NARWHAL_CONFIGS["narwhal-prefix"], **two}
    rb.VLLM_FLEET_ARGS["vllm-pd-kv_aware"] = lambda fleet: [
        arg
        for e in fleet.engines
        if e.role == "prefill"
        for arg in ("--pd-kv-events", f"{e.url}=tcp://{e.host}:{port + 2}")
    ]


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kv_routing_bench.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--targets", default=",".join(TARGETS),
                   help="comma-separated, from: " + ", ".join(TARGETS + WORKER_TARGETS))
    p.add_argument("--pressures", default="high=0.25,low=2",
                   help="name=the prefill pool's KV as a multiple of the run's distinct prompt blocks, comma-separated")
    p.add_argument("--rate", type=float, default=0.5, help="the knee: multiple of the trace window's own rate")
    p.add_argument("--trace", default=rb.TRACE)
    p.add_argument("--trace-offset", type=int, default=3000)
    p.add_argument("--duration", type=float, default=120.0, help="simulated seconds of arrivals per run")
    p.add_argument("--max-requests", type=int, default=400)
    p.add_argument("--speed", type=float, default=1.0,
                   help="engines and arrivals this many times the modelled pace (the engines tokenize on their "
                        "serving loop: a faster pace multiplies that cost, module doc)")
    p.add_argument("--prefill", type=int, default=4)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-itl-ms", type=float, default=100.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--runtime", default="trio", choices=("trio", "asyncio"))
    p.add_argument("--start-timeout", type=float, default=30.0)
    p.add_argument("--time-limit", type=float, default=1800.0, help="wall seconds before everything is stopped")
    p.add_argument("--host-base", type=int, default=40, help="engines listen on 127.0.0.<host-base + i>")
    p.add_argument("--kv-port", type=int, default=5557,
                   help="events at tcp://<engine host>:PORT, replay at PORT+1, vLLM Router's layout at PORT+2")
    p.add_argument("--peers-bin", default=None, help="the bin directory holding vllm-router (default: the peers venv)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.num_gpu_blocks = 0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.loadavg_start = os.getloadavg()
    targets = [t for t in args.targets.split(",") if t]
    if unknown := [t for t in targets if t not in TARGETS + WORKER_TARGETS]:
        print(f"kv_routing_bench: unknown targets {unknown}; known: {', '.join(TARGETS + WORKER_TARGETS)}",
              file=sys.stderr)
        return 2
    pressures = [(name, float(x)) for name, _, x in (p.partition("=") for p in args.pressures.split(",") if p)]
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="kv_routing_bench-"))
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(work / "tokenizer")
    register_targets(args, tokenizer)

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGALRM, stop)
    signal.alarm(int(args.time_limit))
    rows: list[dict[str, Any]] = []
    try:
        if args.peers_bin:
            peers: tuple[Path | None, str] = (Path(args.peers_bin), "")
        else:
            peers = ensure_peers(work) if any(t.startswith("vllm") for t in targets) else (None, "not asked for")
        window = rb.trace_window(args, work)
        requests = rb.workload_requests("trace", window, args.rate, args)
        for pressure, share in pressures:
            blocks = args.num_gpu_blocks = pool_blocks(share, requests, args.prefill)
            fleet = KvFleet(args, tokenizer)
            try:
                fleet.start()
                log(f"fleet: {args.prefill}P{args.decode}D, {blocks} blocks each ({pressure} KV pressure: the prefill "
                    f"pool holds {share:g}x the run's distinct blocks); {work}")  # fmt: skip
                for name in targets:
                    before, journal = fleet.batches(), work / f"{name}.journal.jsonl"
                    if name in WORKER_TARGETS:
                        # One journal per worker (docs/operate.md, "Workers"): .w0, .w1 before the suffix.
                        journals = [journal.with_suffix(f".w{k}.jsonl") for k in (0, 1)]
                    else:
                        journals = [journal]
                    offsets = [j.stat().st_size if j.exists() else 0 for j in journals]
                    row = rb.run_one(name, "trace", pressure, args.rate, fleet, window, work, args, peers)
                    row.update(pressure=pressure, pool_over_working_set=share, num_gpu_blocks=blocks,
                               kv_batches=fleet.batches() - before,
                               kv_relay_problems=sum(r.problems for r in fleet.relays))  # fmt: skip
                    found = [journal_summary(j, o) for j, o in zip(journals, offsets) if j.exists()]
                    if rb.is_narwhal(name) and found:
                        row["journal"] = merged(found)
                    if name == "narwhal-kv" and "refused" in row.get("error", ""):
                        row["error"] = "skipped: this narwhal refuses routing.policy = \"kv\" (" + row["error"] + ")"
                    rows.append(row)
            finally:
                Proc.stop_all()
                fleet.stop()
    except KeyboardInterrupt as exc:
        log(f"stopped ({str(exc) or 'Ctrl-C'}): reporting the runs done")
    finally:
        signal.alarm(0)
        Proc.stop_all()
    return report(rows, args, work, [p for p, _ in pressures])


def journal_summary(path: Path, offset: int) -> dict[str, Any]:
    """Which index decided each request of a Narwhal run (its journal from byte ``offset``): ``kv`` (the
    engines' events) or ``approximate`` (the fallback; docs/operate.md), and the prompt tokens the chosen
    prefill engine held by that index."""
    decided: dict[str, int] = {}
    matched = 0
    with open(path, "rb") as f:
        f.seek(offset)
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            routing = record.get("routing") if record.get("terminal") else None
            if not routing:
                continue
            index = routing.get("index", "-")
            decided[index] = decided.get(index, 0) + 1
            chosen = [c for c in routing.get("candidates", ()) if c.get("engine") == routing.get("prefill")]
            matched += sum(c.get("matched_tokens") or 0 for c in chosen)
    return {"decided_by": decided, "matched_tokens": matched}


def merged(summaries: Any) -> dict[str, Any]:
    """Journal summaries (:func:`journal_summary`) of several workers, added up."""
    decided: dict[str, int] = {}
    matched = 0
    for summary in summaries:
        for index, n in summary["decided_by"].items():
            decided[index] = decided.get(index, 0) + n
        matched += summary["matched_tokens"]
    return {"decided_by": decided, "matched_tokens": matched}


def blocks_of(rows: list[dict[str, Any]]) -> str:
    return ", ".join(sorted({f"{r['pressure']} {r['num_gpu_blocks']}" for r in rows if "num_gpu_blocks" in r}))


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def verdicts(rows: list[dict[str, Any]], pressures: list[str]) -> str:
    """The issue's targets per pressure, MET / NOT MET / not measured."""
    out = []
    for pressure in pressures:
        got = {r["target"]: r for r in rows if r["pressure"] == pressure and "error" not in r}
        kv, prefix, vkv = got.get("narwhal-kv"), got.get("narwhal-prefix"), got.get("vllm-pd-kv_aware")
        out.append(f"{pressure} KV pressure:")
        p90 = lambda r: r["ttft_ms"]["p90"]  # noqa: E731
        kv2, prefix2 = got.get("narwhal-kv-w2"), got.get("narwhal-prefix-w2")
        if kv2 is not None and prefix2 is not None:
            out.append(f"  two workers: TTFT p90 kv / prefix {_n(p90(kv2))} / {_n(p90(prefix2))} ms = "
                       f"{_n(ratio(p90(kv2), p90(prefix2)), '.2f')}x, goodput {kv2['goodput']:.3f} / "
                       f"{prefix2['goodput']:.3f} = {_n(ratio(kv2['goodput'], prefix2['goodput']), '.2f')}x, "
                       f"hit / bound {_n(kv2.get('hit_over_bound'), '.2f')} / {_n(prefix2.get('hit_over_bound'), '.2f')} "
                       "(not one of the issue's targets, which are for one router process)")
        if kv is None:
            out.append("  narwhal-kv not measured: every target about it is still to be measured")
            continue
        journal = kv.get("journal", {})
        out.append(f"  narwhal-kv decisions by index: {journal.get('decided_by', '-')}, prompt tokens the chosen "
                   f"prefill engine held: {journal.get('matched_tokens', '-')}")  # fmt: skip
        if prefix is not None:
            x = ratio(p90(kv), p90(prefix))
            bound = KV_OVER_PREFIX_HIGH if pressure == "high" else KV_LOSS_LOW
            out.append(f"  TTFT p90 kv / prefix {_n(p90(kv))} / {_n(p90(prefix))} ms = {_n(x, '.2f')}x "
                       f"(target <= {bound:.2f}x): {'MET' if x is not None and x <= bound else 'NOT MET'}")
        if vkv is not None:
            x, g = ratio(p90(kv), p90(vkv)), ratio(kv["goodput"], vkv["goodput"])
            p90_met = x is not None and x <= KV_OVER_VLLM_P90
            good_met = g is not None and g >= KV_OVER_VLLM_GOODPUT
            out.append(f"  TTFT p90 kv / vLLM kv_aware = {_n(x, '.2f')}x (target <= {KV_OVER_VLLM_P90}x): "
                       f"{'MET' if p90_met else 'NOT MET'}; goodput {kv['goodput']:.3f} / {vkv['goodput']:.3f} = "
                       f"{_n(g, '.2f')}x (target >= {KV_OVER_VLLM_GOODPUT}x): {'MET' if good_met else 'NOT MET'}")
    return "\n".join(out)


def report(rows: list[dict[str, Any]], args: argparse.Namespace, work: Path, pressures: list[str]) -> int:
    for r in rows:
        r["slo_ttft_s"] = args.slo_ttft_ms / 1000
    machine = {"cpus": os.cpu_count(), "loadavg_start": args.loadavg_start, "loadavg_end": os.getloadavg(),
               "commit": rb.code_commit()}  # fmt: skip
    settings = {k: v for k, v in vars(args).items() if k != "loadavg_start"}
    doc = {"settings": settings, "machine": machine, "runs": rows}
    (work / "kv_routing.json").write_text(json.dumps(doc, indent=1) + "\n")
    brief_rows = [{k: v for k, v in r.items() if k != "ttft_s_sim"} for r in rows]
    (work / "kv_routing_summary.json").write_text(json.dumps({**doc, "runs": brief_rows}, indent=1) + "\n")
    notes = [plot(rows, work / f"ttft_cdf_{p}.png", p) for p in pressures]
    text = (f"Code {machine['commit']}; load average {args.loadavg_start[0]:.1f} at the start, "
            f"{machine['loadavg_end'][0]:.1f} at the end, {machine['cpus']} CPUs.\n"
            f"Simulated time (speed {args.speed:g}); the trace from request {args.trace_offset} at {args.rate:g}x its "
            f"rate for {args.duration:g} s; SLO TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_itl_ms:g} ms; "
            f"the 'rate' column is the KV pressure ({args.pressures}: the prefill pool over the run's distinct "
            f"blocks; blocks per engine {blocks_of(rows)}).\n\n"
            f"{markdown(rows)}\n\n{verdicts(rows, pressures)}\n")  # fmt: skip
    (work / "kv_routing.md").write_text(text)
    print(text)
    print("\n".join(notes), file=sys.stderr)
    print(f"results in {work}", file=sys.stderr)
    return 0 if rows and all("error" not in r or "skipped" in r["error"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
