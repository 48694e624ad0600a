"""A Hypothesis state machine over the whole router (as h2's ``test_state_machines``).

Many clients and many requests at once, on a small fleet with tight limits,
while the world does anything it can do to a router: clients connect, send
valid and invalid requests on both routes (streamed or not, whole, in
pieces, pipelined, malformed, half-sent), and leave at any moment (socket
reset or EOF); engines answer each pending leg with success, 4xx, 5xx, a
dropped connection, an answer without KV params, garbage, a connection
failure, a stale pooled socket, or a stream that stops half-way; control
requests (probes, KV releases) succeed or fail; time jumps forward, firing
timers; shutdown can begin at any point.

After every step the driver's invariants must hold (see
:meth:`tests.core.router_driver.Driver.check_invariants`): at most one
terminal record per rid, and the last one; a progress record before any
leg; nothing sent for a request after its terminal record; the live
counters match the legs really open; every timer that is due has fired
(leg, stream-idle, whole-request and client read timeouts, docs/contract.md,
"Admission, capacity and retries"). At the end (teardown) every pending
leg is answered, every control completed and time moved past every
deadline, and then: one terminal record per rid, capacity counters all
zero, every prefill leg that handed out KV params settled (``pulled``,
``released``, ``release_sent`` or ``held_until_lease``, consistent with the
controls that ran), no decode request that carried KV late in its lease,
and every client that sent complete requests and stayed connected
got exactly one complete response to each (SSE streams properly ended).

Nothing but the core's error family may escape ``receive`` or
``handle_deadline``, and ``TransitionError`` not at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from hypothesis import HealthCheck, Phase, event, note, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine as hypothesis_engine
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from narwhal_core import (
    AuthenticatorChanged,
    ClientStalled,
    EnginesChanged,
    JournalHealth,
    NarwhalError,
    TransitionError,
)
from narwhal_core.auth import Authenticator
from narwhal_core.config import parse_engine_url
from narwhal_core.tenants_config import TenantConfig, TenantsConfig

from ..corebuild import examples
from .router_driver import (
    CHAT,
    COMPLETIONS,
    DECODE_URLS,
    PREFILL_URLS,
    Driver,
    EngineLeg,
    FakeClient,
    SentRequest,
    chat_body,
    chunk,
    completion_body,
    json_request,
    make_config,
)

#: Examples x steps: 90 000 rule steps. ``test_core_builds`` reruns this
#: machine on the pure sources with an eighth of the examples (``corebuild.examples``):
#: the full walk runs once per suite, on the build that is installed.
MAX_EXAMPLES = examples(900, rerun=110)
#: With ``tenants``: alice in the high band, in flight at most 2; bob in the low one at twice the default
#: weight, with a budget of one request every 2 s and 800 prompt tokens a minute (docs/operate.md, "Budgets").
TENANTS = TenantsConfig(bands=("high", "low"), tenant=(
    TenantConfig(name="alice", band="high", max_inflight=2),
    TenantConfig(name="bob", weight=2.0, requests_per_s=0.5, prompt_tokens_per_min=800.0),
))
STEPS = 100
#: Shrinking a failure stops after this long (the failing case is printed either way).
SHRINK_SECONDS = 60

ROUTES = (COMPLETIONS, CHAT)
REQUESTS = (
    *(["valid"] * 16),
    "invalid_json", "not_object", "bad_type", "no_prompt", "unknown_model", "n2", "bad_tool",
    "denied", "get_health", "get_ready", "get_models", "unknown_path", "wrong_method",
    "malformed_http", "half_sent", "half_head", "expect_continue", "expect_continue", "expect_denied",
    "get_metrics", "post_to_get_route", "models_denied",
)
#: Success is common (so requests get far: decode legs, long streams), every fault possible.
LEG_OUTCOMES = (
    *(["ok"] * 14), "ok_in_pieces", "ok_in_pieces", *(["stream_some"] * 6),
    "4xx", "5xx", "drop", "no_kv", "garbage", "bad_json", "connect_failed", "connect_timeout",
    "dropped", "stale", "partial_then_stale", "stream_then_drop", "stream_then_drop",
    "stream_error_event", "stream_error_event", "late_bytes",
)
TIME_STEPS = (0.01, 0.3, 0.3, 1.0, 1.0, 2.5, 4.5, 9.0, 21.0)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."


#: The engine discovery may add to each phase.
NEW_ENGINE = {"prefill": "http://10.0.0.9:8100", "decode": "http://10.0.1.9:8200"}


class RouterMachine(RuleBasedStateMachine):
    """Random events against one router; the driver checks the invariants."""

    def __init__(self) -> None:
        super().__init__()
        self.d: Driver | None = None
        self.sealed: set[int] = set()  # clients whose byte stream is no longer well-formed
        self.escaped: list[NarwhalError] = []
        self.clean = True
        self.steps = 0

    # ------------------------------------------------------------- plumbing

    @property
    def driver(self) -> Driver:
        assert self.d is not None
        return self.d

    def run(self, action: Callable[[], Any]) -> None:
        """Run one action; only the core's error family may escape, TransitionError never."""
        self.clean = False
        self.steps += 1
        try:
            action()
        except TransitionError:
            raise
        except NarwhalError as exc:  # the one error family the core may raise (docs/design.md), but worth knowing about
            self.escaped.append(exc)
            event(f"escaped {type(exc).__name__}")
            note(f"escaped: {exc!r}")
        self.clean = True

    def live_clients(self) -> list[FakeClient]:
        return [c for c in self.driver.clients.values() if c.alive]

    def senders(self) -> list[FakeClient]:
        return [c for c in self.live_clients() if c.handle not in self.sealed]

    def open_legs(self) -> list[EngineLeg]:
        return self.driver.open_legs()

    @staticmethod
    def pick(items: list[Any], index: int) -> Any:
        return items[index % len(items)]

    # --------------------------------------------------------------- setup

    @initialize(
        prefills=st.sampled_from([2, 1, 1, 0]),
        decodes=st.sampled_from([1, 2]),
        kv_release=st.sampled_from(["decode_pull", "abort_endpoint", "decode_abort", "lease"]),
        kv_lease=st.sampled_from([30.0, 6.0]),
        max_inflight=st.sampled_from([3, 2, 4, 1]),
        queue_size=st.integers(0, 3),
        per_client=st.integers(0, 2),
        per_engine=st.sampled_from([1, 1, 2, 3]),
        decode_timeout=st.sampled_from([4.0, 12.0]),
        request_timeout=st.sampled_from([12.0, 40.0]),
        grace=st.sampled_from([3.0, 20.0]),
        attempts=st.integers(1, 3),
        unhealthy_after=st.integers(1, 3),
        healthy_after=st.integers(1, 2),
        auto_probe=st.booleans(),
        tenants=st.booleans(),
    )
    def setup(
        self, prefills: int, decodes: int, kv_release: str, kv_lease: float, max_inflight: int, queue_size: int,
        per_client: int, per_engine: int, decode_timeout: float, request_timeout: float, grace: float,
        attempts: int, unhealthy_after: int, healthy_after: int, auto_probe: bool, tenants: bool,
    ) -> None:
        config = make_config(
            prefill=PREFILL_URLS[:prefills],
            decode=DECODE_URLS[:decodes],
            ingress={
                "auth": "trusted_header", "trusted_proxies": ("127.0.0.0/8",),
                "header_timeout_s": 5.0, "body_timeout_s": 10.0, "keepalive_timeout_s": 30.0,
            },
            engine={
                "kv_release": kv_release, "kv_lease_s": kv_lease, "max_inflight_per_engine": per_engine,
                "prefill_timeout_s": 8.0, "decode_timeout_s": decode_timeout, "stream_idle_timeout_s": 3.0,
                "control_timeout_s": 5.0,
            },
            admission={
                "max_inflight": max_inflight, "queue_size": queue_size, "queue_timeout_s": 4.0,
                "request_timeout_s": request_timeout, "per_client_max_inflight": per_client,
            },
            retry={"max_attempts": attempts, "backoff_base_s": 0.5, "backoff_max_s": 2.0},
            health={"unhealthy_after": unhealthy_after, "healthy_after": healthy_after, "probe_interval_s": 5.0},
            shutdown={"grace_s": grace},
        )
        if tenants:  # admission's fair queue instead of the FIFO one (docs/operate.md, "Tenants")
            config = attrs.evolve(config, tenants=TENANTS)
        self.d = Driver(config, auto_probe=200 if auto_probe else None)
        event(f"mode {'pd' if prefills else 'single'} / {kv_release}")

    # ------------------------------------------------------------- clients

    @rule(peer=st.sampled_from(["127.0.0.1", "127.0.0.1", "127.0.0.1", "192.0.2.7"]))
    def connect(self, peer: str) -> None:
        if len(self.live_clients()) < 6:
            self.run(lambda: self.driver.connect(peer))

    @rule(
        fresh=st.booleans(),
        which=st.integers(0, 63),
        kind=st.sampled_from(REQUESTS),
        route=st.sampled_from(ROUTES),
        stream=st.booleans(),
        who=st.sampled_from(["alice", "alice", "bob"]),
        pieces=st.sampled_from([1, 1, 1, 2, 5]),
        priority=st.sampled_from([None, None, "low", "high"]),
    )
    def send(
        self, fresh: bool, which: int, kind: str, route: str, stream: bool, who: str, pieces: int,
        priority: str | None,
    ) -> None:
        senders = self.senders()
        if fresh or not senders:
            self.run(self.driver.connect)
            senders = self.senders()
            if not senders:
                return  # draining: the connection was closed at once
            which = -1
        client: FakeClient = self.pick(senders, which)
        headers = [] if kind == "denied" else [("X-Narwhal-Client", who)]
        if priority is not None:
            headers.append(("X-Narwhal-Priority", priority))
        body: Any = chat_body(stream=stream) if route == CHAT else completion_body(stream=stream)
        get = {"get_health": "/health", "get_ready": "/ready", "get_models": "/v1/models", "get_metrics": "/metrics"}
        event(f"request {kind}")
        if kind in get:
            self.run(lambda: client.request("GET", get[kind], headers=headers, pieces=pieces))
            return
        if kind == "unknown_path":
            self.run(lambda: client.request("GET", "/v2/everything", headers=headers))
            return
        if kind == "wrong_method":
            self.run(lambda: client.request("GET", route, headers=headers))
            return
        if kind == "malformed_http":
            self.sealed.add(client.handle)
            self.run(lambda: client.send(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
                requests=[SentRequest("POST", route, complete=True, well_formed=False)],
            ))
            return
        if kind in ("half_sent", "half_head"):
            self.sealed.add(client.handle)
            data = json_request(route, body, headers)
            cut = data.index(b"\r\n") + 2 if kind == "half_head" else len(data) // 2
            self.run(lambda: client.send_incomplete(data[:cut], "POST", route))
            return
        if kind in ("expect_continue", "expect_denied"):
            if len(client.complete_responses()) < len(client.requests):
                # Clients wait for "100 Continue" before the body, so they do not pipeline
                # behind it; and a refusal without reading the body closes the connection.
                self.run(self.driver.connect)
                if not self.senders():
                    return
                client = self.senders()[-1]
            if kind == "expect_denied":
                self.sealed.add(client.handle)
            self.run(lambda: self._expect_continue(client, route, body, [] if kind == "expect_denied" else headers))
            return
        if kind == "post_to_get_route":
            self.run(lambda: client.request("POST", "/health", b"{}", headers=headers))
            return
        if kind == "models_denied":
            self.run(lambda: client.request("GET", "/v1/models"))
            return
        if kind == "invalid_json":
            body = b'{"prompt": "x",'
        elif kind == "not_object":
            body = b"[1, 2]"
        elif kind == "bad_type":
            body["max_tokens"] = "lots"
        elif kind == "no_prompt":
            body.pop("messages" if route == CHAT else "prompt")
        elif kind == "unknown_model":
            body["model"] = "gpt-4o"
        elif kind == "n2":
            body["n"] = 2
        elif kind == "bad_tool":
            body["tools"] = [{"type": "retrieval"}]
        self.run(lambda: client.post(route, body, headers, pieces=pieces))

    def _expect_continue(self, client: FakeClient, route: str, body: Any, headers: list[tuple[str, str]]) -> None:
        data = json_request(route, body, [*headers, ("Expect", "100-continue")])
        split = data.index(b"\r\n\r\n") + 4
        info = SentRequest("POST", route, complete=False)
        client.send(data[:split], requests=[info])
        if client.alive:
            info.complete = True
            client.send(data[split:])
        else:
            info.well_formed = False  # answered (401) before the body: the body is never sent

    @rule(ok=st.booleans())
    def journal_health(self, ok: bool) -> None:
        event(f"journal ok={ok}")
        self.run(lambda: self.driver.feed(JournalHealth(ok, None if ok else "disk full")))

    @rule()
    def keys_reloaded(self) -> None:
        d = self.driver
        self.run(lambda: d.feed(AuthenticatorChanged(Authenticator.from_config(d.config.ingress, None))))

    @rule(which=st.integers(0, 63), how=st.sampled_from(["gone", "eof"]), waiting=st.booleans())
    def client_leaves(self, which: int, how: str, waiting: bool) -> None:
        clients = self.live_clients()
        if waiting:  # prefer a client still waiting for an answer: that is where leaving hurts
            clients = [c for c in clients if len(c.complete_responses()) < len(c.requests)] or clients
        if not clients:
            return
        client: FakeClient = self.pick(clients, which)
        event(f"client {how}")
        self.run(client.leave if how == "gone" else client.eof)

    @rule(which=st.integers(0, 63), stalled=st.booleans())
    def client_stalls(self, which: int, stalled: bool) -> None:
        # The adapter holds back the legs of a client that is not reading
        # (or lets them go again); prefer one whose request has a leg open.
        d = self.driver
        clients = self.live_clients()
        busy = {leg.conn for leg in d.open_legs()}
        clients = [c for c in clients if c.handle in busy] or clients
        if not clients:
            return
        client: FakeClient = self.pick(clients, which)
        event(f"client stalled={stalled}")
        self.run(lambda: d.feed(ClientStalled(client.handle, stalled)))

    # ---------------------------------------------------------------- legs

    @rule(which=st.integers(0, 63), outcome=st.sampled_from(LEG_OUTCOMES))
    def answer_leg(self, which: int, outcome: str) -> None:
        d = self.driver
        legs = self.open_legs()
        if outcome == "late_bytes" or not legs:
            self.late_bytes_for_a_closed_leg(which)
            return
        leg: EngineLeg = self.pick(legs, which)
        bid = leg.bid
        if leg.stream_started:
            # The head went out: only the rest of the stream or a failure can follow.
            outcome = {"stream_some": "stream_some", "drop": "drop", "dropped": "dropped",
                       "stream_then_drop": "drop", "garbage": "bad_chunk", "stale": "stale",
                       "partial_then_stale": "stale",
                       "stream_error_event": "stream_error_event"}.get(outcome, "ok")
        elif not (leg.phase == "decode" and leg.stream) and outcome.startswith("stream"):
            outcome = "ok"
        event(f"{leg.phase} leg {outcome}")
        actions: dict[str, Callable[[], Any]] = {
            "ok": lambda: d.serve(bid),
            "ok_in_pieces": lambda: (
                d.answer_prefill(bid, pieces=7) if leg.phase == "prefill" else d.answer_decode(bid, pieces=7)
            ),
            "4xx": lambda: d.answer_status(bid, 400),
            "5xx": lambda: d.answer_status(bid, 503),
            "drop": lambda: d.drop(bid),
            "no_kv": lambda: d.answer_without_kv(bid) if leg.phase == "prefill" else d.answer_bad_json(bid),
            "garbage": lambda: d.answer_garbage(bid),
            "bad_json": lambda: d.answer_bad_json(bid),
            "connect_failed": lambda: d.fail_leg(bid, "connect_failed"),
            "connect_timeout": lambda: d.fail_leg(bid, "connect_timeout"),
            "dropped": lambda: d.fail_leg(bid, "dropped"),
            "stale": lambda: d.fail_leg(bid, "dropped", reused=True),
            # Part of the answer came, then the pooled socket broke: the engine saw the request.
            "partial_then_stale": lambda: self._then_if_open(
                leg, lambda: d.send_leg(bid, b"HTTP/1.1 200 OK\r\ncontent-ty"),
                lambda: d.fail_leg(bid, "dropped", reused=True),
            ),
            "stream_some": lambda: d.stream_next(bid),
            "stream_then_drop": lambda: self._then_if_open(leg, lambda: d.stream_next(bid), lambda: d.drop(bid)),
            "stream_error_event": lambda: self._stream_error(leg),
            "bad_chunk": lambda: d.send_leg(bid, b"zz\r\nnot a chunk\r\n"),
        }
        self.run(actions[outcome])

    @staticmethod
    def _then_if_open(leg: EngineLeg, first: Callable[[], Any], then: Callable[[], Any]) -> None:
        first()
        if leg.open:
            then()

    @rule(phase=st.sampled_from(["prefill", "decode"]))
    def engines_answer_at_once(self, phase: str) -> None:
        # A batch of one phase finishes together: requests pile up on the next phase.
        d = self.driver
        for leg in d.open_legs(phase):
            if leg.open and not leg.stream_started:
                self.run(lambda bid=leg.bid: d.serve(bid))  # type: ignore[misc]

    def _stream_error(self, leg: EngineLeg) -> None:
        d = self.driver
        d.stream_next(leg.bid)
        if leg.open:
            d.send_leg(leg.bid, chunk(b'data: {"error": {"message": "engine overloaded", "type": '
                                      b'"server_error", "param": null, "code": 503}}\n\n'))
        if leg.open:
            d.send_leg(leg.bid, chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    def late_bytes_for_a_closed_leg(self, which: int) -> None:
        # The adapter may have read bytes before it executed CancelLeg: they must be ignored.
        closed = [leg for leg in self.driver.legs.values() if leg.state in ("cancelled", "finished")]
        if not closed:
            return
        event("late bytes for a closed leg")
        leg: EngineLeg = self.pick(closed, which)
        self.run(lambda: self.driver.send_leg(leg.bid, b"HTTP/1.1 200 OK\r\n"))

    # ------------------------------------------------------------- controls

    @rule(which=st.integers(0, 63), result=st.sampled_from(["ok", "ok", "ok", "status", "error"]))
    def control_result(self, which: int, result: str) -> None:
        d = self.driver
        pending = d.pending_controls()
        if not pending:
            return
        control = self.pick(pending, which)
        key = control.cmd.key
        event(f"{control.kind} control {result}")
        if result == "ok":
            self.run(lambda: d.complete_control(key, status=200))
        elif result == "status":
            self.run(lambda: d.complete_control(key, status=500))
        else:
            self.run(lambda: d.complete_control(key, status=None, error="timeout"))

    # ------------------------------------------------- engines that come and go

    @rule(phase=st.sampled_from(["prefill", "decode"]), keep=st.integers(0, 7), coin=st.integers(0, 3))
    def engines_change(self, phase: str, keep: int, coin: int) -> None:
        # Discovery's new set for a phase (docs/operate.md, "Engines that come and go"): some of the
        # configured engines and a new one, chosen by the bits of ``keep``; rare, like a rollout.
        if coin:
            return
        d = self.driver
        urls = (PREFILL_URLS if phase == "prefill" else DECODE_URLS) + (NEW_ENGINE[phase],)
        chosen = tuple(parse_engine_url(u, key="t") for i, u in enumerate(urls) if keep >> i & 1)
        event(f"engines change ({len(chosen)} {phase})")
        self.run(lambda: d.feed(EnginesChanged(phase, chosen, "dns")))

    # ----------------------------------------------------------- time, stop

    @rule(dt=st.sampled_from(TIME_STEPS))
    def advance(self, dt: float) -> None:
        self.run(lambda: self.driver.advance(dt))

    @rule(coin=st.integers(0, 15))
    def shutdown(self, coin: int) -> None:
        # Rare: a drained router has little left to explore.
        if coin == 0 and not self.driver.router.statistics().draining:
            event("shutdown")
            self.run(self.driver.shutdown)

    # ------------------------------------------------------------ invariants

    @invariant()
    def router_invariants(self) -> None:
        if self.d is None:
            return
        self.clean = False
        self.d.check_invariants()
        self.clean = True

    def teardown(self) -> None:
        if self.d is None or not self.clean:
            return  # a step already failed: that is the report
        d = self.d
        self.run(self.settle)
        stats = d.router.statistics()
        event(f"steps {min(self.steps // 25 * 25, 100)}+")
        event(f"journal terminals {sorted({r['terminal'] for r in d.terminals()})}")
        budget_codes = {"requests_budget", "prompt_tokens_budget", "prompt_over_budget"}
        if any(r["error"] and r["error"].get("code") in budget_codes for r in d.terminals()):
            event("a budget refused a request")
        note(f"statistics at the end: {_short(stats)}")
        d.check_invariants(final=True)

    def settle(self) -> None:
        """Answer every pending leg, complete every control, move past every deadline."""
        d = self.driver
        for _ in range(200):
            for leg in d.open_legs():
                if not leg.open:
                    continue
                if leg.stream_started:
                    d.stream_rest(leg.bid)
                else:
                    d.serve(leg.bid)
            for control in d.pending_controls():
                if not control.done:
                    d.complete_control(control.cmd.key, status=200)
            stats = d.router.statistics()
            if not stats.requests and not d.open_legs() and not d.pending_controls("release"):
                break
            d.advance(50.0)
        # Connections waiting on a half-sent request get their 408 now.
        d.advance(60.0)
        for control in d.pending_controls():
            d.complete_control(control.cmd.key, status=200)


RouterMachine.TestCase.settings = settings(
    max_examples=MAX_EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    database=None,
    # No database to replay from: a failure prints the blob that reproduces it
    # (@reproduce_failure), so a rare one found by a single run is not lost.
    print_blob=True,
    report_multiple_bugs=False,
    # No "explain" phase: it re-runs the failure under a tracer, for little here.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class TestRouterMachine(RouterMachine.TestCase):  # type: ignore[misc,valid-type]
    """The state machine as a test; a failure is shrunk for at most SHRINK_SECONDS."""

    def runTest(self) -> None:
        # Hypothesis documents this module constant as the knob for the shrink
        # time budget; a long failing run shrinks for minutes otherwise.
        saved = hypothesis_engine.MAX_SHRINKING_SECONDS
        hypothesis_engine.MAX_SHRINKING_SECONDS = SHRINK_SECONDS
        try:
            super().runTest()
        finally:
            hypothesis_engine.MAX_SHRINKING_SECONDS = saved
