"""Engine connections on trio: pooled keep-alive legs and control requests.

Legs run on pooled HTTP/1.1 connections, one task each: write the request
bytes the router built, feed every read back as ``LegData``, and hand the
connection back to the pool when the router says the answer is complete and
the connection reusable. Control requests (health probes, KV releases) use
httpx; a ``decode_abort`` release writes a raw request and hangs up.
Every failure and cancellation is reported back to the router.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
import trio

from narwhal_core import ControlDone, EngineAddress, Event, LegData, LegFailed, StartControl, StartLeg

__all__ = ["Engines"]

READ_SIZE = 65536


class _Leg:
    __slots__ = ("key", "scope", "stream", "finished", "reusable", "cancelled")

    def __init__(self, key: str) -> None:
        self.key = key
        self.scope: trio.CancelScope | None = None
        self.stream: trio.SocketStream | None = None
        self.finished = False
        self.reusable = False
        self.cancelled = False


class Engines:
    """Legs and control requests for one router, on one nursery."""

    def __init__(
        self,
        nursery: trio.Nursery,
        feed: Callable[[Event], Awaitable[None]],
        *,
        pool_size: int,
    ) -> None:
        self._nursery = nursery
        self._feed = feed
        self._pool_size = pool_size
        self._idle: dict[str, list[trio.SocketStream]] = {}
        self._legs: dict[str, _Leg] = {}
        self._http: httpx.AsyncClient | None = None

    # commands from the router (synchronous: they only start or flag things)

    def start_leg(self, cmd: StartLeg) -> None:
        """Run a leg in its own task."""
        leg = _Leg(cmd.leg)
        self._legs[cmd.leg] = leg
        self._nursery.start_soon(self._run_leg, cmd, leg)

    def cancel_leg(self, key: str) -> None:
        """Stop a leg: closing its socket makes the engine abort the request."""
        leg = self._legs.get(key)
        if leg is None:
            return
        leg.cancelled = True
        if leg.stream is not None:
            leg.stream.socket.close()  # wakes the leg's pending read with ClosedResourceError
        elif leg.scope is not None:
            leg.scope.cancel()  # still connecting

    def finish_leg(self, key: str, reusable: bool) -> None:
        """The answer is complete: the leg task returns its connection to the pool."""
        leg = self._legs.get(key)
        if leg is not None:
            leg.finished = True
            leg.reusable = reusable

    def start_control(self, cmd: StartControl) -> None:
        """Run a control request in its own task."""
        self._nursery.start_soon(self._run_control, cmd)

    async def aclose(self) -> None:
        """Close pooled connections and the control client."""
        for streams in self._idle.values():
            for stream in streams:
                stream.socket.close()
        self._idle.clear()
        if self._http is not None:
            await self._http.aclose()

    # tasks

    async def _connect(self, engine: EngineAddress, timeout: float, leg: _Leg) -> trio.SocketStream | None:
        with trio.CancelScope() as scope:
            leg.scope = scope
            with trio.fail_after(timeout):
                return await trio.open_tcp_stream(engine.host, engine.port)
        return None  # cancelled while connecting

    async def _run_leg(self, cmd: StartLeg, leg: _Leg) -> None:
        key = cmd.leg
        stream: trio.SocketStream | None = None
        reported = False
        try:
            idle = None if cmd.fresh_connection else self._idle.get(cmd.engine.url)
            reused = bool(idle)
            if idle:
                stream = idle.pop()
            else:
                try:
                    stream = await self._connect(cmd.engine, cmd.connect_timeout, leg)
                except trio.TooSlowError:
                    reported = True
                    await self._feed(LegFailed(key, "connect_timeout"))
                    return
                except OSError:
                    reported = True
                    await self._feed(LegFailed(key, "connect_failed"))
                    return
                if stream is None:
                    return
            leg.stream = stream
            if leg.cancelled:
                return
            try:
                await stream.send_all(cmd.data)
                fresh = True
                while not leg.finished:
                    data = await stream.receive_some(READ_SIZE)
                    if not data and fresh and reused:
                        # A pooled connection the engine had closed while idle:
                        # the router retries on a fresh one; not an engine fault.
                        reported = True
                        await self._feed(LegFailed(key, "dropped", True))
                        return
                    fresh = False
                    await self._feed(LegData(key, data))
                    if not data:
                        break
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                if not leg.finished and not leg.cancelled:
                    reported = True
                    await self._feed(LegFailed(key, "dropped", reused))
        except BaseException:
            # Cancelled from outside (shutdown): the router must not think the leg still runs.
            if not reported and not leg.finished and not leg.cancelled:
                with trio.CancelScope(shield=True):
                    await self._feed(LegFailed(key, "dropped"))
            raise
        finally:
            if self._legs.get(key) is leg:  # a fresh-connection retry may reuse the key
                del self._legs[key]
            if stream is not None:
                pool = self._idle.setdefault(cmd.engine.url, [])
                if leg.finished and leg.reusable and not leg.cancelled and len(pool) < self._pool_size:
                    pool.append(stream)
                else:
                    stream.socket.close()

    async def _run_control(self, cmd: StartControl) -> None:
        status: int | None = None
        error: str | None = None
        try:
            with trio.fail_after(cmd.timeout):
                if cmd.drop_after_send:
                    stream = await trio.open_tcp_stream(cmd.engine.host, cmd.engine.port)
                    try:
                        await stream.send_all(cmd.data)
                    finally:
                        stream.socket.close()
                else:
                    if self._http is None:
                        self._http = httpx.AsyncClient(trust_env=False)
                    response = await self._http.request(
                        cmd.method, cmd.engine.url + cmd.target,
                        headers=list(cmd.headers), content=cmd.body, timeout=cmd.timeout,
                    )
                    status = response.status_code
        except (trio.TooSlowError, httpx.TimeoutException):
            error = "timeout"
        except (OSError, httpx.HTTPError, trio.BrokenResourceError) as exc:
            error = type(exc).__name__
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._feed(ControlDone(cmd.key, None, "cancelled"))
            raise
        await self._feed(ControlDone(cmd.key, status, error))
