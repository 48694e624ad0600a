"""Slow clients: the one rule both runtimes follow for bytes a client does not take (docs/operate.md).

Bytes Narwhal wrote to a client that the kernel has not taken yet are
*unsent*. They wait in the client connection's queue
(:mod:`narwhal_runtime.client_connections`). (The kernel itself
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

Both runtimes run the same client connection
(:class:`~narwhal_runtime.client_connections.ClientConnection`), which
sends the bytes itself and sees each byte the kernel takes: it drops a
client ``send_timeout_s`` after the last one (a timer started with the
first unsent byte, moved on when it finds some taken), and holds it back
itself: neither it nor the legs relaying to it are read while it is held.
Either runtime says why it drops a client in the same one log line
(:func:`log_send_timeout`).
"""

from __future__ import annotations

from .log import log_event

__all__ = ["log_send_timeout"]


def log_send_timeout(send_timeout_s: float, unsent: int) -> None:
    """A client is dropped by the send timeout, ``unsent`` bytes still waiting for it: one ``client_send_timeout`` line.

    What an operator needs to see why the connection was cut, and nothing of
    the client's request or answer.
    """
    log_event("client_send_timeout", level="warning", send_timeout_s=send_timeout_s, unsent_bytes=unsent,
              consequence="connection aborted")
