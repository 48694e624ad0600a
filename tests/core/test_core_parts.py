"""The core's parts (docs/design.md, "The parts of the core"): the lifecycle table, its closed failure, the engine choice."""

from __future__ import annotations

import inspect

import pytest

from narwhal_core import TransitionError
from narwhal_core.fleet import Fleet
from narwhal_core.ids import DECODE
from narwhal_core.lifecycle import TRANSITIONS, Lifecycle
from narwhal_core.states import Input, State

from .router_driver import COMPLETIONS, Driver, completion_body

_LIVE = (State.PREFILL, State.PREFILL_WAIT, State.DECODE, State.DECODE_WAIT, State.STREAMING)


def test_every_row_names_a_lifecycle_handler_and_states_it_may_leave() -> None:
    for (state, event), (handler, allowed) in TRANSITIONS.items():
        assert isinstance(state, State) and isinstance(event, Input)
        assert getattr(Lifecycle, handler.__name__) is handler, (state, event)
        assert list(inspect.signature(handler).parameters)[:2] == ["self", "req"], handler.__name__
        assert allowed and all(isinstance(s, State) for s in allowed), (state, event)
    for state in (State.QUEUED, *_LIVE):
        # Whatever a request is doing, its client may go, its deadline may pass, shutdown may cut it short.
        for event in (Input.CLIENT_GONE, Input.DEADLINE, Input.ABANDON):
            assert (state, event) in TRANSITIONS, (state, event)
    assert not [key for key in TRANSITIONS if key[0] is State.DONE]  # DONE takes no input


def test_an_input_with_no_row_fails_closed() -> None:
    d = Driver()
    client = d.post(COMPLETIONS, completion_body(prompt="no row"))
    (req,) = d.router.requests.active.values()
    assert req.state is State.PREFILL
    with pytest.raises(TransitionError, match="no transition for state prefill on input released"):
        d.router.lifecycle.fire(req, Input.RELEASED)
    d.drain()  # what the adapter would do after the exception (contain_failure aside)
    assert client.last.status == 500
    record = d.terminal(req.rid)
    assert record["terminal"] == "failed" and record["error"]["code"] == "internal_error", record
    assert [log for log in d.logs if log.event == "internal_error"]
    assert d.router.statistics().requests == 0
    d.router.lifecycle.fire(req, Input.RELEASED)  # DONE: an input is ignored


def test_the_engine_choice_is_least_loaded_and_avoids_engines_failed_on() -> None:
    d = Driver()
    fleet: Fleet = d.router.fleet
    assert len(fleet.engines[DECODE]) == 2
    first = fleet.choose(DECODE, request_key="r1", now=0.0)
    assert first is not None
    fleet.leg_started(first)
    second = fleet.choose(DECODE, request_key="r2", now=0.0)
    assert second is not None and second is not first  # the least loaded
    assert fleet.choose(DECODE, [second], request_key="r3", now=0.0) is first  # not the one failed on
