"""The KV ledger: what each prefill handed off, who pulled it, and its release (docs/operate.md).

A prefill leg's answer names the KV its engine now holds (a
:class:`~narwhal_core.leg_bodies.KvHandoff`); the ledger keeps one :class:`Kv`
record per handoff, on the leg and, until a decode leg pulls it, on the
request. What no decode leg pulled is released as ``engine.kv_release``
says, and the release's answer settles the record's outcome, which the
request's terminal record carries. A decode request never carries KV past
its ``start_by``: its lease may have run out (docs/operate.md, "KV leases").
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Final

from . import wire
from .context import JSON_HEADER, Context
from .events import ControlDone, StartControl
from .ids import DECODE, backend_id
from .inflight import Kv
from .leg_bodies import KvHandoff, release_said, release_unconfirmed

if TYPE_CHECKING:
    from .fleet import EngineState
    from .inflight import Leg, Request

__all__ = ["HOLD_UNREAD", "Kv", "KvLedger", "LEASE_SHORT", "NOTHING_HELD"]

#: A KV record's ``error`` when the abort endpoint found nothing to free.
NOTHING_HELD: Final = (
    "the engine held no KV for this owner any more: pulled or freed by the decode engine, or its lease expired"
)
#: A KV record's ``error`` when its lease ran short before a decode request could carry it.
LEASE_SHORT: Final = "its lease was running short before a decode request could carry it"
#: Appended to :data:`LEASE_SHORT` when a decode leg had not read KV nothing renews by its ``hold_ends``.
HOLD_UNREAD: Final = (
    ": the decode engine had not read it as its hold was ending (nothing renews it before vLLM's KV leases),"
    " so the decode leg was cancelled"
)
#: Appended to a ``held_until_lease`` / ``lease`` record whose prefill answer
#: shows vLLM's KV lease (its lease-era keys): that reaper stops at the first
#: unexpired entry, so the blocks may stay held past the lease (vLLM issue
#: 58222; docs/operate.md, "KV release in operation").
REAPER_STUCK: Final = (
    "a vLLM engine with KV leases (0.21 on; vLLM issue 58222, open at 0.27.1) may hold it past its lease: "
    "its reaper frees nothing behind an entry still renewed"
)
#: Keys only a prefill answer of vLLM's lease era carries (docs/simulator.md, "vLLM versions").
_LEASE_ERA_KEYS: Final = ("transfer_mode", "remote_blocks_expiry_time")
#: A decode leg (or a release carried by a decode request) starts only within
#: this share of ``engine.kv_lease_s`` after the prefill's answer; the rest
#: covers its way to the decode engine's scheduler and, on vLLM with KV
#: leases, the decode engine's first lease renewal, sent every sixth of the
#: lease (docs/operate.md, "KV leases").
_LEASE_START_SHARE: Final = 2.0 / 3.0
#: KV no decode engine renews (vLLM before KV leases, or params without
#: ``tp_size``) must be read within ``engine.kv_lease_s``: a decode leg that
#: has shown no sign of it by this share of the lease is cancelled, as the
#: decode engine may be queueing it (docs/operate.md, "KV leases").
_HOLD_WATCH_SHARE: Final = 0.95
#: Failures that mean a control request never reached the engine (nothing was sent).
_NOT_SENT: Final = ("connection refused", "DNS failure", "connection failed", "connect timeout")


def _lease_era(params: dict[str, Any]) -> bool:
    """Whether a prefill answer's params come from vLLM with KV leases (about 0.21 on)."""
    return any(key in params for key in _LEASE_ERA_KEYS)


def _renewed(params: dict[str, Any] | None) -> bool:
    """Whether a decode engine renews this KV's hold while the decode request waits in its queue.

    vLLM with KV leases does, by its heartbeat, when the params carry
    ``tp_size``; before the lease nothing renews it, and a read after
    ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` finds freed blocks (vLLM issue 21570;
    docs/operate.md, "KV leases").
    """
    if params is None:
        return False
    return _lease_era(params) and params.get("tp_size") is not None



class KvLedger:
    """Handoffs, pulls and releases of prefilled KV; settles each release from its control answer."""

    __slots__ = ("ctx", "releases", "warned_no_kv", "protocol")

    def __init__(self, ctx: Context) -> None:
        self.ctx: Final = ctx
        #: Releases in flight, by control key.
        self.releases: dict[str, tuple[Request, Kv]] = {}
        #: Prefill engines already warned about answers without KV (see :meth:`no_handoff`).
        self.warned_no_kv: set[str] = set()
        #: A release's decode request is the engine protocol's (docs/design.md, "Engine protocols").
        self.protocol: Final = ctx.protocol

    # ---------------------------------------------------------------- handoffs

    def handed_off(self, req: Request, leg: Leg, handoff: KvHandoff) -> Kv:
        """A prefill leg's answer handed off KV: the request now holds it."""
        kv = leg.kv = req.kv = Kv(handoff=handoff, engine=leg.engine, leg=leg.bid)
        return kv

    def start_lease(self, kv: Kv) -> None:
        """The prefill answered: its KV's lease runs from now (docs/operate.md, "KV leases")."""
        lease = self.ctx.config.engine.kv_lease_s
        kv.start_by = self.ctx.now + lease * _LEASE_START_SHARE
        if not _renewed(kv.handoff.params):
            kv.hold_ends = self.ctx.now + lease * _HOLD_WATCH_SHARE

    def pulled(self, req: Request, kv: Kv) -> None:
        """The decode engine had the request's KV (it answered, or sampled a token)."""
        kv.outcome, kv.method = "pulled", "decode"
        req.pulled_cached_tokens = kv.handoff.cached_tokens
        req.kv = None

    def no_handoff(self, req: Request, leg: Leg, handoff: KvHandoff) -> None:
        """A 2xx prefill answer with ``kv_transfer_params: null``: nothing to hand off.

        The engine holds no KV (vLLM's connector keeps none when the one
        token ended the sequence), so there is nothing to pull or release:
        the leg's KV record says ``none`` and why, and the decode leg runs
        as a plain request that recomputes the prompt. Never retried: a
        greedy prefill would end the same way again (docs/operate.md).
        """
        kv = leg.kv = Kv(handoff=handoff, engine=leg.engine, leg=leg.bid)
        kv.outcome, kv.method, kv.error = "none", "none", handoff.reason
        req.plain_decode = True
        url = leg.engine.url
        if handoff.finish_reason != "stop" and url not in self.warned_no_kv:
            # Not the end-of-sequence case: an engine without a KV connector
            # answers like this for every request. Said once per engine.
            self.warned_no_kv.add(url)
            self.ctx.log(
                "prefill_without_kv", level="warning", engine=url, finish_reason=handoff.finish_reason,
                fix="check the prefill engine's --kv-transfer-config (kv_role kv_producer or kv_both); "
                    "until then every decode leg recomputes its prompt",
            )

    def note_connector(self, url: str, params: dict[str, Any]) -> None:
        """Record the NIXL connector version a prefill engine's answer shows; warn once about version 1."""
        stats = self.ctx.stats
        version = 2 if "remote_request_id" in params else 1
        known = stats.kv_connector.get(url)
        stats.kv_connector[url] = version
        if version == 1 and known != 1:
            self.ctx.log(
                "kv_connector_v1", level="info", engine=url,
                consequence="its answers carry no remote_request_id (NIXL connector version 1, vLLM before "
                            "0.14): every decode request carrying its KV is sent with the prefill leg's "
                            "X-Request-Id, so that the decode engine names blocks this engine holds",
            )

    def refuse_mode(self, leg: Leg, handoff: KvHandoff, mode: str) -> None:
        """A prefill answer in a KV transfer mode the engine protocol does not drive: its KV, journalled.

        No decode request will carry it, and no release can reach it without
        one, so the blocks stay on the engine until its lease ends: the
        leg's KV record says ``held_until_lease`` and why. Logged once per
        engine and mode, counted per answer (docs/operate.md, "vLLM compatibility").
        """
        kv = leg.kv = Kv(handoff=handoff, engine=leg.engine, leg=leg.bid)
        self._held_until_lease(kv, f"transfer_mode {mode!r} is not supported: no decode request carried the KV")
        url = leg.engine.url
        counts = self.ctx.stats.kv_modes_refused
        counts[(url, mode)] += 1
        if counts[(url, mode)] == 1:
            self.ctx.log(
                "kv_transfer_mode_unsupported", level="error", engine=url, mode=mode,
                consequence="every request prefilled on it fails with 502 unsupported_kv_transfer_mode; its "
                            "KV is held until the engine's lease ends",
                fix="run the NIXL connector in push mode on every engine" if self.protocol.name == "vllm-nixl-push"
                else "run the NIXL connector in pull mode on every engine",
            )

    # ---------------------------------------------------------------- releases

    def release(self, req: Request, short: str = LEASE_SHORT) -> None:
        """Release the request's prefilled KV that no decode leg pulled (docs/operate.md, "KV release in operation").

        ``decode_pull`` (the default) sends a one-token decode request that
        the decode engine runs, pulling the KV, which frees it on the prefill
        engine; ``abort_endpoint`` asks the prefill engine's abort endpoint;
        ``decode_abort`` sends a decode request and closes at once; ``lease``
        does nothing. The outcome is settled by :meth:`release_done`. A
        decode request never carries KV past its ``start_by`` (``short``
        says why in the record).
        """
        kv = req.kv
        if kv is None:
            return
        req.kv = None
        mode = self.ctx.config.engine.kv_release
        if mode == "lease":
            self._held_until_lease(kv, None)
            return
        key = f"release-{kv.leg}"
        if mode == "abort_endpoint":
            command = self._abort(key, kv)
        else:
            if self.ctx.now >= kv.start_by:
                self._held_until_lease(kv, short)
                return
            decode = self._decode_release(key, req, kv, mode)
            if decode is None:
                kv.outcome, kv.method, kv.error = "held_until_lease", mode, "no healthy decode engine"
                return
            command = decode
        kv.method = mode
        req.pending_releases += 1
        self.releases[key] = (req, kv)
        self.ctx.out.append(command)

    @staticmethod
    def _held_until_lease(kv: Kv, error: str | None) -> None:
        """Nothing will free the KV but the engine's lease; say so when that lease's reaper may not."""
        params = kv.handoff.params or {}
        if _lease_era(params):
            error = REAPER_STUCK if error is None else f"{error}; {REAPER_STUCK}"
        kv.outcome, kv.method, kv.error = "held_until_lease", "lease", error

    def release_before_lease_ends(self, req: Request, *, read: bool = False) -> None:
        """Release the request's KV now: no decode engine had room before its ``start_by`` (``read``: or read it)."""
        self.release(req, LEASE_SHORT + (HOLD_UNREAD if read else ": no decode engine had room in time"))

    def _abort(self, key: str, kv: Kv) -> StartControl:
        """The prefill engine's abort endpoint, asked to free the KV (``abort_endpoint``)."""
        e = self.ctx.config.engine
        engine = kv.engine.address
        owner = kv.handoff.owner
        # SGLang's AbortReq names the request "rid"; the simulator reads "request_id".
        body = wire.dumps({"rid": owner, "request_id": owner})
        return StartControl(
            key, engine, "POST", e.abort_path,
            ((b"host", engine.authority), JSON_HEADER, *self.ctx.auth_header), body, e.control_timeout_s,
        )

    def _decode_release(self, key: str, req: Request, kv: Kv, mode: str) -> StartControl | None:
        """A decode request carrying the KV (``decode_pull``, ``decode_abort``); ``None``: no decode engine."""
        ctx = self.ctx
        fleet = ctx.fleet
        target = fleet.choose(DECODE, req.failed_on[DECODE], request_key=req.rid, now=ctx.now) or next(
            (e for e in fleet.engines[DECODE] if e.healthy), None
        )
        if target is None:
            return None
        params = kv.handoff.params
        assert params is not None  # (a prefill that handed off nothing holds nothing: never req.kv)
        bid = kv.decode_request_id()  # connector 1: the prefill leg's own ID (see Kv.decode_request_id)
        if bid is None:
            attempt = req.attempts[DECODE] + 1
            req.attempts[DECODE] = attempt
            bid = backend_id(req.rid, DECODE, attempt)
        headers = ctx.engine_headers(target.address, bid)
        timeout = ctx.config.engine.control_timeout_s
        kv.release_id = bid
        if mode == "decode_pull":
            return StartControl(
                key, target.address, "POST", req.route, headers,
                wire.dumps(self.protocol.release_body(req.accepted.body, params)), timeout,
            )
        raw = ctx.codec.engine_connection(max_body_bytes=None).send_request(
            "POST", req.route, headers, wire.dumps(self.protocol.decode_body(req.accepted.body, params))
        )
        return StartControl(key, target.address, "POST", req.route, (), b"", timeout, drop_after_send=True, data=raw)

    def request_of(self, key: str) -> Request | None:
        """The request a release in flight is for."""
        entry = self.releases.get(key)
        return None if entry is None else entry[0]

    def release_done(self, event: ControlDone) -> Request | None:
        """Settle a release from its answer: the request one of whose releases is settled.

        ``None`` if ``event`` answers no release of ours. (The lifecycle
        ends the request with its last release.)
        """
        entry = self.releases.pop(event.key, None)
        if entry is None:
            return None
        req, kv = entry
        kv.outcome, kv.error = self.release_outcome(kv.method, event)
        return req

    def release_outcome(self, method: str | None, event: ControlDone) -> tuple[str, str | None]:
        """A release's KV outcome and error: ``released`` only when the engine confirmed it.

        (docs/operate.md, "KV release in operation".) ``release_sent``: it
        went out (or may have: a timeout) and nothing confirmed it;
        ``held_until_lease``: it never reached the engine, or the engine
        refused it.
        """
        status = event.status
        if status is None:
            error = event.error
            if error is None:
                return "release_sent", None  # decode_abort: written, and nothing comes back
            if event.local or error.startswith(_NOT_SENT):
                return "held_until_lease", error
            return "release_sent", error
        if method == "decode_pull":
            why = release_unconfirmed(status, event.body)
            return ("released", None) if why is None else ("release_sent", why)
        if not 200 <= status < 300:
            if status == 404:
                return "held_until_lease", (
                    f"release answered 404: the engine has no {self.ctx.config.engine.abort_path} "
                    '(vLLM has none: use kv_release = "decode_pull")'
                )
            return "held_until_lease", f"release answered {status}"
        said = release_said(event.body)
        if said is True:
            return "released", None
        if said is False:
            return "released", NOTHING_HELD  # nothing was left to free: not a leak, not Narwhal's doing
        return "release_sent", "the engine took the abort and did not say whether it freed anything"

    @staticmethod
    def abandon(legs: list[Leg]) -> None:
        """Shutdown's grace ran out: the releases still unsettled are recorded as they stand."""
        for leg in legs:
            kv = leg.kv
            if kv is not None and kv.outcome is None:
                if kv.method is not None and kv.method != "lease":
                    kv.outcome, kv.error = "release_sent", "shutdown before the release was confirmed"
                else:
                    kv.outcome, kv.method, kv.error = "held_until_lease", "lease", "shutdown before release"
