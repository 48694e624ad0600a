"""Each KV release method against each vLLM version the simulator models, counting the prefill engine's held blocks.

(docs/operate.md, "KV release in operation", "KV leases" and "vLLM
compatibility".) A request is prefilled, then waits for the only decode slot
(``engine.max_inflight_per_engine = 1``, a long request holds it), so no
decode request of its own ever reaches a decode engine; its client leaves,
and Narwhal releases the KV its prefill engine holds. The test counts the
prefill engine's held KV blocks before the release and after its terminal
record, and checks that the journal says only what happened: ``released``
when the blocks were freed and an engine confirmed it, ``release_sent`` when
nothing confirmed it, ``held_until_lease`` when they are still held.

Then the lease: a prefilled request whose KV lease would run out while it
waits for a decode engine is prefilled again, and no decode engine ever
reads expired KV (the simulator counts such reads as failed pulls).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal_core.kv import HOLD_UNREAD, REAPER_STUCK
from narwhal_sim.testing import SimProcess, SimThread
from narwhal_sim.versions import FAMILIES

from ..harness import RouterThread, make_config
from ..helpers import COMPLETIONS, journal_terminal, poll, read_journal
from ..serving import ServeProcess, write_config

#: Every vLLM version family the simulator models (docs/simulator.md, "vLLM versions").
VERSIONS = tuple(FAMILIES)
#: Tokens of the request that holds the decode slot: about a second of decode steps at speed 1.
HOLD_TOKENS = 150


class Bench:
    """A prefill and a decode simulator of one vLLM version, a router in front, and a slot holder."""

    def __init__(self, tmp_path: Path, version: str, *, engine: dict[str, Any], prefill: dict[str, Any],
                 retry: int = 1, decode: dict[str, Any] | None = None) -> None:
        self.journal = tmp_path / "journal.jsonl"
        self.prefill = SimThread(role="prefill", speed=0, vllm_version=version, **prefill).start()
        self.decode = SimThread(role="decode", speed=1, vllm_version=version, **(decode or {})).start()
        config = make_config(
            self.journal, prefill=(self.prefill.url,), decode=(self.decode.url,),
            engine={"max_inflight_per_engine": 1, "control_timeout_s": 10.0, **engine},
            retry={"max_attempts": retry},
        )
        self.router = RouterThread(config, "trio").start()
        self.results: dict[str, httpx.Response] = {}
        self._threads: list[threading.Thread] = []

    def close(self) -> None:
        # The decode engine goes first: a slot holder still decoding ends with it
        # at once, not after the rest of its HOLD_TOKENS.
        self.decode.stop()
        for thread in self._threads:
            thread.join(timeout=15)
        self.router.stop()
        self.prefill.stop()

    def post_in_background(self, name: str, body: dict[str, Any]) -> None:
        def run() -> None:
            try:
                self.results[name] = httpx.post(self.router.url + COMPLETIONS, json=body, timeout=30)
            except httpx.HTTPError:
                pass  # cut by close(): no test reads an answer it did not wait for

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self._threads.append(thread)

    def hold_the_decode_slot(self) -> dict[str, Any]:
        """Start the slot holder; the prefill engine's stats once the holder's KV has been pulled."""
        self.post_in_background("holder", {"prompt": "hold the decode slot " * 8, "max_tokens": HOLD_TOKENS})
        self.decode.wait_for(lambda s: s["running"] >= 1 and s["kv_pulls"] >= 1, timeout=10)
        # (On 0.9/0.11 the holder's own blocks may stay held: its decode leg's request ID is
        # not the prefill's. Counts below are relative to this.)
        return self.prefill.stats()

    def terminals(self) -> list[dict[str, Any]]:
        return [r for r in read_journal(self.journal) if r.get("terminal") is not None]


@pytest.fixture
def bench(tmp_path: Path) -> Iterator[Any]:
    made: list[Bench] = []

    def make(version: str, **kw: Any) -> Bench:
        b = Bench(tmp_path, version, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def leave_while_waiting_for_decode(b: Bench) -> tuple[dict[str, Any], int, dict[str, Any]]:
    """A request that is prefilled, waits for the decode slot and loses its client.

    Returns the prefill engine's stats before it, the blocks its KV held
    while it waited, and the request's terminal record.
    """
    base = b.hold_the_decode_slot()
    body = json.dumps({"prompt": "release my prefilled KV " * 10, "max_tokens": 4}).encode()
    sock = socket.create_connection(("127.0.0.1", b.router.port), timeout=10)
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: narwhal\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        # Prefilled: the prefill engine holds its KV.
        stats = b.prefill.wait_for(lambda s: s["kv_held"] == base["kv_held"] + 1, timeout=10)
        held = stats["kv_held_blocks"] - base["kv_held_blocks"]
        assert held > 0
        # Its prefill leg has ended; only the holder's decode leg runs: it waits for the slot.
        poll(lambda: b.router.statistics().legs == 1, timeout=10, what="the prefill answer read")
        assert b.router.statistics().requests == 2
    finally:
        sock.close()  # the client leaves: Narwhal releases the KV
    records = poll(
        lambda: [r for r in b.terminals() if r["terminal"] == "cancelled"], timeout=15, what="the cancelled record"
    )
    (record,) = records
    return base, held, record


#: What each method does to the held blocks on each version, and what the journal says.
#: decode_pull: the release decode request is admitted and pulls: freed, confirmed, on every version (on
#: 0.9/0.11, connector 1, because it carries the prefill leg's X-Request-Id). decode_abort: the decode
#: engine sees the disconnect after the request reached it and tells the prefill engine (vLLM since 0.9.1),
#: freed but never confirmed. abort_endpoint: vLLM has no /abort_request (404): held until the lease.
#: lease: Narwhal sends nothing.
EXPECTED = {
    "decode_pull": ("released", "freed"),
    "decode_abort": ("release_sent", "freed"),
    "abort_endpoint": ("held_until_lease", "held"),
    "lease": ("held_until_lease", "held"),
}


@pytest.mark.parametrize("method", list(EXPECTED))
@pytest.mark.parametrize("version", VERSIONS)
def test_release_method_frees_the_prefill_engines_blocks_or_says_they_are_held(
    bench: Any, version: str, method: str
) -> None:
    b = bench(version, engine={"kv_release": method}, prefill={"abort_request_route": False})
    base, held, record = leave_while_waiting_for_decode(b)
    (prefill_leg,) = [leg for leg in record["legs"] if leg["phase"] == "prefill"]
    kv = prefill_leg["kv"]
    outcome, blocks = EXPECTED[method]
    assert (kv["outcome"], kv["method"]) == (outcome, method), kv
    if blocks == "freed":
        stats = b.prefill.wait_for(lambda s: s["kv_held"] == base["kv_held"], timeout=10)
        assert (stats["kv_held_blocks"], stats["kv_expired"]) == (base["kv_held_blocks"], 0)
    else:
        stats = b.prefill.stats()
        # Still held: the engine's lease (or abort timeout) will free them.
        assert (stats["kv_held"], stats["kv_held_blocks"]) == (base["kv_held"] + 1, base["kv_held_blocks"] + held)
    if method == "abort_endpoint":
        assert kv["error"].startswith("release answered 404")
    if method == "decode_pull" and b.prefill.engine.family.connector == 1:
        assert kv["release_id"] == prefill_leg["backend_id"]  # the X-Request-Id the prefill engine named it by
    b.results.clear()


@pytest.mark.parametrize("method", ["decode_pull", "decode_abort"])
def test_a_push_fleets_release_frees_the_prefill_engines_blocks(bench: Any, method: str) -> None:
    """engine.protocol = "vllm-nixl-push" (docs/operate.md, "vLLM compatibility"): the same releases, the same records.

    (A reduced set: the two methods that send a decode request, the only ones whose body the
    protocol builds; abort_endpoint and lease send the push fleet what they send a pull one.)
    """
    push = {"kv_transfer_mode": "push"}
    b = bench("0.28", engine={"kv_release": method, "protocol": "vllm-nixl-push"}, prefill=push, decode=push)
    base, _, record = leave_while_waiting_for_decode(b)
    (prefill_leg,) = [leg for leg in record["legs"] if leg["phase"] == "prefill"]
    kv = prefill_leg["kv"]
    assert (kv["outcome"], kv["method"]) == (EXPECTED[method][0], method), kv
    stats = b.prefill.wait_for(lambda s: s["kv_held"] == base["kv_held"], timeout=10)
    assert (stats["kv_held_blocks"], stats["kv_expired"]) == (base["kv_held_blocks"], 0)
    assert kv["release_id"] == prefill_leg["backend_id"]  # the X-Request-Id both engines pair by
    if method == "decode_pull":
        assert stats["kv_pushes"] == base["kv_pushes"] + 1  # written to the decode engine, then freed
    b.results.clear()


@pytest.mark.parametrize("method", ["decode_pull", "lease"])
def test_kv_behind_a_renewed_entry_is_freed_by_the_default_release(bench: Any, method: str) -> None:
    """vLLM issue 58222 (the ``lease`` family): the reaper stops at the first unexpired entry.

    An earlier prefill's KV is renewed all along (heartbeats, as a decode
    engine that queues its request sends them), so the KV of the request whose
    client leaves sits behind it. ``decode_pull`` frees it (the simulator's
    counters say so); under ``lease`` it stays held past its lease, and the
    journal says the engine may not free it.
    """
    lease = 1.0
    b = bench("lease", engine={"kv_release": method}, prefill={"lease_s": lease})
    head = httpx.post(b.prefill.url + COMPLETIONS, json={"prompt": "renewed head", "max_tokens": 1,
                      "kv_transfer_params": {"do_remote_decode": True}}, timeout=10)  # fmt: skip
    owner = head.json()["kv_transfer_params"]["remote_request_id"]
    stop = threading.Event()

    def heartbeats() -> None:
        while not stop.wait(0.05):  # more often than a decode engine would: no renewal missed on a busy machine
            httpx.post(b.prefill.url + "/kv/heartbeat", json={"remote_request_ids": [owner]}, timeout=5)

    beating = threading.Thread(target=heartbeats, daemon=True)
    beating.start()
    try:
        base, held, record = leave_while_waiting_for_decode(b)
        kv = record["legs"][0]["kv"]
        if method == "decode_pull":
            assert (kv["outcome"], kv["method"]) == ("released", "decode_pull"), kv
            stats = b.prefill.wait_for(lambda s: s["kv_held"] == base["kv_held"], timeout=10)
            assert stats["kv_expired"] == 0  # freed by the release, not by the (stuck) reaper
        else:
            assert (kv["outcome"], kv["method"], kv["error"]) == ("held_until_lease", "lease", REAPER_STUCK)
            time.sleep(1.5 * lease)  # its lease has run out
            stats = b.prefill.stats()
            assert (stats["kv_held"], stats["kv_expired"]) == (base["kv_held"] + 1, 0), stats
    finally:
        stop.set()
        beating.join(timeout=5)


def test_abort_endpoint_on_an_engine_that_offers_one_frees_and_confirms(bench: Any) -> None:
    """SGLang-style engines have ``POST /abort_request``; the simulator's answer says it freed the blocks."""
    b = bench("lease", engine={"kv_release": "abort_endpoint"}, prefill={"abort_request_route": True})
    base, held, record = leave_while_waiting_for_decode(b)
    kv = record["legs"][0]["kv"]
    assert (kv["outcome"], kv["method"], kv["error"]) == ("released", "abort_endpoint", None)
    stats = b.prefill.stats()
    assert (stats["kv_held"], stats["kv_held_blocks"]) == (base["kv_held"], base["kv_held_blocks"])
    assert stats["kv_released_blocks"] == base["kv_released_blocks"] + held


@pytest.mark.parametrize(
    ("router_lease", "reads_expired_kv"), [(0.6, False), (30.0, True)], ids=["narwhal-knows-the-lease", "control"],
)
def test_no_decode_leg_reads_kv_whose_lease_has_passed(bench: Any, router_lease: float, reads_expired_kv: bool) -> None:
    """The prefill engine frees unpulled KV after 0.6 s; the only decode slot is busy for about a second.

    With ``engine.kv_lease_s`` = 0.6 the waiting request is prefilled again
    whenever its KV is two thirds into its lease, and its decode leg reads
    fresh KV. The control run tells Narwhal a 30 s lease: its decode leg then
    reads KV the engine has already freed and answers as if nothing happened,
    as vLLM does (vLLM issue 21570); only the simulator's stale-read counter
    and its record say so.
    """
    b = bench("lease", engine={"kv_lease_s": router_lease}, prefill={"lease_s": 0.6}, retry=10)
    b.hold_the_decode_slot()
    b.post_in_background("waiter", {"prompt": "wait for the decode slot " * 10, "max_tokens": 4})
    poll(lambda: len(b.results) == 2, timeout=20, what="both answers")
    assert b.results["waiter"].status_code == 200, b.results["waiter"].text
    assert b.results["holder"].status_code == 200
    records = {r["rid"]: r for r in b.terminals()}
    (waiter,) = [r for r in records.values() if r["usage"] and r["usage"]["completion_tokens"] == 4]
    prefills = [leg for leg in waiter["legs"] if leg["phase"] == "prefill"]
    decode_stats = b.decode.stats()
    if reads_expired_kv:
        assert len(prefills) == 1
        # The hazard this rule prevents: a silent wrong answer, not an error.
        assert (decode_stats["kv_stale_reads"], decode_stats["kv_pull_failures"]) == (1, 0)
        assert [r["kv"].get("stale_read") for r in b.decode.requests("/v1/completions") if r["kv"]].count(True) == 1
        return
    assert len(prefills) >= 2, waiter["legs"]  # prefilled again while it waited
    assert all(leg["kv"]["outcome"] == "held_until_lease" for leg in prefills[:-1])
    assert prefills[-1]["kv"]["outcome"] == "pulled"
    assert decode_stats["kv_pull_failures"] == 0 and decode_stats["recomputed"] == 0
    assert decode_stats["kv_stale_reads"] == 0
    # The KV left behind is freed by the engine's lease, none of it read.
    prefill_stats = b.prefill.wait_for(lambda s: s["kv_held"] == 0, timeout=5)
    assert (prefill_stats["kv_expired"], prefill_stats["kv_pulled"]) == (len(prefills) - 1, 2)


@pytest.mark.parametrize("lease", [0.4, 0.7])
@pytest.mark.parametrize("version", VERSIONS)
def test_no_decode_leg_reads_expired_kv_while_the_decode_engine_queues_it(
    tmp_path: Path, version: str, lease: float
) -> None:
    """The decode engine has one sequence slot and queues the second request past the prefill's hold.

    Narwhal lets eight requests in flight per engine, so the waiter's decode
    leg reaches the decode engine at once and waits in its queue. Before the
    lease (0.9 - 0.20) nothing renews the prefill's hold meanwhile: Narwhal
    cancels the unread leg at 95 % of ``engine.kv_lease_s`` and prefills
    again; with the lease (0.21 on) the decode engine's heartbeat renews it
    and the one leg waits. The oracle is the simulators' own stale-read
    counters: a read of freed blocks answers 200 as vLLM does (vLLM issue
    21570).
    """
    journal = tmp_path / "journal.jsonl"
    # Each engine and the router run in a process of their own: a lease this short
    # must not run out because the test process's threads or its garbage collector
    # held the GIL past a heartbeat (the timing under test is the engines' and the router's).
    prefill = SimProcess(role="prefill", speed=0, vllm_version=version, lease_s=lease)
    # (Both engines configured with one lease, as a fleet is: the decode engine's heartbeat period is its own.)
    decode = SimProcess(role="decode", speed=1, vllm_version=version, max_num_seqs=1, lease_s=lease)
    router: ServeProcess | None = None
    try:
        prefill.start()
        decode.start()
        config = write_config(
            tmp_path / "narwhal.toml", journal, prefill=(prefill.url,), decode=(decode.url,),
            engine={"max_inflight_per_engine": 8, "kv_lease_s": lease, "decode_timeout_s": 20.0},
            retry={"max_attempts": 20, "backoff_base_s": 0.01, "backoff_max_s": 0.05},
        )
        router = ServeProcess(config, "trio").start(listening_timeout=20)
        with httpx.Client(base_url=router.url, timeout=30) as client:
            poll(lambda: client.get("/ready").status_code == 200, timeout=10, what="router ready")
            results: dict[str, httpx.Response] = {}

            def holder() -> None:  # streamed: its tokens show the KV was read, so it is never cut
                results["holder"] = client.post(COMPLETIONS, json={
                    "prompt": "hold the decode slot " * 8, "max_tokens": HOLD_TOKENS, "stream": True,
                })

            thread = threading.Thread(target=holder, daemon=True)
            thread.start()
            decode.wait_for(lambda s: s["running"] >= 1 and s["kv_pulls"] >= 1, timeout=10)
            waiter = client.post(COMPLETIONS, json={"prompt": "queued on the decode engine " * 10, "max_tokens": 4})
            thread.join(timeout=20)
        assert waiter.status_code == 200, waiter.text
        assert results["holder"].status_code == 200
        stale = (prefill.stats()["kv_stale_reads"], decode.stats()["kv_stale_reads"])
        assert stale == (0, 0)
        assert [r["kv"].get("stale_read") for r in decode.requests("/v1/completions") if r["kv"]].count(True) == 0
        record = journal_terminal(journal, waiter.headers["x-request-id"])
        prefills = [leg for leg in record["legs"] if leg["phase"] == "prefill"]
        if FAMILIES[version].lease_renewal:
            assert len(prefills) == 1 and decode.stats()["kv_heartbeats"] >= 1  # renewed while it waited
        else:
            assert len(prefills) >= 2  # its first KV's hold ended before the decode engine read it
            assert all(leg["kv"]["error"].endswith(HOLD_UNREAD) for leg in prefills[:-1])
            assert prefills[-1]["kv"]["outcome"] == "pulled"
    finally:
        decode.stop()
        if router is not None:
            router.stop()
        prefill.stop()
