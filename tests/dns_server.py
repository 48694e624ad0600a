"""A small authoritative DNS server on loopback, for the discovery tests (docs/configure.md, ``[discovery]``).

Built on ``dnslib``: it answers A, AAAA and SRV questions over UDP from a
table the test changes while Narwhal runs (:meth:`DnsServer.set`), answers
NXDOMAIN for names it does not know, and can be made to fail
(:attr:`DnsServer.failing`: SERVFAIL) to play a DNS hiccup.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from dnslib import AAAA, QTYPE, RCODE, RR, SRV, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer

__all__ = ["DnsServer"]

TTL = 1


class _Table(BaseResolver):  # type: ignore[misc]
    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: name (no final dot, lowercase) -> records: ("A", "127.0.0.2") or ("SRV", (port, target)).
        self.records: dict[str, list[tuple[str, Any]]] = {}
        self.failing = False
        self.questions = 0

    def resolve(self, request: Any, handler: Any) -> Any:
        reply = request.reply()
        qname = request.q.qname
        name = str(qname).rstrip(".").lower()
        qtype = QTYPE[request.q.qtype]
        with self.lock:
            self.questions += 1
            if self.failing:
                reply.header.rcode = RCODE.SERVFAIL
                return reply
            records = self.records.get(name)
        if records is None:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        for kind, value in records:
            if kind != qtype:
                continue
            if kind == "A":
                reply.add_answer(RR(qname, QTYPE.A, rdata=A(value), ttl=TTL))
            elif kind == "AAAA":
                reply.add_answer(RR(qname, QTYPE.AAAA, rdata=AAAA(value), ttl=TTL))
            else:
                port, target = value
                reply.add_answer(RR(qname, QTYPE.SRV, rdata=SRV(priority=0, weight=0, port=port, target=target), ttl=TTL))
        return reply


class DnsServer:
    """``with DnsServer() as dns: dns.set("decode.test", A=["127.0.0.2"])``; ``dns.nameserver`` is HOST:PORT."""

    def __init__(self) -> None:
        self.table = _Table()
        self._server = DNSServer(self.table, port=0, address="127.0.0.1", logger=DNSLogger("-request,-reply,-truncated,-error,-recv,-send,-data"))

    def __enter__(self) -> DnsServer:
        self._server.start_thread()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()
        self._server.server.server_close()

    @property
    def nameserver(self) -> str:
        host, port = self._server.server.server_address[:2]
        return f"{host}:{port}"

    def set(self, name: str, *, A: Iterable[str] = (), AAAA: Iterable[str] = (),  # noqa: N803
            SRV: Iterable[tuple[int, str]] = ()) -> None:  # noqa: N803
        """Replace every record of ``name`` (none at all: the name exists, with no records)."""
        records = [("A", a) for a in A] + [("AAAA", a) for a in AAAA] + [("SRV", s) for s in SRV]
        with self.table.lock:
            self.table.records[name.lower()] = records

    def remove(self, name: str) -> None:
        """Forget ``name``: NXDOMAIN from now on."""
        with self.table.lock:
            self.table.records.pop(name.lower(), None)

    @property
    def failing(self) -> bool:
        return self.table.failing

    @failing.setter
    def failing(self, value: bool) -> None:
        with self.table.lock:
            self.table.failing = value

    @property
    def questions(self) -> int:
        with self.table.lock:
            return self.table.questions
