"""The driver (narwhal_runtime/driver.py), tested once for both runtimes, against a scripted router.

The router here is a stand-in that emits the commands a test scripts for
each event; the effects object records every call in order. So the tests
read as: after these commands, the adapter is told to do exactly this.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from narwhal_core import (
    CancelLeg, ClientData, CloseClient, FinishLeg, FleetChanged, JournalHealth, Log, ShutdownComplete, StartControl,
    StartLeg, Transmit, WriteJournal,
)
from narwhal_core.config import parse_engine_url
from narwhal_runtime.driver import LINGER_BYTES, BusyPoll, Driver, keep_lingering


class ScriptedRouter:
    """Emits, for each event fed, the commands scripted for it; can be told to raise."""

    def __init__(self) -> None:
        self.script: dict[Any, list[Any]] = {}
        self.out: list[Any] = []
        self.received: list[tuple[Any, float]] = []
        self.contained: list[tuple[Any, str, str | None]] = []
        self.deadline: float | None = None
        self.raise_on: list[Any] = []
        self.raise_in_drain = 0
        self.raise_in_containment = False
        self.on_contain: list[Any] = []

    def receive(self, event: Any, *, now: float) -> None:
        self.received.append((event, now))
        if isinstance(event, (str, JournalHealth)):
            self.out += self.script.get(event, [])
        if event in self.raise_on:
            raise RuntimeError(f"boom on {event}")

    def handle_deadline(self, *, now: float) -> None:
        self.received.append(("deadline", now))
        if "deadline" in self.raise_on:
            raise ValueError("timer boom")
        self.out += self.script.get("deadline", [])

    def next_output(self) -> Any:
        if self.raise_in_drain:
            self.raise_in_drain -= 1
            raise KeyError("drain boom")
        return self.out.pop(0) if self.out else None

    def get_deadline(self) -> float | None:
        return self.deadline

    def contain_failure(self, event: Any, problem: str, trace: str | None = None) -> None:
        self.contained.append((event, problem, trace))
        if self.raise_in_containment:
            raise RuntimeError("containment boom")
        self.out += self.on_contain


class Recorder:
    """The adapter's side: every effect, in the order the driver asks for it."""

    def __init__(self, journal_ok: bool = True) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.journal_ok = journal_ok
        self.engines = self  # the same recorder takes the engine commands

    def write_journal(self, lines: list[bytes]) -> bool:
        self.calls.append(("journal", tuple(lines)))
        return self.journal_ok

    def journal_error(self) -> str | None:
        return None if self.journal_ok else "No space left on device"

    def log(self, event: str, fields: dict[str, Any]) -> None:
        self.calls.append(("log", event))

    def start_leg(self, cmd: StartLeg) -> None:
        self.calls.append(("start_leg", cmd.leg))

    def finish_leg(self, key: str, reusable: bool) -> None:
        self.calls.append(("finish_leg", key, reusable))

    def cancel_leg(self, key: str) -> None:
        self.calls.append(("cancel_leg", key))

    def start_control(self, cmd: StartControl) -> None:
        self.calls.append(("start_control", cmd.key))

    def write_unsent(self) -> None:
        self.calls.append(("write_unsent",))

    def send(self, conn: Any, data: bytes, close: bool) -> None:
        self.calls.append(("send", conn, data, close))

    def fleet_changed(self, cmd: FleetChanged) -> None:
        self.calls.append(("fleet_changed", cmd.phase, tuple(a.url for a in cmd.engines)))


def _leg(key: str, conn: Any = 1) -> StartLeg:
    return StartLeg(key, None, b"POST / HTTP/1.1\r\n\r\n", conn, 1.0)  # type: ignore[arg-type]


def _control(key: str) -> StartControl:
    return StartControl(key, None, "GET", "/health", (), b"", 1.0)  # type: ignore[arg-type]


@pytest.fixture
def router() -> ScriptedRouter:
    return ScriptedRouter()


def test_journal_first_then_engines_then_clients_one_send_each(router: ScriptedRouter) -> None:
    router.script["e1"] = [
        Transmit(1, b"HTTP/1.1 200 OK\r\n"), StartLeg("r1-p0", None, b"x", 1, 1.0),  # type: ignore[arg-type]
        Transmit(2, b"a"), WriteJournal(b'{"rid":"r0"}\n', True), Transmit(1, b"\r\nbody"),
        Log("engine_down", {"engine": "e"}), FinishLeg("r0-d0", True), CancelLeg("r0-p0"),
    ]
    router.script["e2"] = [Transmit(2, b"b"), CloseClient(2), _control("probe"), WriteJournal(b'{"rid":"r2"}\n', True)]
    driver = Driver(router)  # type: ignore[arg-type]
    driver.feed("e1", now=1.0)  # type: ignore[arg-type]
    driver.feed("e2", now=2.0)  # type: ignore[arg-type]
    assert [now for _, now in router.received] == [1.0, 2.0]
    out = Recorder()
    assert driver.pending()
    driver.flush(out, now=3.0)  # type: ignore[arg-type]
    assert out.calls == [
        ("journal", (b'{"rid":"r0"}\n', b'{"rid":"r2"}\n')),  # every record of the batch, in one write, first
        ("log", "engine_down"),
        ("start_leg", "r1-p0"), ("finish_leg", "r0-d0", True), ("cancel_leg", "r0-p0"), ("start_control", "probe"),
        ("write_unsent",),
        ("send", 1, b"HTTP/1.1 200 OK\r\n\r\nbody", False),  # coalesced, in the order the router sent them
        ("send", 2, b"ab", True),
    ]
    assert not driver.pending()


def test_nothing_after_a_close_and_a_close_alone_is_a_send(router: ScriptedRouter) -> None:
    router.script["e"] = [Transmit(7, b"bye"), CloseClient(7), Transmit(7, b"late"), CloseClient(8)]
    driver = Driver(router)  # type: ignore[arg-type]
    driver.feed("e", now=0.0)  # type: ignore[arg-type]
    assert driver.closing(7) and driver.closing(8) and not driver.closing(9)
    assert driver.pending_bytes(7) == 3
    out = Recorder()
    driver.flush(out, now=0.0)  # type: ignore[arg-type]
    assert [c for c in out.calls if c[0] == "send"] == [("send", 7, b"bye", True), ("send", 8, b"", True)]
    assert not driver.closing(7)  # performed: the adapter knows now


def test_transmitted_names_the_clients_the_last_feed_wrote_to(router: ScriptedRouter) -> None:
    router.script["a"] = [Transmit(1, b"x"), Transmit(2, b"y")]
    router.script["b"] = [Transmit(3, b"z")]
    driver = Driver(router)  # type: ignore[arg-type]
    driver.feed("a", now=0.0)  # type: ignore[arg-type]
    assert driver.transmitted == [1, 2]
    driver.feed("b", now=0.0)  # type: ignore[arg-type]
    assert driver.transmitted == [3]


def test_an_exception_in_receive_is_contained_and_its_answer_flushed(router: ScriptedRouter) -> None:
    event = ClientData(4, b"GET / HTTP/1.1\r\n\r\n")
    router.raise_on.append(event)
    router.on_contain = [WriteJournal(b'{"terminal":"failed"}\n', True), Transmit(4, b"HTTP/1.1 500"), CloseClient(4)]
    driver = Driver(router)  # type: ignore[arg-type]
    driver.feed(event, now=5.0)  # does not raise
    [(contained, problem, trace)] = router.contained
    assert contained is event and problem == f"RuntimeError: boom on {event}"
    assert trace is not None and "Traceback (most recent call last)" in trace
    out = Recorder()
    driver.flush(out, now=5.0)  # type: ignore[arg-type]
    assert out.calls == [("journal", (b'{"terminal":"failed"}\n',)), ("send", 4, b"HTTP/1.1 500", True)]


def test_a_router_that_cannot_contain_its_failure_leaves_one_log_line(router: ScriptedRouter) -> None:
    router.raise_on.append("e")
    router.raise_in_containment = True
    driver = Driver(router)  # type: ignore[arg-type]
    driver.feed("e", now=0.0)  # type: ignore[arg-type]
    out = Recorder()
    driver.flush(out, now=0.0)  # type: ignore[arg-type]
    assert out.calls == [("log", "internal_error")]


def test_an_exception_while_draining_is_contained(router: ScriptedRouter) -> None:
    router.script["e"] = [Transmit(1, b"ok")]
    router.raise_in_drain = 1
    driver = Driver(router)  # type: ignore[arg-type]
    driver.feed("e", now=0.0)  # type: ignore[arg-type]
    assert [(e, p) for e, p, _ in router.contained] == [("e", "KeyError: 'drain boom'")]
    out = Recorder()
    driver.flush(out, now=0.0)  # type: ignore[arg-type]
    assert ("send", 1, b"ok", False) in out.calls


def test_a_timer_that_raises_is_contained_as_a_deadline(router: ScriptedRouter) -> None:
    router.raise_on.append("deadline")
    driver = Driver(router)  # type: ignore[arg-type]
    driver.fire_timer(now=9.0)
    assert [(e, p) for e, p, _ in router.contained] == [(None, "ValueError: timer boom")]


def test_only_an_earlier_deadline_rearms_the_timer(router: ScriptedRouter) -> None:
    driver = Driver(router)  # type: ignore[arg-type]
    assert driver.armed == math.inf and not driver.rearm
    router.deadline = 10.0
    driver.feed("e", now=0.0)  # type: ignore[arg-type]
    assert driver.rearm and driver.armed == 10.0
    driver.rearm = False
    router.deadline = 12.0
    driver.feed("e", now=1.0)  # type: ignore[arg-type]
    assert not driver.rearm and driver.armed == 10.0  # a later one waits for this one to fire
    router.deadline = 8.0
    driver.feed("e", now=2.0)  # type: ignore[arg-type]
    assert driver.rearm and driver.armed == 8.0
    driver.rearm = False
    router.deadline = 12.0
    driver.fire_timer(now=8.0)  # fired: whatever is next arms it
    assert driver.rearm and driver.armed == 12.0


def test_a_journal_failure_is_fed_back_and_its_records_go_first(router: ScriptedRouter) -> None:
    router.script["e"] = [WriteJournal(b"r1\n", True), Transmit(1, b"answer")]
    router.script[JournalHealth(False, "No space left on device")] = [
        WriteJournal(b"health\n", False), Log("journal_failed", {})]
    driver = Driver(router)  # type: ignore[arg-type]
    driver.feed("e", now=0.0)  # type: ignore[arg-type]
    out = Recorder(journal_ok=False)
    driver.flush(out, now=3.0)  # type: ignore[arg-type]
    assert router.received[-1] == (JournalHealth(False, "No space left on device"), 3.0)
    assert out.calls == [
        ("journal", (b"r1\n",)), ("journal", (b"health\n",)), ("log", "journal_failed"), ("send", 1, b"answer", False),
    ]
    # Still failing: not fed again.
    driver.feed("e", now=4.0)  # type: ignore[arg-type]
    driver.flush(out, now=4.0)  # type: ignore[arg-type]
    assert sum(1 for event, _ in router.received if isinstance(event, JournalHealth)) == 1


def test_an_effect_that_feeds_again_is_performed_in_the_same_flush(router: ScriptedRouter) -> None:
    router.script["admit"] = [WriteJournal(b"late\n", True), Transmit(2, b"hello")]
    router.script["e"] = [Transmit(1, b"bye"), CloseClient(1)]
    driver = Driver(router)  # type: ignore[arg-type]

    class Admitting(Recorder):
        def send(self, conn: Any, data: bytes, close: bool) -> None:
            super().send(conn, data, close)
            if close:  # a slot freed: the adapter admits a waiting client
                driver.feed("admit", now=0.0)  # type: ignore[arg-type]

    driver.feed("e", now=0.0)  # type: ignore[arg-type]
    out = Admitting()
    driver.flush(out, now=0.0)  # type: ignore[arg-type]
    assert out.calls == [
        ("send", 1, b"bye", True), ("journal", (b"late\n",)), ("send", 2, b"hello", False),
    ]


def test_a_fleet_change_is_performed_as_a_command_with_the_engine_commands_not_read_from_its_log_line(
        router: ScriptedRouter) -> None:
    # The router's FleetChanged reaches the effects as itself, after the batch's log lines (the
    # engine_added line is one of them, and only a line) and in order among the engine commands.
    joined = parse_engine_url("http://10.0.0.3:8100", key="test")
    router.script["e"] = [
        Log("engine_added", {"engine": joined.url, "phase": "prefill", "source": "dns"}),
        FleetChanged(phase="prefill", engines=(joined,)), _control("probe-new"),
    ]
    driver = Driver(router)  # type: ignore[arg-type]
    driver.feed("e", now=1.0)  # type: ignore[arg-type]
    assert driver.pending()
    out = Recorder()
    driver.flush(out, now=1.0)  # type: ignore[arg-type]
    assert out.calls == [
        ("log", "engine_added"), ("fleet_changed", "prefill", (joined.url,)), ("start_control", "probe-new"),
    ]


def test_shutdown_complete_is_noticed(router: ScriptedRouter) -> None:
    router.script["stop"] = [ShutdownComplete()]
    driver = Driver(router)  # type: ignore[arg-type]
    driver.feed("stop", now=0.0)  # type: ignore[arg-type]
    assert driver.shutdown_complete


def test_busy_poll_window() -> None:
    poll = BusyPoll(0.001)
    assert poll.event_fed(10.0)  # start the poller
    assert not poll.event_fed(10.0005)  # running: the window only moves
    assert poll.keep_polling(10.001) and poll.keep_polling(10.0014)
    assert not poll.keep_polling(10.0015)  # closed: parked until the next event
    assert poll.polls == 2 and not poll.polling
    assert poll.event_fed(20.0)
    poll.stop()
    assert not poll.keep_polling(20.0)


def test_lingering_close_bound() -> None:
    assert keep_lingering(0) and keep_lingering(LINGER_BYTES)
    assert not keep_lingering(LINGER_BYTES + 1)


def test_the_driver_and_the_runtime_support_import_no_adapter_nor_the_cli() -> None:
    import ast
    from pathlib import Path

    import narwhal_runtime

    package = Path(narwhal_runtime.__file__).parent
    forbidden_everywhere = {"narwhal", "narwhal_trio", "narwhal_asyncio"}
    # The driver reads no clock and touches no socket or event loop.
    forbidden_in_driver = forbidden_everywhere | {"trio", "asyncio", "socket", "time", "select", "selectors", "os"}
    servers = [package.parent / name / "server.py" for name in ("narwhal_trio", "narwhal_asyncio")]
    for path in [*package.glob("*.py"), *servers]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
        forbidden = forbidden_in_driver if path.name == "driver.py" else {"narwhal"}
        if path.parent == package:
            forbidden = forbidden | (forbidden_everywhere if path.name != "driver.py" else set())
        assert not imported & forbidden, (path, imported & forbidden)


def test_a_scheduler_batch_with_one_drain_or_none_is_light() -> None:
    driver = Driver(ScriptedRouter())  # type: ignore[arg-type]
    assert driver.batch_ended()  # none
    driver.feed("a", now=1.0)
    assert driver.batch_ended()  # one
    driver.feed("a", now=1.0)
    driver.fire_timer(now=1.0)
    assert not driver.batch_ended()  # two: perform at the end of the batch
    assert driver.batch_ended()
