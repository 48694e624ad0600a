"""The leg commands both adapters' ``Engines`` share (narwhal_runtime/legs.py), against a recording adapter."""

from __future__ import annotations

from typing import Any

from narwhal_core import StartLeg
from narwhal_core.config import parse_engine_url
from narwhal_runtime.legs import EngineLegs
from narwhal_runtime.pool import PooledConnection

URL = "http://127.0.0.1:9001"


class Recording(EngineLegs[PooledConnection]):
    def __init__(self, pool_size: int = 2) -> None:
        super().__init__(None, pool_size)
        self.calls: list[tuple[str, Any, ...]] = []

    def _open(self, cmd: StartLeg) -> PooledConnection:
        conn = PooledConnection(cmd.engine.url)
        self.calls.append(("open", cmd.leg))
        return conn

    def _reused(self, conn: PooledConnection, cmd: StartLeg) -> None:
        self.calls.append(("reused", conn, cmd.leg))

    def _cancelled(self, conn: PooledConnection) -> None:
        self.calls.append(("cancelled", conn))

    def _finished(self, conn: PooledConnection, kept: bool) -> None:
        self.calls.append(("finished", conn, kept))


def start(key: str, *, fresh: bool = False) -> StartLeg:
    return StartLeg(key, parse_engine_url(URL, key="engine"), b"GET / HTTP/1.1\r\n\r\n", None, 1.0, fresh)


def test_a_leg_opens_a_connection_attached_to_it_at_once() -> None:
    legs = Recording()
    legs.start_leg(start("a"))
    assert legs.calls == [("open", "a")]
    conn = legs._pool.legs["a"]
    assert conn.leg == "a" and not legs.unsent  # a new connection writes its own request once open


def test_a_finished_leg_s_connection_carries_the_next_leg() -> None:
    legs = Recording()
    legs.start_leg(start("a"))
    conn = legs._pool.legs["a"]
    legs.finish_leg("a", True)
    assert legs.calls[-1] == ("finished", conn, True)
    legs.start_leg(start("b"))
    assert legs.calls[-1] == ("reused", conn, "b")
    assert legs.unsent and legs._pool.take_unsent() == [(conn, b"GET / HTTP/1.1\r\n\r\n")]
    legs.start_leg(start("c", fresh=True))  # the router asks for a fresh one after a stale failure
    assert legs.calls[-1] == ("open", "c")


def test_cancel_and_finish_reach_the_adapter_only_for_a_running_leg() -> None:
    legs = Recording(pool_size=0)
    legs.start_leg(start("a"))
    conn = legs._pool.legs["a"]
    legs.finish_leg("a", True)
    assert legs.calls[-1] == ("finished", conn, False)  # the pool holds none: close it
    legs.cancel_leg("a")
    legs.finish_leg("a", True)
    assert len(legs.calls) == 2
    legs.start_leg(start("b"))
    legs.cancel_leg("b")
    assert legs.calls[-1] == ("cancelled", legs.calls[-1][1]) and legs.calls[-1][1].leg is None


def test_no_leg_starts_once_closing() -> None:
    legs = Recording()
    legs._closed = True
    legs.start_leg(start("a"))
    assert legs.calls == [] and not legs._pool.legs
