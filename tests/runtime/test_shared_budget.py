"""The shared budget store's sans-IO parts (narwhal_runtime/shared_budget.py): the exchange with Redis, the slices.

The script itself runs on a real redis-server in test_shared_budget_redis.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal_runtime.resp import NEED_DATA, RespParser, encode_reply
from narwhal_runtime.shared_budget import (
    SCRIPT, SCRIPT_SHA, BudgetProtocol, BudgetStoreError, RedisAddress, SliceGrant, SliceHolder, SliceRequest,
    bucket_key, parse_redis_url,
)


def request(**changes: object) -> SliceRequest:
    values: dict[str, object] = dict(tenant="acme", kind="requests", rate=5.0, capacity=100, units=10)
    values.update(changes)
    return SliceRequest(**values)  # type: ignore[arg-type]


def sent(data: bytes) -> list[bytes]:
    parser = RespParser()
    parser.receive_data(data)
    command = parser.next_reply()
    assert isinstance(command, list) and parser.next_reply() is NEED_DATA
    return command  # type: ignore[return-value]


def test_a_request_is_an_evalsha_of_the_script_on_its_tenants_key() -> None:
    protocol = BudgetProtocol()
    assert sent(protocol.take(request())) == [
        b"EVALSHA", SCRIPT_SHA.encode(), b"1", b"narwhal:budget:acme:requests", b"5.0", b"100", b"10"]
    protocol.receive_data(encode_reply([7, b"0.000000"]))
    assert protocol.next_grant() == SliceGrant(request=request(), granted=7, retry_after=0.0)
    assert protocol.waiting == 0 and protocol.next_grant() is NEED_DATA


def test_noscript_sends_the_request_again_as_eval_once() -> None:
    from narwhal_runtime.resp import ErrorReply

    protocol = BudgetProtocol()
    protocol.take(request())
    protocol.receive_data(encode_reply(ErrorReply("NOSCRIPT No matching script. Please use EVAL.")))
    assert protocol.next_grant() is NEED_DATA
    again = sent(protocol.data_to_send())
    assert again[:2] == [b"EVAL", SCRIPT] and again[2:] == [b"1", b"narwhal:budget:acme:requests", b"5.0", b"100", b"10"]
    assert protocol.data_to_send() == b""
    protocol.receive_data(encode_reply(ErrorReply("NOSCRIPT No matching script.")))
    with pytest.raises(BudgetStoreError, match="redis error: NOSCRIPT"):
        protocol.next_grant()


def test_pipelined_requests_are_answered_in_order_a_noscript_one_after_the_others() -> None:
    from narwhal_runtime.resp import ErrorReply

    protocol = BudgetProtocol()
    first, second = request(tenant="a"), request(tenant="b")
    protocol.take(first)
    protocol.take(second)
    protocol.receive_data(encode_reply(ErrorReply("NOSCRIPT x")) + encode_reply([3, b"0.5"]))
    grant = protocol.next_grant()
    assert isinstance(grant, SliceGrant) and grant.request == second and grant.retry_after == 0.5
    protocol.receive_data(encode_reply([10, b"0.000000"]))
    grant = protocol.next_grant()
    assert isinstance(grant, SliceGrant) and grant.request == first and grant.granted == 10


@pytest.mark.parametrize("reply, words", [
    (b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n", "redis error: WRONGTYPE"),
    (b"-LOADING Redis is loading the dataset in memory\r\n", "redis error: LOADING"),
    (b":1\r\n", "not \\[granted, seconds\\]"),
    (b"*2\r\n:11\r\n$1\r\n0\r\n", "not \\[granted, seconds\\]"),  # more than asked
    (b"*2\r\n:1\r\n$3\r\nnan\r\n", "not \\[granted, seconds\\]"),
    (b"*2\r\n:1\r\n$2\r\n-1\r\n", "not \\[granted, seconds\\]"),
])
def test_any_other_answer_is_a_store_error(reply: bytes, words: str) -> None:
    protocol = BudgetProtocol()
    protocol.take(request())
    protocol.receive_data(reply)
    with pytest.raises(BudgetStoreError, match=words):
        protocol.next_grant()


def test_an_answer_to_nothing_is_a_store_error() -> None:
    protocol = BudgetProtocol()
    protocol.receive_data(b"+OK\r\n")
    with pytest.raises(BudgetStoreError, match="never sent"):
        protocol.next_grant()


@pytest.mark.parametrize("changes, words", [
    ({"kind": "to:kens"}, "kind must match"), ({"kind": "Tokens"}, "kind must match"),
    ({"tenant": ""}, "tenant must be"), ({"tenant": "x" * 257}, "tenant must be"),
    ({"rate": 0}, "rate must be"), ({"rate": float("inf")}, "rate must be"), ({"rate": True}, "rate must be"),
    ({"capacity": 0}, "capacity must be"), ({"units": 1.5}, "units must be"),
])
def test_a_bad_request_is_refused_by_name(changes: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        request(**changes)


def test_a_tenant_with_colons_keeps_a_key_of_its_own() -> None:
    assert bucket_key("a:requests", "x") != bucket_key("a", "requests_x")
    assert bucket_key("ténant", "tokens") == "narwhal:budget:ténant:tokens".encode()


@given(capacity=st.integers(1, 10_000), fraction=st.sampled_from([0.05, 0.1, 0.25, 1.0]),
       steps=st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 2000), st.booleans()), max_size=60))
def test_a_holder_spends_only_what_it_was_granted_and_holds_at_most_low_water_plus_a_slice(
        capacity: int, fraction: float, steps: list[tuple[int, int, bool]]) -> None:
    holder = SliceHolder(tenant="t", kind="tokens", rate=1.0, capacity=capacity, fraction=fraction)
    granted = spent = 0
    for cost, grant, reachable in steps:
        cost = min(cost, capacity)
        if holder.spend(cost):
            spent += cost
        ask = holder.wants(cost)
        if ask is None:
            continue
        assert holder.wants(cost) is None  # one request out at a time
        assert 1 <= ask.units <= capacity
        if reachable:
            given_units = min(grant, ask.units)
            holder.granted(SliceGrant(request=ask, granted=given_units, retry_after=0.0))
            granted += given_units
            # At most the bound, or what the waiting request needs (and spends next).
            assert holder.held <= max(holder.low_water + holder.slice, cost)
        else:
            holder.failed()
        assert spent + holder.held == granted and holder.held >= 0


def test_a_redis_url_gives_its_address_and_a_log_line_without_the_password() -> None:
    address = parse_redis_url("redis://ops:p%40ss@redis.example:6380/2")
    assert (address.host, address.port, address.db, address.username, address.password) == (
        "redis.example", 6380, 2, "ops", "p@ss")
    assert str(address) == "redis://redis.example:6380/2" and "p@ss" not in repr(address)
    assert parse_redis_url("redis://[::1]") == RedisAddress(host="::1")
    assert str(parse_redis_url("redis://[::1]")) == "redis://[::1]:6379/0"
    assert parse_redis_url("redis://:pw@h").password == "pw" and parse_redis_url("redis://:pw@h").username is None


@pytest.mark.parametrize("url, words", [
    ("rediss://h:6379", "TLS, rediss://, is not supported"),
    ("http://h", "scheme must be redis://"),
    ("redis://:secret-pw@h:99999", "a port from 1 to 65535"),
    ("redis://:secret-pw@h:port", "a port from 1 to 65535"),
    ("redis://:secret-pw@/0", "no host"),
    ("redis://h/zero", "the path is the database number"),
    ("redis://h/0?timeout=1", "no query"),
])
def test_a_bad_redis_url_is_refused_by_what_is_wrong_never_showing_the_password(url: str, words: str) -> None:
    with pytest.raises(ValueError, match=words) as caught:
        parse_redis_url(url)
    assert "secret-pw" not in str(caught.value)


def test_a_new_connection_logs_in_before_its_first_request() -> None:
    protocol = BudgetProtocol()
    hello = protocol.hello(RedisAddress(host="h", username="ops", password="pw", db=2))
    parser = RespParser()
    parser.receive_data(hello)
    assert parser.next_reply() == [b"AUTH", b"ops", b"pw"] and parser.next_reply() == [b"SELECT", b"2"]
    assert protocol.hello(RedisAddress(host="h")) == b""
    protocol.take(request())
    protocol.receive_data(b"+OK\r\n+OK\r\n*2\r\n:1\r\n$1\r\n0\r\n")
    grant = protocol.next_grant()
    assert isinstance(grant, SliceGrant) and grant.granted == 1


def test_a_refused_log_in_names_the_errors_kind_only() -> None:
    protocol = BudgetProtocol()
    protocol.hello(RedisAddress(host="h", password="pw"))
    protocol.receive_data(b"-WRONGPASS invalid username-password pair pw\r\n")
    with pytest.raises(BudgetStoreError) as caught:
        protocol.next_grant()
    assert str(caught.value) == "redis refused AUTH: WRONGPASS"
