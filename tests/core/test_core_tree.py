"""The core's parts form a tree (docs/design.md, "The parts of the core", "Follow-up work").

No circle among the core's modules, their imports for annotations only
(under ``TYPE_CHECKING``) counted too; the router and the lifecycle at the
top; ``fire`` called only by the lifecycle and the router's dispatch; no
part introduced to another after construction (no ``connect()``).

Work an event leaves for *other* requests (wake a slot waiter, admit from
the admission queue) goes on the one follow-up queue, which the router
drains once the event is handled: no handler runs inside another request's
handler, and no other request's input is fired before the queue drains.
The router state machine (``test_router_machine``) walks the events; here
the lifecycle's ``fire`` is watched while it does.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import settings

from narwhal_core.lifecycle import Lifecycle
from narwhal_core.router import Router
from narwhal_core.states import Input
from narwhal_core.timers import Timers

from .. import corebuild
from ..helpers import REPO
from .router_driver import COMPLETIONS, DECODE_URLS, PREFILL_URLS, Driver, completion_body
from .test_router_machine import RouterMachine

_spec = importlib.util.spec_from_file_location("code_shape", REPO / "benchmarks" / "code_shape.py")
assert _spec is not None and _spec.loader is not None
code_shape = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(code_shape)

#: The engine choice and the routing policies that weigh it, one layer (docs/design.md,
#: "The parts of the core"): the fleet hands its choice to the policy, the policy reads the fleet's engines.
ENGINE_CHOICE = frozenset({"narwhal_core.fleet", "narwhal_core.policies", "narwhal_core.kv_policy"})
#: The only modules that fire a request's lifecycle input.
FIRES = frozenset({"narwhal_core.lifecycle", "narwhal_core.router"})
#: The top of the tree: nothing in the core imports them but the package's face (and the router, the lifecycle).
TOP = {"narwhal_core.router": {"narwhal_core"}, "narwhal_core.lifecycle": {"narwhal_core.router"}}


def core_modules() -> dict[str, Any]:
    return dict(code_shape.modules(REPO, ("narwhal_core",)))


def core_graph() -> dict[str, set[str]]:
    """Module -> the core modules it imports, at run time or for annotations (``TYPE_CHECKING``)."""
    found = core_modules()
    known = set(found)
    return {name: code_shape.imports(name, path, known, type_only=True) for name, path in found.items()}


def test_no_circle_among_the_core_modules_annotations_counted() -> None:
    graph = core_graph()
    assert len(graph) > 40, sorted(graph)

    def node(name: str) -> str:
        return "engine choice" if name in ENGINE_CHOICE else name

    layers: dict[str, set[str]] = {}
    for name, deps in graph.items():
        layers.setdefault(node(name), set()).update(node(d) for d in deps if node(d) != node(name))
    assert code_shape.cycles(layers) == []
    # (Every other module is checked too: the engine choice's own circle is the only one allowed.)
    assert [sorted(c) for c in code_shape.cycles(graph)] in ([], [sorted(ENGINE_CHOICE)])


def test_the_router_and_the_lifecycle_are_at_the_top() -> None:
    graph = core_graph()
    for top, allowed in TOP.items():
        importers = {name for name, deps in graph.items() if top in deps}
        assert importers <= allowed, (top, importers - allowed)


def test_only_the_lifecycle_and_the_router_fire_and_no_part_is_connected_later() -> None:
    fires: set[str] = set()
    connects: list[str] = []
    for name, path in core_modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "fire":
                fires.add(name)
            if isinstance(call, ast.FunctionDef) and call.name == "connect":
                connects.append(name)
    assert fires == FIRES
    assert connects == []


#: Inputs the router's own dispatch fires for every request at once (shutdown's grace ran out).
_BROADCAST = frozenset({Input.ABANDON})


class FireWatch:
    """Records every ``fire`` that runs inside another request's handler, or for another request too early."""

    def __init__(self) -> None:
        #: The requests whose handlers are running, innermost last.
        self.stack: list[Any] = []
        #: The request the current event (or timer) is about: the first one fired for it.
        self.owner: Any = None
        #: Inside the drain of the follow-up queue.
        self.draining = 0
        self.nested: list[tuple[str, str, str]] = []
        self.early: list[tuple[str, str, str]] = []
        self.fires = 0

    def new_event(self) -> None:
        self.owner = None

    @contextmanager
    def patched(self) -> Iterator[FireWatch]:
        compiled = {} if corebuild.pure_requested() else corebuild.compiled_files()
        if {"narwhal_core.lifecycle", "narwhal_core.router"} & set(compiled):
            # Compiled callers call fire natively: a patch would see nothing.
            # test_core_builds reruns this file on the pure core.
            pytest.skip("the compiled core's lifecycle cannot be watched")
        watch = self
        fire, follow_up, drain = Lifecycle.fire, Router._follow_up_one, Router._follow_up
        receive, pop_due = Router.receive, Timers.pop_due

        def watched_fire(lifecycle: Lifecycle, req: Any, event: Input, data: Any = None) -> None:
            watch.fires += 1
            for outer in watch.stack:
                if outer is not req:
                    watch.nested.append((outer.rid, req.rid, event.value))
            if not watch.draining and not watch.stack and event not in _BROADCAST:
                if watch.owner is None:
                    watch.owner = req
                elif watch.owner is not req:
                    watch.early.append((watch.owner.rid, req.rid, event.value))
            watch.stack.append(req)
            try:
                fire(lifecycle, req, event, data)
            finally:
                watch.stack.pop()

        def watched_follow_up(router: Router, work: Any) -> None:
            assert not watch.stack, f"follow-up {work} ran inside a handler of {watch.stack[-1].rid}"
            watch.draining += 1
            try:
                follow_up(router, work)
            finally:
                watch.draining -= 1

        def watched_drain(router: Router) -> None:
            watch.draining += 1
            try:
                drain(router)
            finally:
                watch.draining -= 1

        def watched_receive(router: Router, event: Any, *, now: float) -> None:
            watch.new_event()
            receive(router, event, now=now)

        def watched_pop_due(timers: Timers, now: float) -> Any:
            watch.new_event()  # each timer is an event of its own
            return pop_due(timers, now)

        try:
            Lifecycle.fire = watched_fire  # type: ignore[method-assign]
        except TypeError:  # a compiled (mypyc) class: the pure rerun of test_core_builds runs this
            pytest.skip("the compiled core's lifecycle cannot be watched")
        Router._follow_up_one = watched_follow_up  # type: ignore[method-assign]
        Router._follow_up = watched_drain  # type: ignore[method-assign]
        Router.receive = watched_receive  # type: ignore[method-assign]
        Timers.pop_due = watched_pop_due  # type: ignore[method-assign]
        try:
            yield self
        finally:
            Lifecycle.fire, Router._follow_up_one, Router._follow_up = fire, follow_up, drain  # type: ignore[method-assign]
            Router.receive, Timers.pop_due = receive, pop_due  # type: ignore[method-assign]


def shared_names(named: dict[str, list[str]]) -> dict[str, list[str]]:
    return {name: places for name, places in sorted(named.items()) if len(places) > 1}


def test_no_two_core_classes_share_a_name() -> None:
    """Each class of the core (its http package too, private ones included) has a name of its own (docs/design.md)."""
    classes: dict[str, list[str]] = {}
    for module, path in core_modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(module)
    assert shared_names(classes) == {}


def test_no_two_modules_of_the_core_and_the_runtime_share_a_name() -> None:
    """A module's name says what it holds: none is used twice across narwhal_core and narwhal_runtime."""
    basenames: dict[str, list[str]] = {}
    for module, path in code_shape.modules(REPO, ("narwhal_core", "narwhal_runtime")):
        if path.name != "__init__.py":
            basenames.setdefault(path.stem, []).append(module)
    assert shared_names(basenames) == {}


def test_a_freed_decode_slot_wakes_its_waiter_after_the_request_whose_leg_ended() -> None:
    # One engine of each phase, one slot each: the waiter's prefill is done and
    # it waits for the holder's decode slot, the newcomer waits behind it. The
    # holder's answer ends its leg: its own LEG_OK runs first, then the queue
    # wakes the waiter, then the newcomer's prefill (before, the waiter's WAKE
    # ran before the holder's own LEG_OK).
    d = Driver(prefill=PREFILL_URLS[:1], decode=DECODE_URLS[:1], engine={"max_inflight_per_engine": 1})
    with FireWatch().patched() as watch:
        holder = d.post(COMPLETIONS, completion_body(prompt="holder"))
        d.answer_prefill(d.leg("prefill").bid)
        holding = d.leg("decode").bid
        waiter = d.post(COMPLETIONS, completion_body(prompt="waiter"))
        d.answer_prefill(d.leg("prefill").bid)
        newcomer = d.post(COMPLETIONS, completion_body(prompt="newcomer"))
        d.answer_decode(holding)
        assert holder.last.status == 200
        started = [leg.phase + ":" + leg.rid for leg in d.open_legs()]
        assert started == [f"decode:{d.issued[1]}", f"prefill:{d.issued[2]}"]
        d.answer_decode(d.leg("decode").bid)
        d.answer_prefill(d.leg("prefill").bid)
        d.answer_decode(d.leg("decode").bid)
    assert waiter.last.status == 200 and newcomer.last.status == 200
    assert watch.fires >= 9
    assert watch.early == [] and watch.nested == []


class TreeMachine(RouterMachine):
    """The router state machine, with the lifecycle's ``fire`` watched."""


TreeMachine.TestCase.settings = settings(RouterMachine.TestCase.settings, max_examples=25)


class TestFollowUpsOnlyFromTheQueue(TreeMachine.TestCase):  # type: ignore[misc,valid-type]
    """Every ``receive`` and ``handle_deadline`` of the walk: no nested or early fire for another request."""

    def runTest(self) -> None:
        watch = FireWatch()
        with watch.patched():
            super().runTest()
        assert watch.fires > 0
        assert watch.nested == [], watch.nested[:5]
        assert watch.early == [], watch.early[:5]
