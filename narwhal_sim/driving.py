"""Driving the pure engine core (:mod:`narwhal_sim.engine`) on the asyncio loop.

:class:`CoreDriver` steps the core in real time scaled by ``--speed`` (or at
once at speed 0), hands each output to the :class:`Flow` of its request and
publishes the core's KV events.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from narwhal_sim.engine import DECODE_REMOTE, EngineCore, EngineOutput, Finished, Started, StepConfig, Tokens
from narwhal_sim.kv_events import KvEventPublisher
from narwhal_sim.protocol import ApiError

__all__ = ["CoreDriver", "Flow"]


class Flow:
    """A completion's view of its request in the engine core, updated by :meth:`CoreDriver.dispatch`."""

    __slots__ = ("kind", "prompt_tokens", "started", "generated", "finished", "cached", "block_ids", "waiter",
                 "aborted")  # fmt: skip

    def __init__(self, kind: str, prompt_tokens: int) -> None:
        self.kind = kind
        self.prompt_tokens = prompt_tokens
        self.started = False
        self.generated = 0
        self.finished = False
        self.cached = 0
        self.block_ids: list[int] = []
        self.waiter: asyncio.Future[None] | None = None
        #: ``POST /abort_requests`` named it (docs/simulator.md, "vLLM versions").
        self.aborted = False

    def abort(self) -> None:
        """Mark aborted and wake the waiting handler."""
        self.aborted = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def check_aborted(self, external: str | None) -> None:
        """500 for the client of an aborted request (vLLM ends it with ``finish_reason`` ``abort``)."""
        if self.aborted:
            raise ApiError(500, f"Request {external} was aborted")

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        """Wait until ``condition()`` holds (checked after each output for this request) or it is aborted."""
        while not condition() and not self.aborted:
            waiter = asyncio.get_running_loop().create_future()
            self.waiter = waiter
            await waiter


class CoreDriver:
    """The engine core, the live requests' flows, the step timer and the KV-event publisher."""

    def __init__(self, step_config: StepConfig, counters: dict[str, int], *, speed: float, kv_events: bool,
                 loop: asyncio.AbstractEventLoop) -> None:  # fmt: skip
        self.speed = speed
        self.loop = loop
        self.counters = counters
        self.step_config = step_config
        #: The pure engine core; at speed > 0 it steps in real time (one step per token), at
        #: speed 0 instantly (runs of identical decode steps coalesced).
        self.core = EngineCore(step_config, kv_events=kv_events, coalesce=speed == 0)
        #: Engine request ID -> the flow of its completion, of live requests.
        self.flows: dict[str, Flow] = {}
        #: External request ID (``cmpl-<X-Request-Id>-0``) -> engine request ID, of live requests.
        self.external: dict[str, str] = {}
        #: Set when the engine listens, if it publishes KV events.
        self.publisher: KvEventPublisher | None = None
        self._core_t0 = time.monotonic()
        self._step_timer: asyncio.TimerHandle | None = None

    def cancel_timer(self) -> None:
        if self._step_timer is not None:
            self._step_timer.cancel()

    def core_now(self) -> float:
        """The core's time: modelled seconds since start (at speed 0, the core's own clock)."""
        speed = self.speed
        if speed == 0:
            return self.core.now
        return (time.monotonic() - self._core_t0) * speed

    def free_held(self, request_id: str) -> None:
        """Free blocks the core holds for ``request_id`` and hand on what follows."""
        self.core.free_held(request_id, now=self.core_now())
        self.pump()

    def pump(self) -> None:
        """Hand the core's due outputs to their requests and arm the timer for the next step end."""
        core = self.core
        speed = self.speed
        if speed == 0:
            # Instantly: every step runs now, one after the other.
            self.dispatch(core.run_until_idle())
        else:
            now = self.core_now()
            self.dispatch(core.advance(now=now))
            t = core.next_event_time()
            if self._step_timer is not None:
                self._step_timer.cancel()
                self._step_timer = None
            if t is not None:
                self._step_timer = self.loop.call_later(max(t - now, 0.0) / speed, self._on_step_timer)
        self.publish()

    def publish(self) -> None:
        if self.publisher is not None:
            events = self.core.take_kv_events()
            if events:
                self.publisher.publish(events, time.time())

    def _on_step_timer(self) -> None:
        self._step_timer = None
        self.pump()

    def dispatch(self, outputs: list[EngineOutput]) -> None:
        flows = self.flows
        for out in outputs:
            flow = flows.get(out.request_id)
            if flow is None:
                continue
            if type(out) is Tokens:
                flow.generated += out.count
            elif type(out) is Started:
                flow.started = True
                if flow.kind != DECODE_REMOTE:
                    flow.cached = out.cached_tokens
                    counters = self.counters
                    counters["prompt_tokens"] += flow.prompt_tokens - out.cached_tokens
                    counters["cached_tokens"] += out.cached_tokens
            elif type(out) is Finished:
                flow.finished = True
                flow.block_ids = list(out.block_ids)
            waiter = flow.waiter
            if waiter is not None:
                flow.waiter = None
                if not waiter.done():
                    waiter.set_result(None)
