"""The connection slots (narwhal_runtime/slots.py): ``ingress.max_connections`` held, waited for, refused."""

from __future__ import annotations

from narwhal_runtime.slots import Admission, ConnectionSlots


def test_connections_over_the_limit_wait_then_are_refused() -> None:
    slots: ConnectionSlots[str] = ConnectionSlots(2)
    assert [slots.arrive(c) for c in "abcdef"] == [
        Admission.ADMITTED, Admission.ADMITTED, Admission.WAITING, Admission.WAITING,
        Admission.REFUSED, Admission.REFUSED,
    ]
    assert slots.holders == {"a", "b"} and list(slots.waiting) == ["c", "d"]


def test_a_freed_slot_goes_to_the_connection_that_waited_longest() -> None:
    slots: ConnectionSlots[str] = ConnectionSlots(1)
    for c in "abc":
        slots.arrive(c)
    assert slots.next_waiting() is None  # no slot free
    slots.release("a")
    assert slots.next_waiting() == "b" and slots.holders == {"b"}
    assert slots.next_waiting() is None
    slots.withdraw("c")  # lost while waiting
    slots.release("b")
    assert slots.next_waiting() is None and not slots.holders


def test_at_shutdown_the_waiting_connections_are_dropped() -> None:
    slots: ConnectionSlots[str] = ConnectionSlots(1)
    for c in "abc":
        slots.arrive(c)
    assert slots.drop_waiting() == ["b"] and not slots.waiting  # "c" was refused: one waits per slot
    slots.withdraw("b")  # lost afterwards: nothing to do
    assert slots.holders == {"a"}
