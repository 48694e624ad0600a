"""What the router's parts share: the configuration, the clock's last reading, the command and follow-up queues.

The :class:`~narwhal_core.router.Router` is a dispatcher over parts with one
job each (``docs/design.md``, "The parts of the core"): client connections
(:mod:`~narwhal_core.clients`), the request registry and its answers
(:mod:`~narwhal_core.requests`), the lifecycle handlers
(:mod:`~narwhal_core.lifecycle`), engine legs (:mod:`~narwhal_core.legs`),
the KV ledger (:mod:`~narwhal_core.kv`), engine health
(:mod:`~narwhal_core.health`) and choice (:mod:`~narwhal_core.fleet`) and timers (:mod:`~narwhal_core.timers`). Each
owns its state; what all of them read or append to is here, in one
:class:`Context` the router builds and every part holds. The fleet, the
admission limits and the routing are built by the router and handed in.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from . import journal
from .config import Config, EngineAddress
from .errors import NarwhalError
from .events import Command, Log, WriteJournal
from .fleet import Admission, Fleet
from .http import CodecLike
from .ids import DECODE, PREFILL, Phase
from .journal import ErrorRecord
from .protocols import EngineProtocol, engine_protocol
from .routing import Routing
from .states import FollowUp
from .stats import Stats
from .timers import Timers

if TYPE_CHECKING:
    from .inflight import Leg
    from .tenants import FairAdmission

__all__ = ["Context", "JSON_HEADER", "error_record"]

JSON_HEADER: Final = (b"content-type", b"application/json")


class Context:
    """The parts' common ground: read by all, and the one queue of commands they append to."""

    __slots__ = (
        "config", "out", "followups", "timers", "stats", "fleet", "admission", "now", "wall_offset", "model", "mode", "pd",
        "first_phase", "routing", "phases", "codec", "new_rid", "auth_header", "secret", "draining", "journal_ok",
        "journal_problem", "shortages", "shortage_logged", "require_prefill", "protocol",
    )

    def __init__(
        self, config: Config, *, fleet: Fleet, admission: Admission | FairAdmission, routing: Routing, codec: CodecLike,
        rid_source: Callable[[], str], engine_api_key: str | None, wall_offset: float, now: float,
    ) -> None:  # fmt: skip
        self.config: Final = config
        #: The commands for the adapter, in order (:meth:`Router.next_output` drains them).
        self.out: Final[deque[Command]] = deque()
        #: Work an event leaves for other requests, done once the event is handled
        #: (:meth:`Router.receive` and :meth:`Router.handle_deadline` drain it; docs/design.md, "Follow-up work").
        self.followups: Final[deque[FollowUp]] = deque()
        self.timers: Final = Timers()
        self.stats: Final = Stats()
        #: The engines, their health and load, and the routing policy (the router builds them).
        self.fleet: Final = fleet
        #: The admission limits and queue: first come, first served, or fair among tenants (``[tenants]``).
        self.admission: Final = admission
        #: The time of the event being handled (the adapter passes it in: ``now=``).
        self.now = now
        self.wall_offset = wall_offset
        self.model: Final = config.model.name
        #: Prefill engines are configured (a request may be disaggregated).
        self.pd: Final = self.fleet.pd
        #: Each request's plan at admission: ``pd`` or ``single`` (docs/configure.md, ``[routing]``).
        self.routing: Final = routing
        disaggregated = self.pd and config.routing.mode != "never"
        #: The mode a request refused before admission is journalled with (admitted ones: their plan's).
        self.mode: Final = "pd" if disaggregated else "single"
        self.first_phase: Final[Phase] = PREFILL if disaggregated else DECODE
        #: The phases a request needs an engine for.
        self.phases: Final[tuple[Phase, ...]] = (PREFILL, DECODE) if disaggregated else (DECODE,)
        #: ``routing.disaggregation = "required"``: a request never runs without its prefill leg (docs/routing.md).
        self.require_prefill: Final = config.routing.disaggregation == "required"
        self.codec: Final = codec
        #: How the legs talk to the engines (``engine.protocol``; docs/design.md, "Engine protocols"), chosen once.
        self.protocol: Final[EngineProtocol] = engine_protocol(config.engine.protocol)
        self.new_rid: Final = rid_source
        self.auth_header: tuple[tuple[bytes, bytes], ...] = (
            ((b"authorization", b"Bearer " + engine_api_key.encode("latin-1")),) if engine_api_key else ()
        )
        #: The engine credential, scrubbed from anything an engine says.
        self.secret: Final = engine_api_key.encode("latin-1") if engine_api_key else None
        self.draining = False
        self.journal_ok = True
        self.journal_problem: str | None = None
        #: Local shortages (out of descriptors...) since the last log line about them, and its time.
        self.shortages = 0
        self.shortage_logged = -math.inf

    def wall(self) -> float:
        """The wall-clock time of ``now``, to the microsecond."""
        # floor(x + 0.5) is round() but for exact ties, and a fraction of
        # round()'s cost (which formats the number).
        return math.floor((self.now + self.wall_offset) * 1e6 + 0.5) / 1e6

    def log(self, event: str, **fields: Any) -> None:
        """One structured log line (:class:`~narwhal_core.events.Log`)."""
        self.out.append(Log(event, fields))

    def shortage(self, what: str) -> None:
        """Log Narwhal's own shortages (out of descriptors, memory, ports), at most once a second."""
        self.shortages += 1
        if self.now - self.shortage_logged >= 1.0:
            self.log("local_resources_exhausted", level="error", failed=what, count=self.shortages)
            self.shortages = 0
            self.shortage_logged = self.now

    def write_terminal(self, record: journal.TerminalRecord) -> None:
        """Journal a request refused before it reached the lifecycle, and count it."""
        self.stats.observe(record)
        self.stats.journal_records["terminal"] += 1
        self.out.append(WriteJournal(journal.encode(record), True))

    def engine_headers(self, engine: EngineAddress, bid: str) -> tuple[tuple[bytes, bytes], ...]:
        """The headers of a request to an engine carrying a backend ID."""
        return ((b"host", engine.authority), JSON_HEADER, (b"x-request-id", bid.encode()), *self.auth_header)

    def no_engine(self, phase: Phase) -> NarwhalError:
        """The 503 of a request whose ``phase`` leg no engine in rotation can take (docs/contract.md).

        ``engine_unavailable``; for a prefill leg with ``routing.disaggregation
        = "required"``, ``no_prefill_engine``, counted by reason (docs/routing.md,
        "Required disaggregation"): engines joining or out of rotation are in
        the fleet, draining ones have left it.
        """
        if phase != PREFILL or not self.require_prefill:
            return NarwhalError(f"No healthy {phase} engine is available.", status=503, code="engine_unavailable")
        present = any(not e.draining for e in self.fleet.engines[PREFILL])
        self.stats.prefill_refusals["none_healthy" if present else "none_in_fleet"] += 1
        return NarwhalError(
            f"{'No prefill engine is healthy' if present else 'The fleet has no prefill engine'}, and this router "
            'requires disaggregation (routing.disaggregation = "required"): no request runs on a decode engine '
            "alone; retry later.",
            status=503, code="no_prefill_engine",
        )

    def ready_problems(self) -> list[str]:
        """Why ``/ready`` would answer 503 (none: ready)."""
        problems = []
        if self.draining:
            problems.append("shutting down")
        if not self.journal_ok:
            problems.append(f"journal: {self.journal_problem or 'write failed'}")
        for phase in self.phases:
            if not self.fleet.has_healthy(phase):
                problems.append(f"no healthy {phase} engine")
            elif not self.fleet.has_answered(phase):
                # Never reached yet (a typo'd host looks healthy until its probes fail).
                problems.append(f"no {phase} engine has answered yet")
        return problems


def error_record(error: NarwhalError, leg: Leg | None = None) -> ErrorRecord:
    """The ``error`` of a terminal record: what the client was told, and the leg and engine to blame."""
    return ErrorRecord(
        type=error.type, code=error.code, param=error.param, message=error.message,
        leg=None if leg is None else leg.phase, engine=None if leg is None else leg.engine.url,
    )
