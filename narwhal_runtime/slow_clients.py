"""Slow clients: the one rule both runtimes follow for bytes a client does not take (docs/operate.md).

Bytes Narwhal wrote to a client that the kernel has not taken yet are
*unsent*. They wait in the adapter: on trio in the writer task's queue, on
asyncio and uvloop in the transport's write buffer. (The kernel itself
takes little beyond what is in flight: ``TCP_NOTSENT_LOWAT``,
:mod:`narwhal_runtime.socket_options`.) For them, on every runtime:

* **Backpressure.** A client more than
  :data:`~narwhal_runtime.driver.HIGH_WATER` unsent behind is *held*: the
  engine legs relaying to it are not read, their time limits do not run
  (``ClientStalled``), until the kernel has taken every unsent byte.
* **The send timeout.** While a client has unsent bytes it must take some
  of them: one that takes none for ``ingress.send_timeout_s`` is dropped
  (its connection is aborted; the router hears it is gone, so a request
  still running ends ``cancelled``, 499 ``client_disconnected``), however
  few the bytes are, whether its answer is still running, whole, or
  followed by Narwhal's close. A client that reads slowly but reads is not
  dropped by this rule (the request deadline still bounds a request).

How each runtime sees the bytes leave differs, not the rule. trio's writer
task sends them itself and sees each byte the kernel takes: it drops the
client exactly ``send_timeout_s`` after the last one. asyncio's and
uvloop's transports send on their own and tell nothing until their buffer
is empty, so the adapter looks at how many are left (:class:`SendWatch`)
every ``send_timeout_s / LOOKS``, from the first write that leaves bytes
unsent until none is: it drops a client between ``send_timeout_s`` and
``send_timeout_s × (1 + 1/LOOKS)`` after the last byte taken. The cost: one
look at the transport's buffer size per write, and a timer per
``send_timeout_s / LOOKS`` only while a client has unsent bytes.

Either runtime says why it drops a client in the same one log line
(:func:`log_send_timeout`).
"""

from __future__ import annotations

from typing import Literal

from .log import log_event

__all__ = ["SendWatch", "LOOKS", "log_send_timeout"]

#: Looks per ``send_timeout_s`` at a client's unsent bytes (asyncio, uvloop).
LOOKS = 4


class SendWatch:
    """A client's unsent bytes, for a runtime that only sees how many are left when it looks.

    Start one when a write leaves bytes unsent (``unsent``: how many are);
    tell it of each later write (:meth:`wrote`); every ``send_timeout_s /
    LOOKS`` tell it how many are left (:meth:`look`). The kernel took some
    since the last look when fewer are left than were, plus those written
    since.
    """

    __slots__ = ("unsent", "written", "idle_looks")

    def __init__(self, unsent: int) -> None:
        #: Unsent bytes at the last look (at the start: the write's).
        self.unsent = unsent
        #: Bytes written since the last look.
        self.written = 0
        #: Looks in a row that found none taken.
        self.idle_looks = 0

    def wrote(self, size: int) -> None:
        """``size`` more bytes were written to the client."""
        self.written += size

    def look(self, unsent: int) -> Literal["again", "drop", "done"]:
        """``unsent`` bytes are left: look again later, drop the client, or stop watching (none is left)."""
        if not unsent:
            return "done"
        if unsent < self.unsent + self.written:
            self.idle_looks = 0
        else:
            self.idle_looks += 1
            if self.idle_looks >= LOOKS:
                return "drop"  # none taken for LOOKS looks: send_timeout_s
        self.unsent = unsent
        self.written = 0
        return "again"


def log_send_timeout(send_timeout_s: float, unsent: int) -> None:
    """A client is dropped by the send timeout, ``unsent`` bytes still waiting for it: one ``client_send_timeout`` line.

    What an operator needs to see why the connection was cut, and nothing of
    the client's request or answer.
    """
    log_event("client_send_timeout", level="warning", send_timeout_s=send_timeout_s, unsent_bytes=unsent,
              consequence="connection aborted")
