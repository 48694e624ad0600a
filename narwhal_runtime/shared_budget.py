"""Tenant budgets shared by several router replicas through one Redis (docs/operate.md, "Budgets across replicas").

The store is a token bucket per tenant and kind of budget, held in Redis
under ``narwhal:budget:<tenant>:<kind>`` (a hash: ``tokens``, ``at``) and
changed only by :data:`SCRIPT`, which Redis runs atomically: it refills
the bucket for the time gone since ``at`` (``rate`` units a second, up to
``capacity``), takes up to the units asked, and answers how many it granted
and the seconds until the bucket holds one unit again. The time is Redis's
own (``TIME`` inside the script), so the replicas' clocks do not matter.
A script that reads ``TIME`` and then writes needs Redis to replicate its
effects rather than the script: the default from Redis 5 on, the only way
from Redis 7; the script asks for it first (``redis.replicate_commands()``,
a no-op where it is the default), so Redis 3.2 and 4 run it too.

Slices. A replica does not ask Redis for each request: it asks for a
slice, say a tenth of the capacity (:class:`SliceHolder`), spends it
locally and asks again when what it holds falls to its low-water mark, so
one Redis round trip serves many requests. The bound: Redis grants at most
``capacity + rate * t`` units over any window of ``t`` seconds, and a
replica admits only units it was granted, so the sum admitted by every
replica together never exceeds the budget. It can fall short of it by
what the replicas hold unspent: each holds at most ``low_water + slice``
units (it asks for a slice only at or below the mark, one request at a
time; above it, only for what a waiting request lacks), or, if more, what
its largest waiting request costs while that request gathers its units.
So ``R`` replicas keep at most ``R * (low_water + slice)`` units out of
use at any one time (requests costing less than a slice); a slice of
``capacity / 10`` with its mark at half a slice leaves at most
``0.15 * R * capacity``.

The interface the admission wires to:

* :func:`parse_redis_url` (``redis://[[user]:password@]host[:port][/db]``)
  gives a :class:`RedisAddress`; its ``str`` is the address without the
  password, for a log line.
* :class:`SliceRequest` (tenant, kind, rate, capacity, units) and what
  comes of it: :class:`SliceGrant` (granted, retry_after) or
  :class:`StoreUnreachable` (reason).
* :class:`SliceHolder`: one tenant's budget of one kind on this replica,
  sans-IO: ``spend(units)``, ``wants(units)`` gives the
  :class:`SliceRequest` to send when it should ask, ``granted(grant)`` /
  ``failed()`` when it is answered.
* :class:`BudgetProtocol`: the exchange with Redis, sans-IO (bytes out,
  bytes in, grants out; ``EVALSHA``, and ``EVAL`` once when Redis answers
  ``NOSCRIPT``).
* :class:`SharedBudgetClient` ``(io, address, timeout=, backoff=,
  max_backoff=, on_change=)``: one TCP connection (logged in with ``AUTH``
  and ``SELECT`` when it opens), written once for both runtimes over their
  :class:`~.runtime_io.RuntimeIO`; ``await client.take(request)`` answers
  within ``timeout`` (a
  :class:`StoreUnreachable` when Redis does not: refused, reset, silent,
  or answering errors), waits out a backoff before connecting again, and
  calls ``on_change(up, reason)`` when the store goes down or comes back.
  No password or other secret is ever part of a reason.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import socket
import urllib.parse
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import attrs

from . import socket_io
from .control import TimeLimitExpired, connect_first, resolve
from .engine_probe import describe_failure
from .resp import NEED_DATA, ErrorReply, NeedData, RespParser, RespProtocolError, SimpleString, encode_command
from .runtime_io import RuntimeIO

__all__ = [
    "SCRIPT", "SCRIPT_SHA", "bucket_key", "RedisAddress", "parse_redis_url", "SliceRequest", "SliceGrant", "StoreUnreachable", "BudgetStoreError",
    "BudgetProtocol", "SliceHolder", "SharedBudgetClient",
]

#: The token bucket, run atomically by Redis: KEYS[1] the bucket; ARGV rate
#: (units a second), capacity, units wanted. Answers {granted, "seconds until
#: one unit"} (a string: Redis truncates a Lua number to an integer).
SCRIPT: Final = b"""\
redis.replicate_commands()
local rate = tonumber(ARGV[1])
local capacity = tonumber(ARGV[2])
local want = tonumber(ARGV[3])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local held = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(held[1])
local at = tonumber(held[2])
if tokens == nil or at == nil then
  tokens = capacity
  at = now
end
if now > at then
  tokens = tokens + (now - at) * rate
  at = now
end
if tokens > capacity then tokens = capacity end
local granted = math.floor(tokens)
if granted > want then granted = want end
if granted < 0 then granted = 0 end
tokens = tokens - granted
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens), 'at', string.format('%.17g', at))
redis.call('PEXPIRE', KEYS[1], math.ceil((capacity - tokens) / rate * 1000) + 1000)
local wait = 0
if tokens < 1 then wait = (1 - tokens) / rate end
return {granted, string.format('%.6f', wait)}
"""

#: The script's SHA-1, what ``EVALSHA`` names it by.
SCRIPT_SHA: Final = hashlib.sha1(SCRIPT).hexdigest()

_KIND: Final = re.compile(r"[a-z][a-z0-9_]{0,31}\Z")
#: The longest tenant name a key is made of.
MAX_TENANT_BYTES: Final = 256


def bucket_key(tenant: str, kind: str) -> bytes:
    """The Redis key of ``tenant``'s bucket of ``kind`` (a kind holds no colon, so keys never collide)."""
    return b"narwhal:budget:" + tenant.encode() + b":" + kind.encode()


@attrs.frozen(kw_only=True)
class RedisAddress:
    """Where the store is, and how to log in (``redis://[[user]:password@]host[:port][/db]``)."""

    host: str
    """A name or an IP address."""
    port: int = 6379
    """Its TCP port."""
    db: int = 0
    """The database number (``SELECT``ed when not 0)."""
    username: str | None = None
    """The ACL user (Redis 6), if any."""
    password: str | None = attrs.field(default=None, repr=False)
    """Sent by ``AUTH`` and nowhere else: never in a repr, a reason or a log line."""

    def __str__(self) -> str:
        """The address without its credentials, for a log line."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"redis://{host}:{self.port}/{self.db}"


def parse_redis_url(url: str) -> RedisAddress:
    """``redis://[[user]:password@]host[:port][/db]`` as a :class:`RedisAddress`; raises ``ValueError``.

    The error names what is wrong, never the password.
    """
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError("not a redis://host:port URL (a port from 1 to 65535)") from None
    if parts.scheme != "redis":
        raise ValueError(f"the scheme must be redis:// (TLS, rediss://, is not supported), not {parts.scheme!r}")
    if not parts.hostname:
        raise ValueError("no host")
    if parts.query or parts.fragment:
        raise ValueError("no query or fragment is taken")
    path = parts.path.lstrip("/")
    if path and not (path.isdigit() and len(path) <= 5):
        raise ValueError(f"the path is the database number, not {path[:20]!r}")
    unquote = urllib.parse.unquote
    return RedisAddress(
        host=parts.hostname, port=6379 if port is None else port, db=int(path or 0),
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password is not None else None,
    )


def _positive(instance: object, attribute: Any, value: float) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a finite number above 0, not {value!r}")


def _count(instance: object, attribute: Any, value: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"{attribute.name} must be an integer of at least 1, not {value!r}")


def _tenant(instance: object, attribute: Any, value: str) -> None:
    if not value or len(value.encode()) > MAX_TENANT_BYTES:
        raise ValueError(f"tenant must be 1 to {MAX_TENANT_BYTES} bytes")


def _kind(instance: object, attribute: Any, value: str) -> None:
    if not _KIND.match(value):
        raise ValueError(f"kind must match {_KIND.pattern} (lower-case, no colon), not {value!r}")


@attrs.frozen(kw_only=True)
class SliceRequest:
    """A replica asks the shared bucket of one tenant and kind for up to ``units`` units."""

    tenant: str = attrs.field(validator=_tenant)
    """The tenant the budget is of."""
    kind: str = attrs.field(validator=_kind)
    """Which of its budgets (``requests``, ``tokens``...)."""
    rate: float = attrs.field(validator=_positive)
    """The budget's refill, in units a second: every replica's must be the same (each call refills by its own)."""
    capacity: int = attrs.field(validator=_count)
    """The most units the bucket holds (the burst): every replica's must be the same, as ``rate``."""
    units: int = attrs.field(validator=_count)
    """How many units this replica asks for (a slice)."""

    def arguments(self) -> tuple[bytes, ...]:
        """The script's keys and arguments, after its number of keys."""
        return (b"1", bucket_key(self.tenant, self.kind), repr(float(self.rate)).encode(),
                b"%d" % self.capacity, b"%d" % self.units)


@attrs.frozen(kw_only=True)
class SliceGrant:
    """What the shared bucket gave."""

    request: SliceRequest
    """What was asked."""
    granted: int
    """Units granted, from 0 to ``request.units``: this replica's to spend."""
    retry_after: float
    """Seconds until the bucket holds one unit again (0 when it still does)."""


@attrs.frozen(kw_only=True)
class StoreUnreachable:
    """The shared bucket could not be asked: spend local budgets (docs/operate.md, "Budgets across replicas")."""

    request: SliceRequest
    """What was asked."""
    reason: str
    """Why, in a few words (``connection refused``, ``timeout``, ``redis error: LOADING``...)."""


class BudgetStoreError(Exception):
    """Redis answered what the script never does (an error reply other than a first ``NOSCRIPT``, another shape)."""


class BudgetProtocol:
    """The exchange with Redis over one connection, sans-IO: requests pipelined, answered in order.

    ``take(request)`` returns the bytes to write; feed what Redis sends to
    ``receive_data`` and pull outcomes with ``next_grant`` until
    :data:`~.resp.NEED_DATA`. Redis forgets scripts (a restart, ``SCRIPT
    FLUSH``): a ``NOSCRIPT`` answer queues the same request again as
    ``EVAL`` with the script's text, which loads it for the next
    ``EVALSHA``; drain those bytes with ``data_to_send`` and write them.
    Anything else unexpected raises :class:`BudgetStoreError` (or the
    parser's :class:`~.resp.RespProtocolError`); the connection is then
    done with.
    """

    __slots__ = ("_parser", "_pending", "_outbox")

    def __init__(self) -> None:
        self._parser = RespParser(max_bulk_bytes=4096, max_array_length=16, max_depth=2)
        #: What was sent and waits for its answer, in order: a request (True: sent as EVAL), or the
        #: name of a log-in command that answers +OK.
        self._pending: deque[tuple[SliceRequest | str, bool]] = deque()
        self._outbox = bytearray()

    @property
    def waiting(self) -> int:
        """How many requests wait for their answer."""
        return len(self._pending)

    def hello(self, address: RedisAddress) -> bytes:
        """The bytes that log a new connection in (``AUTH``, ``SELECT``), to write before any request; maybe none."""
        data = b""
        if address.password is not None:
            user = () if address.username is None else (address.username,)
            data += encode_command(b"AUTH", *user, address.password)
            self._pending.append(("AUTH", False))
        if address.db:
            data += encode_command(b"SELECT", address.db)
            self._pending.append(("SELECT", False))
        return data

    def take(self, request: SliceRequest) -> bytes:
        """The bytes that ask Redis for ``request`` (``EVALSHA``)."""
        self._pending.append((request, False))
        return encode_command(b"EVALSHA", SCRIPT_SHA, *request.arguments())

    def data_to_send(self) -> bytes:
        """Bytes to write now (a request sent again as ``EVAL``), taken from the outbox."""
        data = bytes(self._outbox)
        self._outbox.clear()
        return data

    def receive_data(self, data: bytes) -> None:
        """Bytes Redis sent."""
        self._parser.receive_data(data)

    def next_grant(self) -> SliceGrant | NeedData:
        """The next request's grant, or :data:`~.resp.NEED_DATA`; raises :class:`BudgetStoreError`."""
        while True:
            reply = self._parser.next_reply()
            if reply is NEED_DATA:
                return NEED_DATA
            if not self._pending:
                raise BudgetStoreError("redis answered a request never sent")
            request, as_eval = self._pending.popleft()
            if isinstance(request, str):
                if isinstance(reply, ErrorReply):  # its kind only: the message could quote what was sent
                    raise BudgetStoreError(f"redis refused {request}: {reply.kind}")
                if reply != SimpleString(b"OK"):
                    raise BudgetStoreError(f"redis answered {request} with {str(reply)[:40]}, not OK")
                continue
            if isinstance(reply, ErrorReply):
                if reply.kind == "NOSCRIPT" and not as_eval:
                    self._pending.append((request, True))
                    self._outbox += encode_command(b"EVAL", SCRIPT, *request.arguments())
                    continue
                raise BudgetStoreError(f"redis error: {reply.message[:120]}")
            return _grant(request, reply)


def _grant(request: SliceRequest, reply: object) -> SliceGrant:
    granted: object = None
    wait = math.nan
    if isinstance(reply, list) and len(reply) == 2 and isinstance(reply[1], bytes):
        granted = reply[0]
        try:
            wait = float(reply[1])
        except ValueError:
            pass
    if not (type(granted) is int and 0 <= granted <= request.units and math.isfinite(wait) and wait >= 0):
        raise BudgetStoreError(f"the script answered {str(reply)[:80]}, not [granted, seconds]")
    return SliceGrant(request=request, granted=granted, retry_after=wait)


class SliceHolder:
    """One tenant's budget of one kind on this replica: the units it was granted, spent locally.

    Sans-IO; the bound it keeps is the module's. ``slice`` is what it asks
    for at a time (``fraction`` of the capacity, at least one unit), and it
    asks when it holds ``low_water`` units or fewer (half a slice), one
    request at a time.
    """

    __slots__ = ("tenant", "kind", "rate", "capacity", "slice", "low_water", "held", "asking")

    def __init__(self, *, tenant: str, kind: str, rate: float, capacity: int, fraction: float = 0.1) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], not {fraction!r}")
        SliceRequest(tenant=tenant, kind=kind, rate=rate, capacity=capacity, units=1)  # validates them
        self.tenant, self.kind, self.rate, self.capacity = tenant, kind, rate, capacity
        #: Units asked for at a time.
        self.slice = max(1, math.ceil(capacity * fraction))
        #: At or below this many units held, it asks for another slice.
        self.low_water = self.slice // 2
        #: Units granted and not spent yet.
        self.held = 0
        #: Whether a request is out.
        self.asking = False

    def spend(self, units: int) -> bool:
        """Spend ``units`` of what is held, if that many are; ``False`` (nothing spent) if not."""
        if units > self.held:
            return False
        self.held -= units
        return True

    def wants(self, units: int = 0) -> SliceRequest | None:
        """The request to send now, if one should be (none while one is out).

        ``units`` is what a request waiting to be admitted needs: the ask is
        for what it lacks if that is more than a slice, or if more than the
        low-water mark is held.
        """
        if self.asking or (self.held > self.low_water and units <= self.held):
            return None
        self.asking = True
        # Above the mark only a request's lack is asked for: what is held stays within the module's bound.
        ask = max(self.slice, units - self.held) if self.held <= self.low_water else units - self.held
        return SliceRequest(tenant=self.tenant, kind=self.kind, rate=self.rate, capacity=self.capacity,
                            units=min(ask, self.capacity))

    def granted(self, grant: SliceGrant) -> None:
        """The request was answered: what it granted is held."""
        self.asking = False
        self.held += grant.granted

    def failed(self) -> None:
        """The request got no answer (:class:`StoreUnreachable`): it may be asked again."""
        self.asking = False


class _Turns:
    """Tasks take turns on the connection, first come first served."""

    __slots__ = ("_io", "_busy", "_waiting")

    def __init__(self, io: RuntimeIO) -> None:
        self._io = io
        self._busy = False
        self._waiting: deque[Any] = deque()

    async def acquire(self) -> None:
        if not self._busy:
            self._busy = True
            return
        event = self._io.event()
        self._waiting.append(event)
        try:
            await event.wait()
        except BaseException:
            if event in self._waiting:
                self._waiting.remove(event)
            else:
                self.release()  # handed the turn while being cancelled: pass it on
            raise

    def release(self) -> None:
        if self._waiting:
            self._waiting.popleft().set()  # the turn passes on: still busy
        else:
            self._busy = False


class SharedBudgetClient:
    """The shared buckets over one TCP connection to Redis, the same on both runtimes.

    ``await take(request)`` connects if needed, asks, and answers a
    :class:`SliceGrant`, or a :class:`StoreUnreachable` within ``timeout``
    seconds (connecting included). After a failure it does not try again
    for ``backoff`` seconds, doubled at each failure in a row up to
    ``max_backoff``; until then ``take`` answers :class:`StoreUnreachable`
    at once, so no request waits on a Redis that is down. Tasks take turns
    on the connection. ``on_change(up, reason)`` is called (synchronously)
    with the first outcome and each time the store goes down or comes back.
    """

    def __init__(self, io: RuntimeIO, address: RedisAddress, *, timeout: float = 0.25, backoff: float = 0.1,
                 max_backoff: float = 5.0, on_change: Callable[[bool, str], object] | None = None) -> None:
        self._io = io
        #: Where Redis is (its password sent only by ``AUTH``).
        self.address = address
        #: The longest a take waits for Redis, connecting included.
        self.timeout = timeout
        self._backoff = self.backoff = backoff
        self.max_backoff = max_backoff
        self._on_change = on_change
        self._turns = _Turns(io)
        self._sock: socket.socket | None = None
        self._protocol = BudgetProtocol()
        #: Whether the store answered last time (``None``: not asked yet).
        self.up: bool | None = None
        #: Why it did not, when it did not.
        self.reason = ""
        self._retry_at = -math.inf
        self._failures: tuple[type[BaseException], ...] = (
            OSError, TimeLimitExpired, RespProtocolError, BudgetStoreError, *io.CONTROL_BROKEN)

    async def take(self, request: SliceRequest) -> SliceGrant | StoreUnreachable:
        """Ask the shared bucket for ``request.units``; never raises but for a cancellation."""
        if self._io.now() < self._retry_at:
            return StoreUnreachable(request=request, reason=self.reason)
        await self._turns.acquire()
        try:
            if self._io.now() < self._retry_at:  # failed while this task waited its turn
                return StoreUnreachable(request=request, reason=self.reason)
            try:
                async with self._io.time_limit(self.timeout):
                    grant = await self._exchange(request)
            except self._failures as exc:
                return self._failed(request, exc)
            except BaseException:
                self._hang_up()  # cancelled mid-exchange: its answer would come to the next one
                raise
            self._set(True, "")
            self._backoff = self.backoff
            return grant
        finally:
            self._turns.release()

    def close(self) -> None:
        """Close the connection (a later ``take`` opens another)."""
        self._hang_up()

    async def _exchange(self, request: SliceRequest) -> SliceGrant:
        io = self._io
        sock = self._sock
        protocol = self._protocol
        hello = b""
        if sock is None:
            infos = await resolve(self.address.host, self.address.port, io.getaddrinfo)
            sock = self._sock = await connect_first(infos, io.writable, io.time_limit, self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = protocol.hello(self.address)
        send = functools.partial(socket_io.send_all, sock, writable=io.writable)
        await send(hello + protocol.take(request))
        while True:
            data = await socket_io.receive(sock, io.readable)
            if not data:
                raise ConnectionResetError("redis closed the connection")
            protocol.receive_data(data)
            grant = protocol.next_grant()
            if resend := protocol.data_to_send():
                await send(resend)
            if isinstance(grant, SliceGrant):
                return grant

    def _failed(self, request: SliceRequest, exc: BaseException) -> StoreUnreachable:
        self._hang_up()
        if isinstance(exc, TimeLimitExpired):
            reason = "timeout"
        elif isinstance(exc, (BudgetStoreError, RespProtocolError)):
            reason = str(exc)
        else:
            reason = describe_failure(exc)
        self._retry_at = self._io.now() + self._backoff
        self._backoff = min(self._backoff * 2, self.max_backoff)
        self._set(False, reason)
        return StoreUnreachable(request=request, reason=reason)

    def _hang_up(self) -> None:
        sock, self._sock = self._sock, None
        self._protocol = BudgetProtocol()
        if sock is not None:
            self._io.close_socket(sock)

    def _set(self, up: bool, reason: str) -> None:
        changed = self.up is not up
        self.up, self.reason = up, reason
        if changed and self._on_change is not None:
            self._on_change(up, reason)
