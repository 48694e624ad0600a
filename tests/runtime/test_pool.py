"""The engine connection pool's decisions (narwhal_runtime/pool.py): reuse, stale, fresh, caps."""

from __future__ import annotations

from narwhal_core import LegData, LegFailed
from narwhal_runtime.pool import Pool, PooledConnection

A = "http://10.0.0.1:8100"
B = "http://10.0.0.2:8100"


def leg_on_new_connection(pool: Pool[PooledConnection], url: str, key: str) -> PooledConnection:
    assert pool.take_idle(url, key, b"GET", fresh=True) is None
    conn = PooledConnection(url)
    pool.attach(conn, key)
    return conn


def pooled(pool: Pool[PooledConnection], url: str, key: str = "leg-0") -> PooledConnection:
    """A connection that carried a leg and went back to the idle list."""
    conn = leg_on_new_connection(pool, url, key)
    assert pool.finish(key, True) == (conn, True)
    return conn


def test_an_empty_pool_says_open_a_new_connection_attached_at_once() -> None:
    pool: Pool[PooledConnection] = Pool(4)
    assert pool.take_idle(A, "leg-1", b"GET") is None
    conn = leg_on_new_connection(pool, A, "leg-1")
    assert pool.legs == {"leg-1": conn}
    assert (conn.leg, conn.reused, conn.got_bytes, conn.closed) == ("leg-1", False, False, False)


def test_a_finished_reusable_connection_is_reused_by_the_next_leg_to_its_engine_only() -> None:
    pool: Pool[PooledConnection] = Pool(4)
    conn = pooled(pool, A)
    assert (conn.leg, pool.idle, pool.legs) == (None, {A: [conn]}, {})
    assert pool.take_idle(B, "leg-b", b"GET") is None
    assert pool.take_idle(A, "leg-a", b"GET") is conn
    assert (conn.leg, conn.reused, pool.legs, pool.idle[A]) == ("leg-a", True, {"leg-a": conn}, [])


def test_the_most_recently_idled_connection_goes_first() -> None:
    pool: Pool[PooledConnection] = Pool(4)
    first = leg_on_new_connection(pool, A, "leg-1")
    second = leg_on_new_connection(pool, A, "leg-2")
    pool.finish("leg-1", True)
    pool.finish("leg-2", True)
    assert pool.take_idle(A, "leg-3", b"GET") is second
    assert pool.take_idle(A, "leg-4", b"GET") is first


def test_a_leg_on_a_pooled_connection_waits_to_be_written_unless_it_ended_first() -> None:
    pool: Pool[PooledConnection] = Pool(4)
    kept = pooled(pool, A, "leg-0")
    cancelled = pooled(pool, B, "leg-00")
    broken = pooled(pool, "http://10.0.0.3:8100", "leg-000")
    pool.take_idle(A, "leg-1", b"request 1")
    pool.take_idle(B, "leg-2", b"request 2")
    pool.take_idle("http://10.0.0.3:8100", "leg-3", b"request 3")
    assert len(pool.unsent) == 3
    pool.cancel("leg-2")
    broken.closed = True
    assert pool.take_unsent() == [(kept, b"request 1")]
    assert pool.unsent == [] and pool.take_unsent() == []
    assert cancelled.leg is None


def test_a_new_connection_writes_its_own_request() -> None:
    pool: Pool[PooledConnection] = Pool(4)
    leg_on_new_connection(pool, A, "leg-1")
    assert pool.unsent == []


def test_a_fresh_connection_skips_the_idle_list() -> None:
    pool: Pool[PooledConnection] = Pool(4)
    conn = pooled(pool, A)
    assert pool.take_idle(A, "leg-1", b"GET", fresh=True) is None
    assert pool.idle[A] == [conn]


def test_closed_idle_connections_are_passed_over() -> None:
    pool: Pool[PooledConnection] = Pool(4)
    good = pooled(pool, A, "leg-1")
    dead = pooled(pool, A, "leg-2")
    dead.closed = True
    assert pool.take_idle(A, "leg-3", b"GET") is good
    assert pool.idle[A] == []


def test_the_idle_list_is_capped_per_engine() -> None:
    pool: Pool[PooledConnection] = Pool(1)
    one = leg_on_new_connection(pool, A, "leg-1")
    two = leg_on_new_connection(pool, A, "leg-2")
    other = leg_on_new_connection(pool, B, "leg-3")
    assert pool.finish("leg-1", True) == (one, True)
    assert pool.finish("leg-2", True) == (two, False)  # the list is full: close it
    assert pool.finish("leg-3", True) == (other, True)
    assert pool.idle == {A: [one], B: [other]}
    assert pool.legs == {}


def test_a_connection_not_reusable_or_closed_is_not_kept() -> None:
    pool: Pool[PooledConnection] = Pool(4)
    not_reusable = leg_on_new_connection(pool, A, "leg-1")
    closed = leg_on_new_connection(pool, A, "leg-2")
    closed.closed = True
    assert pool.finish("leg-1", False) == (not_reusable, False)
    assert pool.finish("leg-2", True) == (closed, False)
    assert pool.idle.get(A, []) == []
    assert pool.finish("leg-1", True) is None  # already finished


def test_cancel_detaches_the_leg_and_hands_back_its_connection() -> None:
    pool: Pool[PooledConnection] = Pool(4)
    conn = leg_on_new_connection(pool, A, "leg-1")
    assert pool.cancel("leg-1") is conn
    assert conn.leg is None and pool.legs == {}
    assert pool.cancel("leg-1") is None
    # A connection whose leg was cancelled reports nothing afterwards.
    assert pool.failed(conn, "connect_failed") is None


def test_bytes_feed_the_leg_they_answer() -> None:
    pool: Pool[PooledConnection] = Pool(4)
    conn = leg_on_new_connection(pool, A, "leg-1")
    assert pool.received(conn, b"HTTP/1.1 200 OK\r\n") == LegData("leg-1", b"HTTP/1.1 200 OK\r\n")
    assert conn.got_bytes


def test_an_idle_connection_that_speaks_or_closes_leaves_the_idle_list() -> None:
    pool: Pool[PooledConnection] = Pool(4)
    chatty = pooled(pool, A, "leg-1")
    closing = pooled(pool, A, "leg-2")
    broken = pooled(pool, A, "leg-3")
    assert pool.received(chatty, b"surprise") is None  # the adapter closes it
    assert pool.ended(closing) is None
    assert pool.ended(broken, reset=True) is None
    assert pool.idle[A] == []


def test_a_clean_close_after_some_of_the_answer_is_the_answers_end() -> None:
    pool: Pool[PooledConnection] = Pool(4)
    conn = leg_on_new_connection(pool, A, "leg-1")
    pool.received(conn, b"HTTP/1.0 200 OK\r\n\r\nhello")
    assert pool.ended(conn) == LegData("leg-1", b"")
    assert pool.legs == {"leg-1": conn}  # the router finishes (or fails) it


def test_a_new_connection_closed_before_answering_is_an_answers_end_too() -> None:
    # Not stale: the engine saw the request on this connection (the router's codec says "dropped").
    pool: Pool[PooledConnection] = Pool(4)
    conn = leg_on_new_connection(pool, A, "leg-1")
    assert pool.ended(conn) == LegData("leg-1", b"")


def test_a_reused_connection_closed_before_any_answer_is_stale() -> None:
    pool: Pool[PooledConnection] = Pool(4)
    conn = pooled(pool, A)
    assert pool.take_idle(A, "leg-1", b"GET") is conn
    assert pool.ended(conn) == LegFailed("leg-1", "dropped", reused=True)
    # Detached before the report: the router may start the leg again under the same key.
    assert conn.leg is None and pool.legs == {}
    assert pool.take_idle(A, "leg-1", b"GET", fresh=True) is None


def test_a_reset_fails_the_leg_saying_whether_the_connection_was_reused() -> None:
    pool: Pool[PooledConnection] = Pool(4)
    new = leg_on_new_connection(pool, A, "leg-1")
    new_answering = leg_on_new_connection(pool, A, "leg-2")
    pool.received(new_answering, b"HTTP/1.1 200 OK\r\n")
    reused = pooled(pool, B)
    pool.take_idle(B, "leg-3", b"GET")
    pool.received(reused, b"HTTP/1.1 200 OK\r\n")
    assert pool.ended(new, reset=True) == LegFailed("leg-1", "dropped", reused=False)
    assert pool.ended(new_answering, reset=True) == LegFailed("leg-2", "dropped", reused=False)
    assert pool.ended(reused, reset=True) == LegFailed("leg-3", "dropped", reused=True)
    assert pool.legs == {}


def test_a_failed_connect_reports_its_reason_once() -> None:
    pool: Pool[PooledConnection] = Pool(4)
    conn = leg_on_new_connection(pool, A, "leg-1")
    assert pool.failed(conn, "connect_timeout") == LegFailed("leg-1", "connect_timeout")
    assert pool.failed(conn, "dropped") is None
    assert pool.legs == {}


def test_a_failure_does_not_detach_a_newer_leg_under_the_same_key() -> None:
    pool: Pool[PooledConnection] = Pool(4)
    old = pooled(pool, A)
    pool.take_idle(A, "leg-1", b"GET")
    assert pool.ended(old, reset=True) == LegFailed("leg-1", "dropped", reused=True)
    retry = leg_on_new_connection(pool, A, "leg-1")
    old.leg = "leg-1"  # (as if a late report came from the old connection)
    assert pool.failed(old, "dropped") == LegFailed("leg-1", "dropped")
    assert pool.legs == {"leg-1": retry}


def test_shutdown_hands_back_every_connection_and_empties_the_idle_lists() -> None:
    pool: Pool[PooledConnection] = Pool(4)
    idle = pooled(pool, A)
    busy = leg_on_new_connection(pool, B, "leg-1")
    assert pool.all_connections() == [idle, busy]
    assert pool.idle == {} and pool.legs == {"leg-1": busy}
