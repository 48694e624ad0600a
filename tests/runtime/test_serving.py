"""The start and the end of serving, written once for both adapters (narwhal_runtime/serving.py, ``Serving``).

Each test runs a real ``Server`` of each runtime on loopback: the rules
checked here are the shared ones, so both must show them alike.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from narwhal_core import Config

from ..harness import LogCapture, make_config

RUNTIMES = ("trio", "asyncio")


def _closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return int(s.getsockname()[1])


def _config(tmp_path: Path, **sections: Any) -> Config:
    # Engines nobody listens on: their probes fail at once, nothing else is asked of them.
    port = _closed_port()
    return make_config(tmp_path / "journal.jsonl", prefill=(f"http://127.0.0.1:{port}",),
                       decode=(f"http://127.0.0.1:{port}",), **sections)


def _serve(runtime: str, config: Config, before: Any = None, timeout: float = 10.0) -> Any:
    """Build a ``Server``, call ``before(server)``, serve until the drain ends; the server."""
    if runtime == "trio":
        from narwhal_trio.server import Server as TrioServer

        async def main() -> Any:
            server = TrioServer(config)
            if before is not None:
                before(server)
            with trio.fail_after(timeout):
                async with trio.open_nursery() as nursery:
                    await nursery.start(server.serve)
            return server

        return trio.run(main)

    from narwhal_asyncio.server import Server as AsyncioServer

    async def amain() -> Any:
        server = AsyncioServer(config)
        if before is not None:
            before(server)
        await asyncio.wait_for(server.serve(), timeout)
        return server

    return asyncio.run(amain())


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_shutdown_asked_before_serving_begins_once_it_serves(runtime: str, tmp_path: Path) -> None:
    # A signal while starting: the drain begins once the server listens, and serve() returns.
    with LogCapture() as log:
        _serve(runtime, _config(tmp_path), before=lambda server: server.serving.shutdown())
    events = [e["event"] for e in log.events()]
    assert "flush_error" not in events and "internal_error" not in events, events
    assert events.index("listening") < events.index("stopped"), events
    assert events[-1] == "stopped"
    assert [e["runtime"] for e in log.events() if e["event"] in ("listening", "stopped")] == [runtime, runtime]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_discovery_runs_while_serving_and_feeds_through_feed_now(runtime: str, tmp_path: Path) -> None:
    # Discovery feeds through the adapter's feed_now, as the KV events, the tokenizer and SIGHUP do: no wait
    # behind a slow client, no busy-poll window (only an event from a socket opens one).
    url = f"http://127.0.0.1:{_closed_port()}"
    engines = tmp_path / "engines.toml"
    engines.write_text(f'prefill = []\ndecode = ["{url}"]\n')
    config = make_config(tmp_path / "journal.jsonl", engine={"discovery": "file"}, ingress={"busy_poll_us": 1000},
                         discovery={"file": str(engines), "interval_s": 0.05})
    config = attrs.evolve(config, journal=attrs.evolve(config.journal, fsync="interval"))
    heard: list[Any] = []

    def before(server: Any) -> None:
        serving = server.serving
        assert serving.feed == serving.feed_and_poll  # busy polling: a socket's event opens the window
        feed_now = server.feed_now

        def watching(event: Any) -> None:
            feed_now(event)
            if type(event).__name__ == "EnginesChanged":
                heard.append((event.phase, [a.url for a in event.engines]))
                if event.engines:
                    serving.shutdown()  # the test's end: the discovered engine reached the router

        server.feed_now = watching

    server = _serve(runtime, config, before=before)
    assert ("decode", [url]) in heard, heard
    tasks = [getattr(task, "func", task) for task in server.serving.background()]
    assert tasks == [server.serving.journal.run_sync_timer, server.serving.discovery.run]


class _Subscriber:
    """Records what the effects subscribe the KV-event thread to."""

    def __init__(self) -> None:
        self.sets: list[list[str]] = []

    def set_engines(self, sources: Any) -> None:
        self.sets.append([f"{s.url} {s.endpoint}" for s in sources])


def test_the_kv_subscriber_follows_the_fleet_by_its_command_not_by_its_log_lines(tmp_path: Path) -> None:
    # Before, the server watched its own log lines (engine_added, engine_removed) and read the fleet
    # back from the router; now the router's FleetChanged says the phase's engines, and that is all.
    from narwhal_core import FleetChanged
    from narwhal_core.config import parse_engine_url
    from narwhal_runtime.effects import ServingEffects
    from narwhal_runtime.journal_writer import JournalWriter

    config = attrs.evolve(_config(tmp_path), engine=attrs.evolve(_config(tmp_path).engine,
                                                                 kv_events="tcp://{host}:5557"))
    subscriber = _Subscriber()
    journal = JournalWriter(str(tmp_path / "effects.jsonl"), "never")
    effects = ServingEffects(config, journal, tracer=None, kv_subscriber=subscriber,  # type: ignore[arg-type]
                             tokenize_worker=None, feed_now=lambda event: None)
    first, second = (parse_engine_url(f"http://10.0.0.{n}:8100", key="test") for n in (1, 2))
    with LogCapture() as log:
        effects.log("engine_added", {"engine": second.url, "phase": "prefill", "source": "dns"})
    assert [e["event"] for e in log.events()] == ["engine_added"]
    assert subscriber.sets == []  # a log line is only a log line
    effects.fleet_changed(FleetChanged(phase="prefill", engines=(first, second)))
    assert subscriber.sets == [["http://10.0.0.1:8100 tcp://10.0.0.1:5557", "http://10.0.0.2:8100 tcp://10.0.0.2:5557"]]
    effects.fleet_changed(FleetChanged(phase="decode", engines=(first,)))  # decode legs go by load: no stream
    effects.fleet_changed(FleetChanged(phase="prefill", engines=()))
    assert subscriber.sets[1:] == [[]]
    journal.close()


def test_both_servers_are_the_adapter_that_serving_asks_for() -> None:
    # narwhal_runtime/serving.py's Adapter is what each runtime's Server must offer, alike on both.
    import inspect

    from narwhal_asyncio.server import Server as AsyncioServer
    from narwhal_runtime.serving import Adapter
    from narwhal_trio.server import Server as TrioServer

    hooks = [name for name, value in vars(Adapter).items() if callable(value) and not name.startswith("_")]
    assert hooks == ["feed", "feed_now", "after_drain", "flush", "start_polling"]
    for name in hooks:
        asked = list(inspect.signature(getattr(Adapter, name)).parameters)
        for server in (TrioServer, AsyncioServer):
            given = inspect.signature(getattr(server, name)).parameters
            assert list(given)[:len(asked)] == asked, (server, name)
            assert all(p.default is not p.empty for p in list(given.values())[len(asked):]), (server, name)
        assert str(inspect.signature(getattr(TrioServer, name))) == str(inspect.signature(getattr(AsyncioServer, name)))
