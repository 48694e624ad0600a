"""Fault matrix: an engine killed and restarted, and every engine of a phase down (docs/contract.md, "Request
rules", "Admission, capacity and retries").

Engines that must die run as processes (``SimProcess``): SIGKILL, as a crash,
then a restart on the same port. Active probes (every 0.2 s here) take a dead
engine out of rotation — ``/ready``, ``/metrics`` ``narwhal_engine_healthy``
and the legs show it — and bring it back once it answers again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from narwhal_sim.testing import SimProcess

from ..harness import Fleet
from ..helpers import assert_envelope, journal_terminal, poll, rid_of
from .support import KV_MODES, assert_failed, assert_idle, assert_kv_settled, metric, post


@pytest.fixture
def processes() -> Iterator[Any]:
    """``processes(role, **options)``: a started SimProcess (speed 0), stopped after the test."""
    started: list[SimProcess] = []

    def start(role: str, **options: Any) -> SimProcess:
        options.setdefault("speed", 0)
        sim = SimProcess(role=role, **options).start()
        started.append(sim)
        return sim

    yield start
    for sim in started:
        sim.stop()


def healthy(router: Any, url: str, phase: str) -> bool:
    return bool(router.statistics().engine_healthy[(url, phase)])


def ready(router: Any) -> httpx.Response:
    return httpx.get(router.url + "/ready", timeout=5)


def test_killed_engine_leaves_rotation_and_rejoins_after_restart(
    start_router, sims, processes, journal_path
) -> None:
    doomed = processes("prefill")
    spare = sims("prefill")
    fleet = Fleet(prefill=[doomed, spare], decode=[sims("decode")])
    router = start_router(fleet_=fleet)
    poll(lambda: ready(router).status_code == 200, what="router ready")

    def prefill_legs(answers: list[httpx.Response]) -> list[list[tuple[str, str]]]:
        """(engine, outcome) of each request's prefill legs."""
        out = []
        for answer in answers:
            assert answer.status_code == 200, answer.text
            record = journal_terminal(journal_path, rid_of(answer))
            assert record["terminal"] == "completed", record
            out.append([(leg["engine"], leg["outcome"]) for leg in record["legs"] if leg["phase"] == "prefill"])
        return out

    # Both engines serve.
    assert sorted(prefill_legs([post(router), post(router)])) == sorted(
        [[(doomed.url, "ok")], [(spare.url, "ok")]]
    )

    doomed.kill()
    poll(lambda: not healthy(router, doomed.url, "prefill"), timeout=5, what="killed engine out of rotation")
    assert metric(router, "narwhal_engine_healthy", engine=doomed.url, phase="prefill") == 0
    assert metric(router, "narwhal_engine_healthy", engine=spare.url, phase="prefill") == 1
    answer = ready(router)
    assert answer.status_code == 200, answer.text  # one healthy engine per phase is enough
    # Every leg goes to the engine left; none is even tried on the dead one.
    assert prefill_legs([post(router) for _ in range(4)]) == [[(spare.url, "ok")]] * 4
    assert_idle(router)

    doomed.restart()
    poll(lambda: healthy(router, doomed.url, "prefill"), timeout=5, what="restarted engine back in rotation")
    assert metric(router, "narwhal_engine_healthy", engine=doomed.url, phase="prefill") == 1
    # It takes legs again, and the first attempt of each request succeeds: the
    # restarted engine is healthy, so no leg may fail on it.
    legs = prefill_legs([post(router) for _ in range(4)])
    assert [(doomed.url, "ok")] in legs, legs
    assert all(len(attempts) == 1 and attempts[0][1] == "ok" for attempts in legs), legs
    # The simulator counts a pull on the prefill engine before it answers the decode engine's
    # read, so a completed request prefilled on `doomed` has been pulled by now -- unless its
    # decode leg did not pull (a failed read: see the decode engine's counters).
    assert doomed.stats()["kv_pulled"] >= 1, (doomed.stats(), fleet.decode[0].stats(), legs)
    assert healthy(router, doomed.url, "prefill")
    assert_kv_settled([doomed, spare], None)
    assert_idle(router)


def test_engine_killed_mid_leg_is_retried_elsewhere(start_router, sims, processes, journal_path) -> None:
    # The doomed engine sits on every prefill leg for 5 s: the first leg is in flight when it dies.
    doomed = processes("prefill", faults={"delay_s": 5.0})
    spare = sims("prefill")
    fleet = Fleet(prefill=[doomed, spare], decode=[sims("decode")])
    router = start_router(fleet_=fleet)
    poll(lambda: ready(router).status_code == 200, what="router ready")

    box: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: box.append(post(router)), daemon=True)
    thread.start()
    poll(lambda: len([r for r in doomed.requests() if r["path"] == "/v1/completions"]) == 1,
         what="first leg on the doomed engine")
    doomed.kill()
    thread.join(10)

    assert box and box[0].status_code == 200, box
    record = journal_terminal(journal_path, rid_of(box[0]))
    assert record["terminal"] == "completed", record
    assert [(leg["phase"], leg["attempt"], leg["engine"], leg["outcome"]) for leg in record["legs"]] == [
        ("prefill", 1, doomed.url, "dropped"),
        ("prefill", 2, spare.url, "ok"),
        ("decode", 1, fleet.decode[0].url, "ok"),
    ], record["legs"]
    assert_idle(router)
    assert_kv_settled([spare], None)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_every_engine_of_a_phase_down_is_rejected(start_router, sims, processes, journal_path, phase) -> None:
    doomed = processes(phase)
    fleet = Fleet(
        prefill=[doomed if phase == "prefill" else sims("prefill")],
        decode=[doomed if phase == "decode" else sims("decode")],
    )
    router = start_router(fleet_=fleet)
    poll(lambda: ready(router).status_code == 200, what="router ready")

    doomed.kill()
    poll(lambda: ready(router).status_code == 503, timeout=5, what="/ready 503")
    assert f"no healthy {phase} engine" in ready(router).json()["problems"]
    assert metric(router, "narwhal_engine_healthy", engine=doomed.url, phase=phase) == 0
    assert metric(router, "narwhal_ready") == 0

    answer = post(router)
    # docs/contract.md, "Admission, capacity and retries": the fleet cannot take it — 503 with Retry-After,
    # journal "rejected", no leg tried.
    assert_envelope(answer, 503, type="server_error", code="engine_unavailable", retry_after=True)
    record = journal_terminal(journal_path, rid_of(answer))
    assert record["terminal"] == "rejected" and record["status"] == 503, record
    assert record["error"]["code"] == "engine_unavailable" and record["legs"] == [], record
    assert_idle(router)

    doomed.restart()
    poll(lambda: ready(router).status_code == 200, timeout=5, what="/ready 200 after the restart")
    answer = post(router)
    assert answer.status_code == 200, answer.text
    assert journal_terminal(journal_path, rid_of(answer))["terminal"] == "completed"
    assert_idle(router)


@pytest.mark.parametrize("mode", KV_MODES)
def test_every_decode_engine_gone_mid_flight_fails(start_router, make_fleet, journal_path, mode) -> None:
    # The router still counts the engine in rotation (it leaves only after 10
    # failures): every attempt is made, and each fails to connect.
    fleet = make_fleet(prefill=[{}], decode=[{}], mode=mode, lease_s=0.6)
    (_prefill,), (decode,) = fleet.prefill, fleet.decode
    router = start_router(fleet_=fleet, engine={"kv_release": mode}, health={"unhealthy_after": 10})
    decode.stop()

    answer = post(router)

    assert_envelope(answer, 503, type="server_error", code="engine_unavailable")
    rid = rid_of(answer)
    record = journal_terminal(journal_path, rid)
    assert_failed(record, code="engine_unavailable", leg="decode", engine=decode.url, status=503)
    legs = record["legs"]
    assert [(leg["phase"], leg["outcome"]) for leg in legs] == [
        ("prefill", "ok"), ("decode", "connect_failed"),
    ] * 3, legs
    kvs = [leg["kv"] for leg in legs if leg["phase"] == "prefill"]
    if mode == "abort_endpoint":
        # The prefill engine is up: each attempt's KV is released there.
        assert [(kv["outcome"], kv["method"]) for kv in kvs] == [("released", "abort_endpoint")] * 3, kvs
        assert_kv_settled(fleet.prefill, mode, unpulled=3)
    else:
        # lease: nothing to do; decode_abort, decode_pull: no decode engine can carry the release
        # (connection refused: nothing was sent). The lease frees them.
        assert all(kv["outcome"] == "held_until_lease" for kv in kvs), kvs
        if mode in ("decode_abort", "decode_pull"):
            assert all(kv["error"] for kv in kvs), kvs
        assert_kv_settled(fleet.prefill, "lease", unpulled=3)
    assert_idle(router)


def test_engine_closing_idle_connections_is_not_a_leg_failure(start_router, make_fleet, journal_path) -> None:
    """An engine closes idle keep-alive connections (uvicorn: after 5 s; here 0.3 s).

    The router's next leg to that engine must not be charged as a failure of
    the engine nor cost the request an attempt (or, for a decode leg, its KV).
    """
    fleet = make_fleet(prefill=[{}], decode=[{}], prefill_options={"keep_alive_s": 0.3},
                       decode_options={"keep_alive_s": 0.3})
    router = start_router(fleet_=fleet)
    rids = []
    for _ in range(3):
        answer = post(router)
        assert answer.status_code == 200, answer.text
        rids.append(rid_of(answer))
        # The engines close the idle connections (the router's kept-alive legs among them).
        for engine in (*fleet.prefill, *fleet.decode):
            engine.wait_for(lambda s: s["connections"] == 0, timeout=5)
    for rid in rids:
        record = journal_terminal(journal_path, rid)
        assert record["terminal"] == "completed", record
        assert [(leg["phase"], leg["attempt"], leg["outcome"]) for leg in record["legs"]] == [
            ("prefill", 1, "ok"), ("decode", 1, "ok"),
        ], record["legs"]
    assert_idle(router)
    assert_kv_settled(fleet.prefill, None)
    assert fleet.prefill[0].stats()["kv_pulled"] == 3
