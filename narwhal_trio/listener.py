"""Listening on trio: the shared :class:`~narwhal_runtime.listening.Listener`, with trio's waits.

Each listening socket is accepted from by a task of one nursery; cancelling
that nursery stops accepting.
"""

from __future__ import annotations

from typing import Any

import trio

from narwhal_runtime.listening import Listener, StartClient

from .engines import Waits

__all__ = ["listener", "serve"]


class _Waits(Waits):
    """trio's socket waits, with an event, a sleep and its clock (:class:`~narwhal_runtime.listening.AcceptWaits`)."""

    event = staticmethod(trio.Event)
    checkpoint = staticmethod(trio.lowlevel.checkpoint)
    sleep_until = staticmethod(trio.sleep_until)
    now = staticmethod(trio.current_time)


def listener(sockets: list[Any], *, limit: int) -> Listener:
    """A listener over ``sockets`` with ``limit`` connection slots, waiting trio's way."""
    return Listener(sockets, limit=limit, waits=_Waits())


async def serve(listener: Listener, start_client: StartClient, task_status: Any) -> None:
    """Accept until cancelled (``task_status.started`` gets the cancel scope), then close the sockets."""
    try:
        async with trio.open_nursery() as accepting:
            for sock in listener.sockets:
                accepting.start_soon(listener.accept, sock, start_client)
            task_status.started(accepting.cancel_scope)
    finally:
        listener.close()
