"""The router's timer heap (``narwhal_core/timers.py``): order, cancellation, compaction."""

from __future__ import annotations

from narwhal_core.timers import Timer, Timers


def test_timers_fire_in_time_order_then_in_arming_order() -> None:
    timers = Timers()
    fired: list[str] = []
    for when, name in ((2.0, "b"), (1.0, "a"), (2.0, "c"), (3.0, "d")):
        timers.arm(when, fired.append, name)
    assert timers.deadline() == 1.0
    while (timer := timers.pop_due(2.0)) is not None:
        timer.action(timer.owner)
    assert fired == ["a", "b", "c"]
    assert timers.deadline() == 3.0


def test_a_cancelled_timer_never_fires_and_drops_its_owner() -> None:
    timers = Timers()
    owner = object()
    first = timers.arm(1.0, lambda _: None, owner)
    second = timers.arm(2.0, lambda _: None, "second")
    first.cancel()
    assert first.cancelled and first.owner is None and not second.cancelled
    assert timers.deadline() == 2.0  # the cancelled head is skipped
    assert timers.pop_due(5.0) is second
    assert timers.pop_due(5.0) is None
    assert timers.deadline() is None


def test_an_action_may_arm_a_timer_already_due() -> None:
    timers = Timers()
    fired: list[str] = []

    def again(name: str) -> None:
        fired.append(name)
        if name == "first":
            timers.arm(0.5, fired.append, "due at once")

    timers.arm(1.0, again, "first")
    while (timer := timers.pop_due(1.0)) is not None:
        timer.action(timer.owner)
    assert fired == ["first", "due at once"]


def test_cancelled_timers_are_compacted_away() -> None:
    timers = Timers()
    armed: list[Timer] = [timers.arm(float(i), lambda _: None, i + 1) for i in range(4096)]
    for timer in armed[:4090]:
        timer.cancel()
    timers.arm(10_000.0, lambda _: None, "last")  # past the bound: the heap drops what is cancelled
    assert len(timers) == 7
    assert timers.deadline() == 4090.0
