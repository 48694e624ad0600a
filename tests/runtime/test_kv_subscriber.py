"""The KV-event subscriber on real ZMQ sockets (narwhal_runtime/kv_subscriber.py; docs/operate.md, "KV events").

The engines are the simulator's publisher (narwhal_sim/kv_events.py, vLLM's
wire format and replay socket) or, where a test needs a gap, a bad payload
or a replay that never answers, a hand-driven XPUB + ROUTER pair in the
test's own thread (an XPUB says when the subscription arrived, so nothing is
lost to ZMQ's slow joiner). Every wait is bounded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from narwhal_core import KvEventsReceived, KvStreamChanged
from narwhal_core.config import config_from_dict, parse_engine_url
from narwhal_core.errors import ConfigError
from narwhal_core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from narwhal_runtime.kv_subscriber import KvSource, KvSubscriber, kv_sources
from narwhal_sim import engine as sim
from narwhal_sim.kv_events import KvEventPublisher, encode_batch

from ..harness import RUNTIMES, LogCapture, RouterThread, make_config
from ..helpers import free_port

URL = "http://127.0.0.1:8100"
END = (-1).to_bytes(8, "big", signed=True)


def stored(n: int) -> sim.BlockStored:
    """A one-block BlockStored (block size 2) whose hash is ``n``."""
    return sim.BlockStored((n,), None if n == 0 else n - 1, (n, n + 1), 2)


def core(event: Any) -> Any:
    """A simulator event as the core decodes it."""
    if type(event) is sim.BlockStored:
        return BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size, "GPU")
    if type(event) is sim.BlockRemoved:
        return BlockRemoved(event.block_hashes, "GPU")
    return AllBlocksCleared()


def wait_until(predicate: Callable[[], Any], what: str, *, pump: Callable[[], None] | None = None,
               timeout: float = 10.0) -> Any:  # fmt: skip
    deadline = time.monotonic() + timeout
    while True:
        if pump is not None:
            pump()
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        time.sleep(0.005)


class Fed:
    """The subscriber's ``feed``: what it handed over, from its thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batches: list[tuple[Any, ...]] = []
        self.threads: set[str] = set()

    def __call__(self, events: Sequence[Any]) -> None:
        with self._lock:
            self.batches.append(tuple(events))
            self.threads.add(threading.current_thread().name)

    def all(self) -> list[Any]:
        with self._lock:
            return [e for batch in self.batches for e in batch]

    def events(self, url: str = URL) -> list[Any]:
        return [e for r in self.all() if type(r) is KvEventsReceived and r.url == url for e in r.events]

    def changes(self, url: str = URL) -> list[tuple[bool, str]]:
        return [(c.live, c.reason) for c in self.all() if type(c) is KvStreamChanged and c.url == url]


class HandEngine:
    """An engine's KV-event sockets driven by the test: an XPUB and, optionally, a replay ROUTER."""

    def __init__(self, *, replay: bool = True, endpoint: str | None = None) -> None:
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if endpoint is None:
            self.pub.bind_to_random_port("tcp://127.0.0.1")
        else:
            self.pub.bind(endpoint)  # (an engine restarted on its port)
        self.endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.router: Any = None
        self.replay_endpoint: str | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        #: Every batch "published", sent or not (what the replay socket answers from).
        self.batches: dict[int, bytes] = {}
        #: The start of each replay asked for.
        self.asked: list[int] = []
        self.answer = True
        self.subscribers = 0

    @property
    def source(self) -> KvSource:
        return KvSource(URL, self.endpoint, self.replay_endpoint)

    def send(self, seq: int, payload: bytes, *, drop: bool = False) -> None:
        self.batches[seq] = payload
        if not drop:
            self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    def pump(self) -> None:
        """Take subscriptions; answer replay requests (as vLLM's ``_service_replay`` does) unless told not to."""
        while self.pub.poll(0):
            if self.pub.recv()[:1] == b"\x01":
                self.subscribers += 1
        while self.router is not None and self.router.poll(0):
            client, empty, start = self.router.recv_multipart()
            assert empty == b"" and len(start) == 8
            self.asked.append(int.from_bytes(start, "big"))
            if self.answer:
                for seq in sorted(s for s in self.batches if s >= self.asked[-1]):
                    self.router.send_multipart((client, b"", seq.to_bytes(8, "big"), self.batches[seq]))
                self.router.send_multipart((client, b"", END, b""))

    def close(self) -> None:
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)


@pytest.fixture
def hand() -> Iterator[HandEngine]:
    engine = HandEngine()
    yield engine
    engine.close()


def subscriber(sources: Sequence[KvSource], fed: Fed, **options: Any) -> KvSubscriber:
    sub = KvSubscriber(sources, **options)
    sub.start(fed)
    return sub


MARK = stored(99)


def published_until_seen(publisher: KvEventPublisher, fed: Fed) -> list[Any]:
    """Publish a marker batch until one arrives (the first may reach the PUB before the subscription does).

    Returns the events received, checked to end with the markers published: every one of them, in order.
    """
    count = 0

    def seen() -> bool:
        nonlocal count
        if core(MARK) in fed.events():
            return True
        publisher.publish([MARK], ts=1.0)
        count += 1
        return False

    wait_until(seen, "a marker batch")
    wait_until(lambda: fed.events().count(core(MARK)) == count, "every marker, replayed if lost")
    events = fed.events()
    assert events[-count:] == [core(MARK)] * count
    return events


def connected(sub: KvSubscriber, fed: Fed, engine: HandEngine) -> None:
    wait_until(lambda: engine.subscribers and (True, "connected") in fed.changes(), "the subscription",
               pump=engine.pump)


# ------------------------------------------------------------------ order


def test_batches_arrive_in_order_as_kv_events_received() -> None:
    publisher = KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    fed = Fed()
    sub = subscriber([KvSource(URL, publisher.endpoint, publisher.replay_endpoint)], fed)
    try:
        wait_until(lambda: fed.changes() == [(True, "connected")], "connected")
        sent = [[stored(0), stored(1)], [sim.BlockRemoved((0,))], [stored(2)], [sim.AllBlocksCleared()], [stored(3)]]
        for batch in sent:
            publisher.publish(batch, ts=1.0)
        expected = [core(e) for batch in sent for e in batch]
        # (Batches the PUB sent before the subscription reached it come back by replay, in their place.)
        events = published_until_seen(publisher, fed)
        assert events[:len(expected)] == expected
        assert fed.threads == {"narwhal-kv-events"}
        assert sub.subscribed == {URL}
    finally:
        assert sub.close()
        publisher.close()


def test_a_late_subscriber_gets_the_earlier_batches_by_replay() -> None:
    publisher = KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    fed = Fed()
    try:
        for n in range(3):
            publisher.publish([stored(n)], ts=1.0)
        wait_until(lambda: publisher.published == 3, "three batches published before anyone listens")
        sub = subscriber([KvSource(URL, publisher.endpoint, publisher.replay_endpoint)], fed)
        wait_until(lambda: fed.changes() == [(True, "connected")], "connected")
        assert fed.events() == []  # (it learns it is late from the next batch)
        events = published_until_seen(publisher, fed)
        assert events[:3] == [core(stored(n)) for n in range(3)]
        assert sub.counters.replays >= 1 and sub.counters.replays_failed == 0
    finally:
        assert sub.close()
        publisher.close()


def test_a_gap_is_filled_from_the_replay_socket(hand: HandEngine) -> None:
    fed = Fed()
    sub = subscriber([hand.source], fed)
    try:
        connected(sub, fed, hand)
        hand.send(0, encode_batch([stored(0)], 1.0))
        hand.send(1, encode_batch([stored(1)], 1.0))
        wait_until(lambda: len(fed.events()) == 2, "batches 0 and 1", pump=hand.pump)
        assert hand.asked == []  # in order from 0: nothing to ask
        hand.send(2, encode_batch([stored(2)], 1.0), drop=True)
        hand.send(3, encode_batch([stored(3)], 1.0))
        wait_until(lambda: len(fed.events()) >= 4, "batches 2 and 3", pump=hand.pump)
        assert hand.asked == [2]
        assert fed.events() == [core(stored(n)) for n in range(4)]
        assert fed.changes() == [(True, "connected")]
    finally:
        assert sub.close()


def test_a_replay_that_never_answers_fails_and_the_stream_goes_on(hand: HandEngine) -> None:
    fed = Fed()
    with LogCapture() as log:
        sub = subscriber([hand.source], fed, replay_timeout=0.2)
        try:
            connected(sub, fed, hand)
            hand.answer = False
            hand.send(0, encode_batch([stored(0)], 1.0))
            hand.send(1, encode_batch([stored(1)], 1.0), drop=True)
            hand.send(2, encode_batch([stored(2)], 1.0))
            wait_until(lambda: len(fed.events()) >= 2, "batch 2, over the hole", pump=hand.pump)
            assert hand.asked == [1]
            assert fed.events() == [core(stored(0)), core(stored(2))]
            assert fed.changes() == [(True, "connected"), (False, "replay_failed"), (True, "resumed")]
            # The stream goes on in order after the hole.
            hand.send(3, encode_batch([stored(3)], 1.0))
            wait_until(lambda: len(fed.events()) >= 3, "batch 3", pump=hand.pump)
            assert fed.events()[-1] == core(stored(3)) and hand.asked == [1]
        finally:
            assert sub.close()
    failed = [e for e in log.events() if e["event"] == "kv_replay_failed"]
    assert len(failed) == 1 and failed[0]["engine"] == URL and failed[0]["level"] == "warning"
    assert sub.counters.replays_failed == 1


def test_without_a_replay_endpoint_a_gap_is_logged_and_skipped() -> None:
    hand = HandEngine(replay=False)
    fed = Fed()
    try:
        with LogCapture() as log:
            sub = subscriber([hand.source], fed)
            connected(sub, fed, hand)
            hand.send(0, encode_batch([stored(0)], 1.0))
            hand.send(2, encode_batch([stored(2)], 1.0))
            hand.send(4, encode_batch([stored(4)], 1.0))
            wait_until(lambda: len(fed.events()) >= 3, "the batches sent", pump=hand.pump)
            assert sub.close()
        assert fed.events() == [core(stored(0)), core(stored(2)), core(stored(4))]
        assert fed.changes() == [(True, "connected")]  # the operator chose no replay: no fallback
        gaps = [e for e in log.events() if e["event"] == "kv_events_gap"]
        assert len(gaps) == 1 and gaps[0]["from_seq"] == 1  # once per connection
        assert sub.counters.gaps == 2
    finally:
        hand.close()


def test_a_malformed_payload_is_logged_once_and_asked_for_again(hand: HandEngine) -> None:
    fed = Fed()
    with LogCapture() as log:
        sub = subscriber([hand.source], fed)
        try:
            connected(sub, fed, hand)
            hand.send(0, encode_batch([stored(0)], 1.0))
            wait_until(lambda: fed.events(), "batch 0", pump=hand.pump)
            # Batches 1 and 2 arrive garbled; the replay socket has them right.
            hand.pub.send_multipart((b"", (1).to_bytes(8, "big"), b"\xc1 not msgpack"))
            short = msgpack.packb([1.0, [["BlockStored", [2], None, [2], 2, None, "GPU", None]], 0])  # 1 token, not 2
            hand.pub.send_multipart((b"", (2).to_bytes(8, "big"), short))
            hand.batches[1] = encode_batch([stored(1)], 1.0)
            hand.batches[2] = encode_batch([stored(2)], 1.0)
            hand.send(3, encode_batch([stored(3)], 1.0))
            wait_until(lambda: len(fed.events()) >= 4, "batches 1 to 3", pump=hand.pump)
            assert fed.events() == [core(stored(n)) for n in range(4)]
            assert hand.asked == [1]
        finally:
            assert sub.close()
    malformed = [e for e in log.events() if e["event"] == "kv_events_malformed"]
    assert len(malformed) == 1 and "msgpack" in malformed[0]["problem"]
    assert sub.counters.malformed >= 2


# ------------------------------------------------------------- connection


def test_the_publisher_going_away_and_coming_back() -> None:
    engine = HandEngine(replay=False)
    fed = Fed()
    sub = subscriber([engine.source], fed)
    try:
        connected(sub, fed, engine)
        engine.send(0, encode_batch([stored(0)], 1.0))
        engine.send(1, encode_batch([stored(1)], 1.0))
        wait_until(lambda: len(fed.events()) >= 2, "the first engine's batches", pump=engine.pump)
        engine.close()
        wait_until(lambda: fed.changes()[-1:] == [(False, "disconnected")], "the disconnection")
        # The engine restarts on the same port: a new cache, sequence numbers from 0 again.
        engine = HandEngine(replay=False, endpoint=engine.endpoint)
        wait_until(lambda: engine.subscribers and fed.changes()[-1:] == [(True, "connected")], "the reconnection",
                   pump=engine.pump)
        engine.send(0, encode_batch([stored(7)], 1.0))
        wait_until(lambda: core(stored(7)) in fed.events(), "the restarted engine's batch", pump=engine.pump)
        assert fed.events() == [core(stored(0)), core(stored(1)), AllBlocksCleared(), core(stored(7))]
        assert fed.changes() == [(True, "connected"), (False, "disconnected"), (True, "connected")]
    finally:
        assert sub.close()
        engine.close()


def test_the_simulated_engine_going_away_is_seen() -> None:
    publisher = KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    fed = Fed()
    sub = subscriber([KvSource(URL, publisher.endpoint, publisher.replay_endpoint)], fed)
    try:
        wait_until(lambda: fed.changes() == [(True, "connected")], "connected")
        publisher.close()
        wait_until(lambda: fed.changes() == [(True, "connected"), (False, "disconnected")], "the disconnection")
    finally:
        assert sub.close()
        publisher.close()


def test_engines_come_and_go(hand: HandEngine) -> None:
    other = HandEngine(replay=False)
    other_url = "http://127.0.0.1:8200"
    fed = Fed()
    with LogCapture() as log:
        sub = subscriber([], fed)
        try:
            assert sub.subscribed == frozenset()
            sub.set_engines([hand.source, KvSource(other_url, other.endpoint, None)])
            wait_until(lambda: sub.subscribed == {URL, other_url}, "both engines subscribed")
            connected(sub, fed, hand)
            wait_until(lambda: other.subscribers and fed.changes(other_url), "the other engine",
                       pump=other.pump)
            sub.set_engines([KvSource(other_url, other.endpoint, None)])
            wait_until(lambda: sub.subscribed == {other_url}, "the first engine dropped")
            hand.send(0, encode_batch([stored(0)], 1.0))
            other.send(0, encode_batch([stored(5)], 1.0))  # (after the first: it arrives last)
            wait_until(lambda: fed.events(other_url), "the other engine's batch", pump=other.pump)
            assert fed.events(URL) == []
        finally:
            assert sub.close()
            other.close()
    lines = [(e["event"], e["engine"]) for e in log.events() if e["event"].startswith("kv_events_")
             and e["event"] != "kv_events_connected"]
    assert lines == [("kv_events_subscribed", URL), ("kv_events_subscribed", other_url),
                     ("kv_events_unsubscribed", URL)]


def test_an_endpoint_zmq_refuses_leaves_that_engine_out(hand: HandEngine) -> None:
    fed = Fed()
    with LogCapture() as log:
        sub = subscriber([KvSource("http://10.0.0.9:8100", "tcp://127.0.0.1:x", None), hand.source], fed)
        try:
            connected(sub, fed, hand)
            assert sub.subscribed == {URL}
        finally:
            assert sub.close()
    refused = [e for e in log.events() if e["event"] == "kv_events_endpoint_invalid"]
    assert [e["engine"] for e in refused] == ["http://10.0.0.9:8100"]


def test_close_stops_the_thread(hand: HandEngine) -> None:
    fed = Fed()
    sub = subscriber([hand.source], fed)
    connected(sub, fed, hand)
    assert sub.alive
    started = time.monotonic()
    assert sub.close(timeout=2.0)
    assert time.monotonic() - started < 1.0
    assert not sub.alive and sub.subscribed == frozenset()
    assert "narwhal-kv-events" not in {t.name for t in threading.enumerate()}
    count = len(fed.all())
    hand.send(0, encode_batch([stored(0)], 1.0))
    assert sub.close()  # again: nothing to stop
    assert len(fed.all()) == count


# ------------------------------------------------------------------ config


def config(**engine: Any) -> Any:
    return config_from_dict({"model": {"name": "m"}, "engine": {"decode": [URL], **engine}}, env={})


def test_the_templates_are_filled_in_per_engine() -> None:
    c = config(prefill=["http://[fd00::5]:8100", URL], kv_events="tcp://{host}:5557",
               kv_events_replay="tcp://{host}:{port}")
    assert config().engine.kv_events is None and config().engine.kv_events_replay is None
    addresses = [*c.engine.prefill_engines, *c.engine.decode_engines]
    assert kv_sources(c, addresses) == (
        KvSource("http://[fd00::5]:8100", "tcp://[fd00::5]:5557", "tcp://[fd00::5]:8100"),
        KvSource(URL, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:8100"),  # a mixed engine: one stream
    )
    assert kv_sources(config(), addresses) == ()
    with LogCapture() as log:
        sources = kv_sources(config(kv_events="tcp://{host}:1{port}"),
                             [parse_engine_url("http://10.0.0.1:65000", key="t")])
    assert sources == () and log.events()[0]["event"] == "kv_events_endpoint_invalid"


def test_every_data_parallel_rank_is_a_source_on_the_ports_plus_its_rank() -> None:
    # vLLM's ZmqEventPublisher.offset_endpoint_port: rank r on the port + r, for the replay socket too.
    c = config(prefill=[URL], kv_events="tcp://{host}:5557", kv_events_replay="tcp://{host}:5567",
               data_parallel_size=3, kv_events_socket="bind")  # fmt: skip
    assert kv_sources(c, c.engine.prefill_engines) == tuple(
        KvSource(URL, f"tcp://127.0.0.1:{5557 + r}", f"tcp://127.0.0.1:{5567 + r}", r, True) for r in range(3)
    )
    with LogCapture() as log:  # an engine joining at run time whose last rank's port is past 65535: left out
        sources = kv_sources(config(kv_events="tcp://{host}:{port}", data_parallel_size=3),
                             [parse_engine_url("http://10.0.0.1:65534", key="t")])  # fmt: skip
    assert sources == () and log.events()[0]["event"] == "kv_events_endpoint_invalid"


@pytest.mark.parametrize(("engine", "key", "problem"), [
    ({"kv_events": "{host}:5557"}, "engine.kv_events", "must be tcp://HOST:PORT"),
    ({"kv_events": "ipc:///tmp/kv"}, "engine.kv_events", "must be tcp://HOST:PORT"),
    ({"kv_events": "tcp://{host}:{rank}"}, "engine.kv_events", "only the placeholders {host} and {port}"),
    ({"kv_events": "tcp://*:5557"}, "engine.kv_events", "invalid host"),
    ({"kv_events": "tcp://{host}"}, "engine.kv_events", "must name a port"),
    ({"kv_events": "tcp://{host}:{port}0"}, "engine.kv_events", "port must be between 1 and 65535"),
    ({"kv_events_replay": "tcp://{host}:5558"}, "engine.kv_events_replay", "needs engine.kv_events"),
    ({"kv_events": "tcp://{host}:5557", "kv_events_replay": 5558}, "engine.kv_events_replay", "must be a string"),
])
def test_the_templates_are_checked_at_load(engine: dict[str, Any], key: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config(**engine)
    assert caught.value.key == key and problem in str(caught.value)


def test_a_template_is_checked_for_every_configured_engine() -> None:
    # 810 + "0" is a port; 65000 + "0" is not.
    assert config(kv_events="tcp://{host}:{port}0", decode=["http://10.0.0.1:810"]).engine.kv_events
    with pytest.raises(ConfigError, match=r"engine.kv_events: for http://10.0.0.2:65000: has an invalid port"):
        config(kv_events="tcp://{host}:{port}0", decode=["http://10.0.0.1:810", "http://10.0.0.2:65000"])


# ---------------------------------------------------------- in the server


def test_an_idle_subscriber_sleeps_until_a_command_wakes_it() -> None:
    # No replay in flight, nothing published: the thread waits without a timeout (no polling), and a
    # command (a new set of engines) wakes it at once.
    first, second = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    sub = subscriber([KvSource(first, f"tcp://127.0.0.1:{free_port()}")], Fed())
    try:
        wait_until(lambda: sub.subscribed == {first}, "the first engine subscribed")
        before = sub.counters.wakeups
        time.sleep(0.3)  # six polls' worth of the old 50 ms timeout
        assert sub.counters.wakeups == before
        sub.set_engines([KvSource(second, f"tcp://127.0.0.1:{free_port()}")])
        wait_until(lambda: sub.subscribed == {second}, "the second engine alone")  # (never, unwoken)
    finally:
        assert sub.close()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_server_runs_the_subscriber_and_feeds_its_loop(tmp_path: Path, runtime: str) -> None:
    publisher = KvEventPublisher("tcp://127.0.0.1:0")
    port = int(publisher.endpoint.rpartition(":")[2])
    engine = f"http://127.0.0.1:{free_port()}"  # (no engine: its probes fail, which does not matter here)
    config = make_config(tmp_path / "journal.jsonl", prefill=(engine,), decode=(f"http://127.0.0.1:{free_port()}",),
                         engine={"kv_events": f"tcp://{{host}}:{port}"})
    seen: list[tuple[Any, str]] = []
    try:
        with RouterThread(config, runtime) as router:
            sub = router.server.serving.kv_subscriber
            assert sub.alive and sub.subscribed == {engine}

            def intercept() -> None:
                # What the router does with the events is the index's (tests/core); here: that they reach its loop.
                driver = router.server.driver
                feed = driver.feed

                def feed_or_keep(event: Any, now: float) -> bool:
                    if type(event) in (KvEventsReceived, KvStreamChanged):
                        seen.append((event, threading.current_thread().name))
                        return bool(driver.pending())
                    return bool(feed(event, now))

                driver.feed = feed_or_keep

            router.call(intercept)

            def published() -> bool:
                publisher.publish([stored(0)], ts=1.0)  # again until one arrives (no replay socket here)
                return any(type(e) is KvEventsReceived for e, _ in seen)

            wait_until(published, "a batch fed on the router's loop")
            assert [e.events for e, _ in seen if type(e) is KvEventsReceived][0] == (core(stored(0)),)
            publisher.close()
            wait_until(lambda: KvStreamChanged(engine, False, "disconnected") in [e for e, _ in seen],
                       "the disconnection fed on the router's loop")
            assert {thread for _, thread in seen} == {f"router-{runtime}"}
    finally:
        publisher.close()
    assert not sub.alive and sub.subscribed == frozenset()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_subscriber_follows_the_engines_discovery_finds(tmp_path: Path, runtime: str) -> None:
    first, second, decode = (f"http://127.0.0.1:{free_port()}" for _ in range(3))
    engines = tmp_path / "engines.toml"
    # Only prefill engines' streams are read (decode legs go by load): the decode engine is never subscribed.
    engines.write_text(f'prefill = ["{first}"]\ndecode = ["{decode}"]\n')
    config = make_config(tmp_path / "journal.jsonl",
                         engine={"discovery": "file", "kv_events": "tcp://{host}:{port}"},
                         discovery={"file": str(engines), "interval_s": 0.05})
    with RouterThread(config, runtime) as router:
        sub = router.server.serving.kv_subscriber
        wait_until(lambda: sub.subscribed == {first}, "the first engine subscribed")
        engines.write_text(f'prefill = ["{second}"]\ndecode = ["{decode}"]\n')
        wait_until(lambda: sub.subscribed == {second}, "the second engine alone")
    assert not sub.alive
