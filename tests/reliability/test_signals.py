"""Fault matrix: the router process is signalled (docs/contract.md, "Admission, capacity and retries", "The
journal"; docs/operate.md).

``narwhal serve --config FILE --runtime R`` runs as a subprocess; its port
comes from the JSON ``listening`` line on stderr.

* SIGTERM with streams in flight: it stops accepting, the streams run to
  ``[DONE]``, every request gets its terminal record, and it exits 0.
* SIGKILL with slow requests in flight: ``narwhal journal --unfinished FILE``
  lists exactly the requests that were admitted and have no terminal record;
  a torn last line is reported and skipped, never fatal — also to a router
  restarted on the same journal.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Any

import httpx

from ..helpers import CHAT, COMPLETIONS, only_terminals, poll, read_journal, rid_of
from .support import ServeProcess, StreamClient, assert_completed_stream, post, run_journal_cli, write_config


def _stdout_records(result: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in result.stdout.decode().splitlines() if line.strip()]


def test_sigterm_lets_in_flight_streams_finish(runtime, sims, tmp_path) -> None:
    prefill = sims("prefill")
    # At speed 1 each token takes ~7 ms: 120 tokens keep a stream going for ~0.85 s.
    decode = sims("decode", speed=1.0)
    journal = tmp_path / "journal.jsonl"
    config = write_config(tmp_path / "narwhal.toml", journal, prefill=[prefill.url], decode=[decode.url])
    server = ServeProcess(config, runtime).start(listening_timeout=20)
    streams: list[StreamClient] = []
    try:
        for route in (COMPLETIONS, CHAT, COMPLETIONS):
            streams.append(StreamClient(server, route, max_tokens=120))  # type: ignore[arg-type]
        for stream in streams:
            assert stream.status == 200
            stream.read_events(1)
        os.kill(server.pid, signal.SIGTERM)
        draining = server.wait_for_event("draining")
        assert draining["requests"] == 3, draining  # all three still in flight
        # It no longer takes new requests: the listener is closed (or, if the
        # connection still got in, the request is refused and journalled).
        late_records = 0
        try:
            late = httpx.post(server.url + COMPLETIONS, json={"prompt": "late"}, timeout=5)
        except httpx.TransportError:
            pass
        else:
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down", late.text
            late_records = 1
        texts = [stream.read_all() for stream in streams]
        rids = [stream.rid for stream in streams]
        code = server.wait(15)
    finally:
        for stream in streams:
            stream.close()
        server.kill()

    assert code == 0, server.lines
    for text in texts:
        chunks = assert_completed_stream(text)
        assert len(chunks) >= 120, len(chunks)
    records = only_terminals(journal, 3 + late_records)
    for rid in rids:
        assert records[rid]["terminal"] == "completed" and records[rid]["status"] == 200, records[rid]
    assert {"signal", "draining", "drained", "stopped"} <= {e.get("event") for e in server.events()}
    # Every KV handed over was pulled.
    assert prefill.stats()["kv_held"] == 0


def test_sigkill_leaves_unfinished_requests_listed(runtime, sims, tmp_path) -> None:
    prefill = sims("prefill")
    decode = sims("decode")
    journal = tmp_path / "journal.jsonl"
    config = write_config(tmp_path / "narwhal.toml", journal, prefill=[prefill.url], decode=[decode.url])
    server = ServeProcess(config, runtime).start(listening_timeout=20)
    threads: list[threading.Thread] = []
    try:
        done = post(server)  # type: ignore[arg-type]
        assert done.status_code == 200, done.text
        # From now on prefill legs take 5 s: three requests are admitted and stay in flight.
        prefill.set_faults(delay_s=5.0)
        for _ in range(3):
            thread = threading.Thread(target=_post_ignoring_errors, args=(server.url,), daemon=True)
            thread.start()
            threads.append(thread)

        def admitted() -> set[str]:
            return {r["rid"] for r in read_journal(journal) if r.get("terminal") is None}

        poll(lambda: len(admitted()) == 4, what="four admitted requests in the journal")
        poll(lambda: len(prefill.requests()) >= 4, what="three slow prefill legs running")
        server.proc.kill()  # type: ignore[union-attr]
        assert server.wait(10) == -signal.SIGKILL
    finally:
        server.kill()
        for thread in threads:
            thread.join(10)

    records = read_journal(journal)
    finished = {r["rid"] for r in records if r.get("terminal") is not None}
    in_flight = {r["rid"] for r in records if r.get("terminal") is None} - finished
    assert finished == {rid_of(done)}, records
    assert len(in_flight) == 3, records

    result = run_journal_cli(os.fspath(journal), "--unfinished")
    assert result.returncode == 0, result.stderr
    listed = _stdout_records(result)
    assert sorted(r["rid"] for r in listed) == sorted(in_flight), listed
    assert all(r["terminal"] is None for r in listed), listed

    # A crash mid-write tears the last line: reported on stderr, skipped, not fatal.
    with open(journal, "ab") as file:
        file.write(b'{"ts": 1800000000.0, "rid": "torn0000", "termi')
    result = run_journal_cli(os.fspath(journal), "--unfinished")
    assert result.returncode == 0, result.stderr
    assert "torn" in result.stderr.decode(), result.stderr
    assert sorted(r["rid"] for r in _stdout_records(result)) == sorted(in_flight)
    result = run_journal_cli(os.fspath(journal))
    assert result.returncode == 0, result.stderr
    assert {r["rid"] for r in _stdout_records(result)} == in_flight | finished

    # A router restarted on the torn journal keeps appending readable records.
    prefill.set_faults()
    server = ServeProcess(config, runtime).start(listening_timeout=20)
    try:
        again = post(server)  # type: ignore[arg-type]
        assert again.status_code == 200, again.text
        os.kill(server.pid, signal.SIGTERM)
        assert server.wait(15) == 0, server.lines
    finally:
        server.kill()
    result = run_journal_cli(os.fspath(journal), "--rid", rid_of(again))
    assert result.returncode == 0, result.stderr
    mine = _stdout_records(result)
    assert mine and mine[-1]["terminal"] == "completed", (mine, result.stderr)
    result = run_journal_cli(os.fspath(journal), "--unfinished")
    assert result.returncode == 0, result.stderr
    assert sorted(r["rid"] for r in _stdout_records(result)) == sorted(in_flight)


def _post_ignoring_errors(url: str) -> None:
    try:
        httpx.post(url + COMPLETIONS, json={"prompt": "slow one", "max_tokens": 2}, timeout=15)
    except httpx.TransportError:
        pass  # the router was killed under it
