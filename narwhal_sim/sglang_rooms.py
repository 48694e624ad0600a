"""SGLang's bootstrap rooms: the prefill side's table of rooms and its bootstrap server, the decode side's wait.

A SGLang prefill engine learns of a request's ``bootstrap_room`` from the
request itself and keeps the room until the decode engine named by the
router has fetched its KV, the room fails, or it is aborted; the decode
engine, sent the same request at the same moment, waits for that KV
(docs/simulator.md, "SGLang PD"). SGLang moves the KV over ZMQ and RDMA;
the simulator's stand-in is one HTTP long poll, ``POST /sim/kv/collect``,
on the prefill engine's bootstrap port.

The SGLang behaviour modelled here, as read in sgl-project/sglang:

* ``python/sglang/srt/disaggregation/prefill.py`` (commit 000c2b94),
  ``PrefillBootstrapQueue.add`` / ``pop_bootstrapped``: a prefill request
  waits in the bootstrap queue while its sender polls ``Bootstrapping``
  (the decode side has not sent its KV indices yet); only once it polls
  ``WaitingForInput`` is the prompt computed, so a room whose decode never
  comes holds its queued request, not computed KV. A sender that polls
  ``Failed`` is aborted with HTTP 500, "Prefill bootstrap failed for request".
* ``python/sglang/srt/disaggregation/common/conn.py`` (commit 0094505d),
  ``CommonKVManager.__init__``: the prefill side times a room out after
  ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` in ``Bootstrapping``, the decode
  side after ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` waiting for the KV,
  both "to release the tree cache"; 300 s each by default
  (``mori/conn.py``'s ``get_int_env_var(..., 300)``).
* ``python/sglang/srt/disaggregation/mooncake/conn.py`` (commit 0005973a),
  ``MooncakeKVSender.poll`` (``_check_bootstrap_timeout`` while
  ``Bootstrapping``) and the decode receiver's poll, which fails a room
  "timed out after ...s in KVPoll.WaitingForInput". The decode side's
  transfer info may reach the prefill before the request does (the
  bootstrap thread files it under the room either way), so arrival order
  does not matter; a prefill that failed before its room existed never
  tells the decode side, which then waits its whole waiting timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import orjson

from narwhal_sim.http1 import HttpRequest, ServerConnection
from narwhal_sim.http_client import EngineClient

__all__ = ["COLLECT_PATH", "Room", "Rooms", "RoomFailed", "collect"]

#: The simulator's stand-in for SGLang's KV transfer, served on the prefill engine's bootstrap port.
COLLECT_PATH = "/sim/kv/collect"

#: Concluded rooms kept (so a late decode request learns how its room ended) before they are forgotten.
_KEPT_ROOMS = 10_000


class RoomFailed(Exception):
    """A room ended without its KV reaching the decode side; ``reason`` says why, as SGLang logs it."""

    def __init__(self, reason: str, *, status: int = 500) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


class Room:
    """One bootstrap room on the prefill engine (``state``: bootstrapping, prefilling, collected, failed)."""

    def __init__(self, room: int, rid: str, prompt_tokens: int, now: float) -> None:
        self.room = room
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.registered_at = now
        self.state = "bootstrapping"
        #: Set when the decode side has asked for the KV (SGLang: its transfer info arrived).
        self.decode_arrived = asyncio.Event()
        #: Set when the room concluded (collected or failed); ``failure`` then says which.
        self.done = asyncio.Event()
        self.failure: RoomFailed | None = None

    def conclude(self, failure: RoomFailed | None = None) -> None:
        self.failure = failure
        self.done.set()
        self.decode_arrived.set()


class Rooms:
    """The prefill side's rooms, by ``bootstrap_room``, and the counters ``/sim/stats`` shows."""

    def __init__(self, counters: Counter[str], *, bootstrap_timeout_s: float) -> None:
        self.counters = counters
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.rooms: dict[int, Room] = {}
        #: Decode requests that arrived before their room was registered (SGLang files them by room).
        self._early: dict[int, asyncio.Event] = {}

    def held(self) -> int:
        return sum(1 for r in self.rooms.values() if not r.done.is_set())

    def register(self, room: int, rid: str, prompt_tokens: int) -> Room:
        """A prefill request's room; ``RoomFailed`` (400) when that room is already live."""
        live = self.rooms.get(room)
        if live is not None and not live.done.is_set():
            raise RoomFailed(f"bootstrap_room {room} is already in use", status=400)
        if len(self.rooms) >= _KEPT_ROOMS:
            self.rooms = {k: r for k, r in self.rooms.items() if not r.done.is_set()}
        entry = Room(room, rid, prompt_tokens, time.monotonic())
        self.rooms[room] = entry
        self.counters["rooms_registered"] += 1
        early = self._early.pop(room, None)
        if early is not None:
            entry.decode_arrived.set()
            early.set()
        return entry

    async def wait_for_decode(self, entry: Room) -> None:
        """Hold the room in ``Bootstrapping`` until the decode side comes; ``RoomFailed`` after the timeout."""
        await asyncio.sleep(0)  # into the handler's task: http1 runs a handler's first step outside one
        try:
            async with asyncio.timeout(self.bootstrap_timeout_s):
                await entry.decode_arrived.wait()
        except TimeoutError:
            elapsed = time.monotonic() - entry.registered_at
            self.fail(entry, f"Request {entry.room} timed out after {elapsed:.1f}s in KVPoll.Bootstrapping",
                      counter="rooms_timed_out")  # fmt: skip
        if entry.failure is not None:
            raise entry.failure

    def collected(self, entry: Room) -> None:
        entry.state = "collected"
        self.counters["rooms_collected"] += 1
        entry.conclude()

    def fail(self, entry: Room, reason: str, *, counter: str) -> None:
        if entry.done.is_set():
            return
        entry.state = "failed"
        self.counters[counter] += 1
        entry.conclude(RoomFailed(reason))

    def abort_rid(self, rid: str | None, *, abort_all: bool) -> int:
        """SGLang's ``/abort_request`` on the prefill side: conclude the rooms of ``rid`` (or all); how many."""
        hit = [r for r in self.rooms.values() if not r.done.is_set() and (abort_all or r.rid == rid)]
        for entry in hit:
            self.fail(entry, f"Abort request {entry.rid}", counter="rooms_aborted")
        return len(hit)

    # ------------------------------------------------------------------ the bootstrap port's routes

    def handle(self, conn: ServerConnection, request: HttpRequest) -> Any:
        """The bootstrap server: ``GET /health``, ``GET /route`` and the simulator's ``POST /sim/kv/collect``."""
        if request.path == "/health" and request.method == "GET":
            conn.respond(200, b"OK", content_type=b"text/plain")
            return None
        if request.path == "/route" and request.method == "GET":
            # common/conn.py's bootstrap server answers the prefill ranks' addresses; one rank here.
            conn.respond(200, orjson.dumps({"rank_ip": "127.0.0.1", "rank_port": 0}))
            return None
        if request.path == COLLECT_PATH and request.method == "POST":
            return self._collect(conn, request)
        conn.respond(404, orjson.dumps({"error": f"no route {request.method} {request.path}"}))
        return None

    async def _collect(self, conn: ServerConnection, request: HttpRequest) -> None:
        try:
            data = orjson.loads(request.body)
            room, wait_s = int(data["room"]), float(data["wait_s"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            conn.respond(400, orjson.dumps({"error": "body must be {room: int, wait_s: number}"}))
            return
        await asyncio.sleep(0)  # into the handler's task, as in wait_for_decode
        entry = self.rooms.get(room)
        try:
            async with asyncio.timeout(wait_s):
                if entry is None:
                    early = self._early.setdefault(room, asyncio.Event())
                    await early.wait()
                    entry = self.rooms[room]
                entry.decode_arrived.set()
                await entry.done.wait()
        except TimeoutError:
            self._early.pop(room, None)
            conn.respond(408, orjson.dumps({"state": "waiting", "room": room}))
            return
        if entry.failure is not None:
            conn.respond(410, orjson.dumps({"state": "failed", "room": room, "reason": entry.failure.reason}))
        else:
            conn.respond(200, orjson.dumps({"state": "collected", "room": room, "prompt_tokens": entry.prompt_tokens}))

    def abandon(self, request: HttpRequest) -> None:
        pass

    def bad_request(self) -> None:
        pass


async def collect(client: EngineClient, host: str, port: int, room: int, *, waiting_timeout_s: float) -> int:
    """The decode side: wait for ``room``'s KV on ``host:port``; its prompt tokens, or ``RoomFailed``.

    Bounded by SGLang's waiting timeout; an unreachable bootstrap server is
    retried within it (SGLang's receiver keeps polling its room).
    """
    started = time.monotonic()
    deadline = started + waiting_timeout_s
    body_of = {"room": room}
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            elapsed = time.monotonic() - started
            raise RoomFailed(f"Request {room} timed out after {elapsed:.1f}s in KVPoll.WaitingForInput")
        try:
            status, answer = await client.post(host, port, COLLECT_PATH,
                                               orjson.dumps({**body_of, "wait_s": left}))  # fmt: skip
        except (OSError, TimeoutError, ConnectionError):
            await asyncio.sleep(min(0.05, max(left, 0)))
            continue
        if status == 200:
            return int(orjson.loads(answer)["prompt_tokens"])
        if status == 410:
            raise RoomFailed(str(orjson.loads(answer)["reason"]))
        if status != 408:
            raise RoomFailed(f"bootstrap server answered {status}")
