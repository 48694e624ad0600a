"""benchmarks/read_shapes.py: every shape it times really makes its round trips."""

from __future__ import annotations

from . import load_benchmark


def test_every_shape_makes_each_round_trip_it_is_timed_for() -> None:
    read_shapes = load_benchmark("read_shapes")
    rows = read_shapes.measure(rounds=50, repeats=1)
    names = [name for name, _, _ in rows]
    assert {"asyncio protocol", "asyncio reader", "asyncio task", "trio task"} <= set(names)
    assert all(trips == 50 and spent >= 0 for _, spent, trips in rows), rows
