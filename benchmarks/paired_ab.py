"""A paired, interleaved A/B of Narwhal's router CPU per request: this tree against ``--baseline DIR``.

    . .venv/bin/activate
    python benchmarks/router_bench.py --scenario paired --baseline DIR            # 20 rounds x 2 s (~7 min)
    python benchmarks/router_bench.py --scenario paired --baseline DIR --rounds 4 # a short check (~2 min)

``router_bench.py`` dispatches here, handing over itself (``rb``: this
module imports nothing of it); everything it starts and reads comes from
there (the instant engines, the targets ``narwhal-RUNTIME`` and
``narwhal-RUNTIME-base``, core pinning, ``wrk``, the ``other%`` reading).
On a shared VM the machine's speed drifts by tens of per cent between
windows a minute apart, so the medians of separate windows cannot resolve a
few per cent (benchmarks/README.md, "The machine, and how to read its figures").
Here the engines and all the routers start once, each is warmed up, and
then, for ``--rounds`` rounds, every runtime and scenario gets a *pair* of
short windows, this tree (A) and the baseline (B) back to back, one router
under load at a time, the side that goes first alternating from round to
round (``--order abba``) or drawn from ``--seed`` (``random``). Each pair
gives one ratio A/B measured seconds apart, where the drift between windows
minutes apart cancels; the report is the median of those ratios with a
bootstrap 95 % confidence interval and a verdict on the cost bound
(``--bound``, 5 %): met when the interval's upper end is at most 1.05,
missed when its lower end is above, not resolved otherwise.

A runs the ``narwhal`` this Python imports (the editable install, or
``PYTHONPATH``), B the ``--baseline`` tree; the report names A by the git
state of the checkout this script is in, so run it from the tree A is.

Router CPU is the sum over the router's threads of the first field of
``/proc/PID/task/TID/schedstat`` (nanoseconds on a CPU), read just before
and after the window, divided by the requests wrk completed; utime + stime
(clock ticks) is kept beside it. A pair where other processes took more
than ``--max-other`` % of a core we use in either window is measured again
(``--retries``) and, still disturbed, left out of the ratios and counted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from types import ModuleType
from typing import Any


#: The two sides of a pair: this tree's target and the baseline's, per runtime.
SIDES = ("A", "B")
#: Fewest pairs for a verdict: below 6, even the widest distribution-free interval of a median (the
#: smallest to the largest of n values) covers it with less than 95 % (1 - 2 / 2**n), and the
#: bootstrap's interval, no wider than that, claims more than the pairs can show.
MIN_PAIRS = 6


# ---------------------------------------------------------------------------- the statistics (pure)


def side_order(round_index: int, cell_index: int, order: str, rng: random.Random) -> tuple[str, str]:
    """Which side of a pair is measured first: alternating by round (and by cell within one), or at random."""
    if order == "random":
        return ("A", "B") if rng.random() < 0.5 else ("B", "A")
    return ("A", "B") if (round_index + cell_index) % 2 == 0 else ("B", "A")


def bootstrap_median_ci(values: list[float], resamples: int, seed: int, level: float = 0.95) -> tuple[float, float]:
    """The percentile bootstrap interval of the median of ``values`` (resampled with replacement, seeded)."""
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1.0 - level) / 2.0
    low = medians[int(tail * resamples)]
    high = medians[min(resamples - 1, int((1.0 - tail) * resamples))]
    return low, high


def verdict(low: float, high: float, bound: float) -> str:
    """The cost bound (A/B at most 1 + ``bound``) against the interval of the ratio."""
    limit = 1.0 + bound
    if high <= limit:
        return "met"
    if low > limit:
        return "missed"
    return "not resolved"


def summarise_pairs(pairs: list[tuple[float, float]], bound: float, resamples: int, seed: int) -> dict[str, Any]:
    """Per-pair ratios A/B of (A, B) costs: their median, its bootstrap interval, the verdict, each side's median."""
    ratios = [a / b for a, b in pairs if b > 0]
    out: dict[str, Any] = {"pairs": len(ratios), "ratio_median": None, "ci": None, "verdict": "no pairs",
                           "a_median": None, "b_median": None}  # fmt: skip
    if not ratios:
        return out
    out["ratio_median"] = statistics.median(ratios)
    out["a_median"] = statistics.median(a for a, _ in pairs)
    out["b_median"] = statistics.median(b for _, b in pairs)
    if len(ratios) < 2:
        out["verdict"] = "not resolved"  # one pair has no spread to judge
        return out
    low, high = bootstrap_median_ci(ratios, resamples, seed)
    out["ci"] = [low, high]
    out["verdict"] = verdict(low, high, bound) if len(ratios) >= MIN_PAIRS else "not resolved"
    return out


# ---------------------------------------------------------------------------- the measurement


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """Nanoseconds on a CPU so far of each live thread of ``pid`` (``/proc/PID/task/TID/schedstat``, field 1)."""
    out: dict[int, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # the thread ended meanwhile
    return out


def cpu_ns_between(before: dict[int, int], after: dict[int, int]) -> tuple[int, int]:
    """CPU nanoseconds the threads used between two readings, and how many threads ended (their share is lost)."""
    used = sum(ns - before.get(tid, 0) for tid, ns in after.items())
    ended = sum(1 for tid in before if tid not in after)
    return used, ended


def window(rb: ModuleType, t: Any, scen: str, body_file: Path, args: argparse.Namespace, engine_pids: list[int]) -> dict[str, Any]:  # fmt: skip
    """One measured window on ``t`` (router_bench's ``measure``), with the router's threads' schedstat around it."""
    assert t.proc is not None
    pid = t.proc.pid
    sched0 = thread_cpu_ns(pid)
    m = rb.measure(t, scen, body_file, args.duration, 0, args.router_core, args.load_core, engine_pids)
    sched1 = thread_cpu_ns(pid)
    used, ended = cpu_ns_between(sched0, sched1)
    n = m["requests"]
    m["sched_cpu_s"] = used / 1e9
    m["sched_us_per_req"] = used / 1e3 / n if n else None
    m["threads_ended"] = ended
    return m


def _disturbed(m: dict[str, Any], max_other: float) -> bool:
    return (m.get("other_pct") or 0.0) > max_other


def measure_pair(rb: ModuleType, targets: dict[str, Any], first: tuple[str, str], scen: str, body_file: Path,
                 args: argparse.Namespace, engine_pids: list[int]) -> dict[str, Any]:  # fmt: skip
    """A pair of windows in the order ``first``, measured again while disturbed (up to ``--retries`` times)."""
    best: dict[str, Any] | None = None
    calm = time.monotonic() < args.soft_stop_at
    for attempt in range(1 + (args.retries if calm else 0)):
        if calm:
            rb.quiet_wait(args.router_core, args.load_core, args.max_other, args.quiet_wait)
        pair: dict[str, Any] = {"order": "".join(first), "attempts": attempt + 1}
        for side in first:
            pair[side] = window(rb, targets[side], scen, body_file, args, engine_pids)
        pair["disturbed"] = _disturbed(pair["A"], args.max_other) or _disturbed(pair["B"], args.max_other)
        worst = max(pair["A"].get("other_pct") or 0.0, pair["B"].get("other_pct") or 0.0)
        pair["other_pct"] = worst
        if best is None or worst < best["other_pct"]:
            best = pair
        if not best["disturbed"]:
            break
    assert best is not None
    return best


# ---------------------------------------------------------------------------- the mode


def paired_mode(rb: ModuleType, args: argparse.Namespace, work: Path) -> int:
    """``router_bench.py --scenario paired``: start everything once, measure the pairs, report, write results.json.

    ``rb`` is the running ``router_bench`` module (its process registry, its ``BASELINE_TREE``).
    """
    if shutil.which("wrk") is None:
        raise SystemExit("router_bench: wrk is not installed (apt-get install wrk)")
    if not rb.BASELINE_TREE:
        raise SystemExit("router_bench: --scenario paired needs --baseline DIR (the tree B runs from)")
    runtimes = [r for r in args.runtimes.split(",") if r]
    for runtime in runtimes:
        if runtime not in ("trio", "asyncio"):
            raise SystemExit(f"router_bench: unknown runtime {runtime!r} (trio, asyncio)")
    scenarios = [s for s in args.scenarios.split(",") if s]
    for scen in scenarios:
        if scen not in rb.SCENARIOS:
            raise SystemExit(f"router_bench: unknown scenario {scen!r} (choose from {', '.join(rb.SCENARIOS)})")
    log_file = open(work / "paired.log", "a")

    def note(msg: str) -> None:
        rb.log(msg)
        log_file.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
        log_file.flush()

    bodies, body_files = rb.write_bodies(work)
    engines: dict[str, dict[str, Any]] = {}
    engine_pids: list[int] = []
    for role in ("prefill", "decode"):
        proc, info = rb.start_engine(args.engine, role, args.load_core, work, token_interval_ms=args.paced_ms)
        engines[role] = info
        engine_pids.append(proc.pid)
    note(f"work directory {work}; engines ({args.engine}): prefill {engines['prefill']['url']}, "
         f"decode {engines['decode']['url']}")  # fmt: skip
    sides: dict[str, dict[str, Any]] = {}
    for runtime in runtimes:
        # --policy: both sides route alike (a change of the default policy is not a change of cost).
        at = f"@{args.policy}" if args.policy else ""
        sides[runtime] = {"A": rb.start_target(f"narwhal-{runtime}{at}", args.router_core, work, engines, None, ""),
                          "B": rb.start_target(f"narwhal-{runtime}-base{at}", args.router_core, work, engines, None,
                                               "")}  # fmt: skip
    errors: dict[str, str] = {}
    for runtime, both in sides.items():
        for side, t in both.items():
            rb.wait_ready(t, args.start_timeout)
            rb.validate(t, engines, args.engine, bodies, scenarios)
            note(f"{side} {t.name:<22} {'FAILED: ' + t.error if t.error else 'ready at ' + t.url}")
            if t.error:
                errors[runtime] = f"{t.name}: {t.error}"
    live = [r for r in runtimes if r not in errors]
    for runtime in live:
        for scen in scenarios:
            for side in SIDES:
                t = sides[runtime][side]
                if args.warmup > 0:
                    rb.run_wrk(t.url, body_files[scen], rb.SCENARIOS[scen][1], args.warmup, args.load_core)
    note(f"warmed up ({args.warmup:g} s per router and scenario); {args.rounds} rounds of "
         f"{args.duration:g} s windows, order {args.order}, seed {args.seed}")  # fmt: skip
    cells = [(runtime, scen) for runtime in live for scen in scenarios]
    pairs: dict[str, list[dict[str, Any]]] = {f"{r} {s}": [] for r, s in cells}
    rng = random.Random(args.seed)
    stopped = ""
    for rnd in range(args.rounds):
        if stopped:
            break
        for k, (runtime, scen) in enumerate(cells):
            if time.monotonic() > args.stop_at:
                stopped = f"stopped after {rnd} complete round(s): --time-limit nearly reached"
                break
            dead = [t.name for t in sides[runtime].values() if t.proc is not None and not t.proc.alive()]
            if dead:
                raise SystemExit(f"router_bench: {', '.join(dead)} died during the rounds; logs in {work}")
            first = side_order(rnd, k, args.order, rng)
            try:
                pair = measure_pair(rb, sides[runtime], first, scen, body_files[scen], args, engine_pids)
            except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
                note(f"round {rnd + 1} {runtime} {scen}: load failed: {exc}")
                continue
            pair["round"] = rnd + 1
            pairs[f"{runtime} {scen}"].append(pair)
            a, b = pair["A"], pair["B"]
            ratio = a["sched_us_per_req"] / b["sched_us_per_req"] if a["sched_us_per_req"] and b["sched_us_per_req"] else None  # fmt: skip
            note(f"round {rnd + 1}/{args.rounds} {runtime:<7} {scen:<7} {pair['order']}  "
                 f"A {rb.fmt(a['sched_us_per_req'], '.1f')} µs/req {a['rps']:.0f} req/s  "
                 f"B {rb.fmt(b['sched_us_per_req'], '.1f')} µs/req {b['rps']:.0f} req/s  A/B {rb.fmt(ratio, '.3f')}  "
                 f"other {pair['other_pct']:.0f}%{' DISTURBED' if pair['disturbed'] else ''}"
                 f"{'  errors' if a['errors'] or b['errors'] else ''}")  # fmt: skip
    if stopped:
        note(stopped)
    summary = summarise(rb, pairs, args)
    lines = report(rb, summary, runtimes, scenarios, errors, args, stopped)
    for line in lines:
        print(line)
    machine = rb.machine_conditions(args)
    print(f"Machine: {machine}")
    out = {
        "args": vars(args), "machine": machine, "summary": summary, "pairs": pairs, "errors": errors,
        "targets": {t.name: {"url": t.url, "error": t.error, "cmd": t.proc.cmd if t.proc else None}
                    for both in sides.values() for t in both.values()},
        "engines": engines, "table": lines,
    }  # fmt: skip
    (work / "results.json").write_text(json.dumps(out, indent=1, default=str))
    log_file.write("\n".join(lines) + f"\nMachine: {machine}\n")
    log_file.close()
    print(f"Results and logs: {work}")
    return 0


def _clean_costs(pairs: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    return [(p["A"][key], p["B"][key]) for p in pairs
            if not p["disturbed"] and p["A"].get(key) and p["B"].get(key)]  # fmt: skip


def summarise(rb: ModuleType, pairs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Per runtime and scenario: the schedstat ratio's summary and verdict, utime+stime's beside it, rates, drops."""
    out: dict[str, dict[str, Any]] = {}
    for cell, measured in pairs.items():
        s = summarise_pairs(_clean_costs(measured, "sched_us_per_req"), args.bound, args.resamples, args.seed)
        s["ticks"] = summarise_pairs(_clean_costs(measured, "cpu_us_per_req"), args.bound, args.resamples, args.seed)
        clean = [p for p in measured if not p["disturbed"]]
        s["measured"] = len(measured)
        s["dropped_disturbed"] = len(measured) - len(clean)
        s["windows_with_thread_exits"] = sum(1 for p in measured for side in SIDES if p[side]["threads_ended"])
        s["errors"] = sum(p[side]["errors"] for p in measured for side in SIDES)
        for side in SIDES:
            s[f"{side}_rps"] = rb.med([p[side]["rps"] for p in clean])
            s[f"{side}_p50_us"] = rb.med([p[side]["p50_us"] for p in clean])
        out[cell] = s
    return out


def report(rb: ModuleType, summary: dict[str, dict[str, Any]], runtimes: list[str], scenarios: list[str], errors: dict[str, str],
           args: argparse.Namespace, stopped: str) -> list[str]:  # fmt: skip
    limit = 1.0 + args.bound
    lines = [
        "",
        f"Paired A/B of router CPU per request: A = this tree ({args.code_at_start}), B = --baseline "
        f"{rb.BASELINE_TREE}; {args.rounds} rounds x {args.duration:g} s windows, order {args.order}, "
        f"seed {args.seed}, engines {args.engine}, router core {args.router_core}, load core {args.load_core}",
        f"{'runtime':<8} {'scenario':<8} {'pairs':>5} {'A µs/req':>9} {'B µs/req':>9} {'A/B':>6} "
        f"{'95 % CI':>13}  {'bound ' + format(limit, '.2f'):<13} {'ticks A/B':>9} {'req/s A / B':>13} "
        f"{'p50 µs A / B':>13}  notes",
    ]  # fmt: skip
    lines.append("-" * len(lines[-1]))
    for runtime in runtimes:
        if runtime in errors:
            lines.append(f"{runtime:<8} not measured: {' '.join(errors[runtime].split())[:160]}")
            continue
        for scen in scenarios:
            s = summary[f"{runtime} {scen}"]
            ci = f"{s['ci'][0]:.3f}-{s['ci'][1]:.3f}" if s["ci"] else "-"
            notes = []
            if s["dropped_disturbed"]:
                notes.append(f"{s['dropped_disturbed']} of {s['measured']} pairs dropped (other% > {args.max_other:g})")
            if s["windows_with_thread_exits"]:
                notes.append(f"{s['windows_with_thread_exits']} windows lost an ended thread's CPU")
            if s["errors"]:
                notes.append(f"{s['errors']} wrk errors")
            lines.append(
                f"{runtime:<8} {scen:<8} {s['pairs']:>5} {rb.fmt(s['a_median'], '.1f'):>9} "
                f"{rb.fmt(s['b_median'], '.1f'):>9} {rb.fmt(s['ratio_median'], '.3f'):>6} {ci:>13}  "
                f"{s['verdict'].upper():<13} {rb.fmt(s['ticks']['ratio_median'], '.3f'):>9} "
                f"{rb.fmt(s['A_rps']):>6} / {rb.fmt(s['B_rps']):<6} {rb.fmt(s['A_p50_us']):>6} / {rb.fmt(s['B_p50_us']):<6}"
                f"  {'; '.join(notes)}"
            )  # fmt: skip
    lines.append("")
    for runtime in runtimes:
        for scen in scenarios:
            cell = summary.get(f"{runtime} {scen}")
            if cell is None:
                continue
            if cell["ci"] is None or cell["pairs"] < MIN_PAIRS:
                lines.append(f"  {runtime} {scen}: {cell['verdict'].upper()}: {cell['pairs']} clean pair(s), a verdict "
                             f"needs at least {MIN_PAIRS}")  # fmt: skip
                continue
            low, high = cell["ci"]
            why = {"met": f"the interval's upper end {high:.3f} <= {limit:.2f}",
                   "missed": f"the interval's lower end {low:.3f} > {limit:.2f}",
                   "not resolved": f"the interval {low:.3f}-{high:.3f} straddles {limit:.2f}"}[cell["verdict"]]  # fmt: skip
            lines.append(f"  {runtime} {scen}: this tree within {100 * args.bound:g} % of the baseline: "
                         f"{cell['verdict'].upper()} ({why})")  # fmt: skip
    if stopped:
        lines.append(f"  ({stopped})")
    lines.append("")
    lines.append("µs/req = the router's CPU (sum of /proc/PID/task/*/schedstat field 1, all threads) over a window / "
                 "requests wrk completed; A, B = medians over the clean pairs.")  # fmt: skip
    lines.append("A/B = median of the per-pair ratios (< 1: this tree uses less); 95 % CI: percentile bootstrap of "
                 f"that median ({args.resamples} resamples, seed {args.seed}); ticks A/B: the same from utime+stime.")
    lines.append(f"A pair is dropped when other processes took more than {args.max_other:g} % of a core we use in "
                 f"either window after {args.retries} retries (router_bench's other%).")  # fmt: skip
    return lines
