"""Each run uses the runtime it names (docs/design.md, docs/operate.md: ``--runtime trio|asyncio``).

The conformance suite runs every end-to-end test on both runtimes; these
tests make sure that "asyncio" is not trio in disguise (or the reverse): the
harness records the async library that runs the router's loop, the loop's
own thread is inspected from inside, and ``narwhal serve --runtime R`` is run
as a real process.
"""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest
import trio

from narwhal_build import PURE_ENV, compiled_files

from ..harness import RUNTIMES, RouterThread, make_config
from ..helpers import read_journal, terminals_by_rid
from .support import ServeProcess, serve_config

try:
    import uvloop
except ImportError:
    uvloop = None  # type: ignore[assignment]


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def test_router_loop_runs_the_named_runtime(start_router, runtime) -> None:
    router = start_router()
    # sniffio, asked by the harness from inside the router's loop.
    assert router.loop_library == runtime
    # The server object is the named runtime's.
    assert type(router._server).__module__ == f"narwhal_{runtime}.server"
    # And from inside the loop thread, now.
    loop = router.call(_running_loop)
    in_trio = router.call(trio.lowlevel.in_trio_run)
    if runtime == "trio":
        assert in_trio is True
        assert loop is None, f"the trio runtime's thread runs an asyncio loop: {loop!r}"
    else:
        assert in_trio is False
        assert loop is not None
    # It serves, too.
    assert httpx.get(router.url + "/health", timeout=10).status_code == 200


def test_in_process_asyncio_runs_the_standard_loop(fleet, journal_path) -> None:
    # The conformance suite's asyncio runtime: the standard library's loop,
    # uvloop installed or not (`narwhal serve` picks uvloop, see below).
    config = make_config(journal_path, prefill=fleet.prefill_urls, decode=fleet.decode_urls)
    with RouterThread(config, "asyncio") as router:
        loop_type = router.call(lambda: type(asyncio.get_running_loop()))
    assert router.loop_library == "asyncio"
    assert loop_type.__module__.startswith("asyncio"), loop_type


def test_narwhal_serve_asyncio_runs_uvloop_when_installed() -> None:
    from narwhal_asyncio.server import loop_name, new_event_loop

    fresh = new_event_loop()
    try:
        if uvloop is not None:
            assert isinstance(fresh, uvloop.Loop), fresh
        assert loop_name(fresh) == ("uvloop" if uvloop is not None else "asyncio")
    finally:
        fresh.close()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("serve_runtime", RUNTIMES)
def test_narwhal_serve_process_names_its_runtime(serve_runtime, signum, fleet, tmp_path) -> None:
    journal = tmp_path / "journal.jsonl"
    config = tmp_path / "narwhal.toml"
    config.write_text(serve_config(journal, prefill=fleet.prefill_urls, decode=fleet.decode_urls))
    process = ServeProcess(config, serve_runtime).start()
    try:
        listening = process.wait_for_event("listening")
        assert listening["runtime"] == serve_runtime
        # The loop that serves: trio, or asyncio on uvloop when it is installed.
        expected_loop = "trio" if serve_runtime == "trio" else ("uvloop" if uvloop is not None else "asyncio")
        assert listening["loop"] == expected_loop, listening
        url = f"http://{listening['host']}:{listening['port']}"
        answer = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=10)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"]
        rid = answer.headers["x-request-id"]
        assert process.proc is not None
        process.proc.send_signal(signum)
        assert process.wait(20) == 0, process.stderr_text()
        events = [e.get("event") for e in process.events()]
        assert "signal" in events and "drained" in events and events[-1] == "stopped", events
        stopped = next(e for e in process.events() if e.get("event") == "stopped")
        assert stopped["runtime"] == serve_runtime
        assert terminals_by_rid(read_journal(journal))[rid]["terminal"] == "completed"
    finally:
        process.stop()


@pytest.mark.parametrize("pure", [False, True], ids=["as-installed", "NARWHAL_PURE_PYTHON"])
def test_narwhal_serve_names_the_core_build_it_runs(pure, fleet, tmp_path) -> None:
    # `pip install` compiles the core where it can (setup.py); the process
    # log says which build serves, and NARWHAL_PURE_PYTHON=1 picks the sources.
    journal = tmp_path / "journal.jsonl"
    config = tmp_path / "narwhal.toml"
    config.write_text(serve_config(journal, prefill=fleet.prefill_urls, decode=fleet.decode_urls))
    env = {PURE_ENV: "1"} if pure else {PURE_ENV: ""}
    process = ServeProcess(config, "asyncio", env=env).start()
    try:
        listening = process.wait_for_event("listening")
        if pure or not compiled_files():
            assert listening["core"] == "pure", listening
        else:
            assert listening["core"] in ("compiled", "mixed"), listening
        assert not any(e.get("event") == "core_stale" for e in process.events())
        url = f"http://{listening['host']}:{listening['port']}"
        answer = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=10)
        assert answer.status_code == 200, answer.text
    finally:
        process.stop()
