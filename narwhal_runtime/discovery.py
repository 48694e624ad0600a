"""Engine discovery's I/O: looking the engines up, by DNS or in a file (docs/configure.md, ``[discovery]``).

The core keeps the fleet; it hears what discovery found as
:class:`~narwhal_core.EnginesChanged`, one per phase whose set changed
(docs/operate.md, "Engines that come and go"). This module does the
looking: a blocking lookup (:func:`dns_lookup`, :func:`file_lookup`) that
an adapter runs in a worker thread every ``discovery.interval_s``, through
:meth:`Discovery.run` and the same small awaitable hooks it gives the
journal (``sleep``, ``in_thread``), so both runtimes run it alike.

A failed lookup (a DNS timeout, SERVFAIL, an unreadable or malformed file)
keeps the last set: one ``discovery_failed`` log line, then
``discovery_recovered`` once a lookup succeeds again. A name that does not
exist (NXDOMAIN) or has no records is an answer: no engines of that phase.
"""

from __future__ import annotations

import json
import os
import socket
import tomllib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from narwhal_core import Config, EngineAddress, EnginesChanged, Event
from narwhal_core.addresses import bracketed, split_host_port
from narwhal_core.config import parse_engine_url
from narwhal_core.errors import ConfigError

from .log import log_event

__all__ = ["Discovery", "DiscoveryFailed", "Found", "dns_lookup", "file_lookup", "make_discovery", "PHASES"]

PHASES: Final = ("prefill", "decode")
#: What a lookup found: each phase's engines, in a stable order.
Found = Mapping[str, tuple[EngineAddress, ...]]
#: Longest a single DNS lookup may take, whatever the interval.
DNS_TIMEOUT_S: Final = 2.0


class DiscoveryFailed(Exception):
    """A lookup failed: the last set stays. The message says why, for the log."""


def _address(host: str, port: int, key: str) -> EngineAddress:
    return parse_engine_url(f"http://{bracketed(host)}:{port}", key=key)


def _sorted(addresses: set[EngineAddress]) -> tuple[EngineAddress, ...]:
    return tuple(sorted(addresses, key=lambda a: a.url))


# ------------------------------------------------------------------------ dns


def dns_lookup(config: Config) -> Callable[[], Found]:
    """A blocking lookup of ``discovery.prefill`` and ``discovery.decode``, as ``discovery.record`` says."""
    import dns.exception  # noqa: PLC0415 - only with engine.discovery = "dns"
    import dns.resolver  # noqa: PLC0415

    d = config.discovery
    names = {"prefill": d.prefill, "decode": d.decode}
    timeout = min(DNS_TIMEOUT_S, d.interval_s)
    resolver: Any = None
    if d.nameserver is not None:
        host, port = split_host_port(d.nameserver, min_port=1)
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = [host]
        resolver.port = port
        resolver.lifetime = timeout

    def records(name: str, rdtype: str) -> list[Any]:
        """The name's records of ``rdtype``; none if the name or the type does not exist there."""
        nonlocal resolver
        if resolver is None:  # the system's resolver, read once (/etc/resolv.conf)
            resolver = dns.resolver.Resolver()
            resolver.lifetime = timeout
        try:
            return list(resolver.resolve(name, rdtype, search=False))
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except dns.exception.DNSException as exc:
            raise DiscoveryFailed(f"{name} {rdtype}: {type(exc).__name__}: {str(exc)[:200]}") from None

    def addresses(name: str) -> list[str]:
        if d.nameserver is None and d.record == "A":
            return system_addresses(name)
        return [r.address for r in records(name, "A")] + [r.address for r in records(name, "AAAA")]

    def lookup() -> Found:
        found: dict[str, tuple[EngineAddress, ...]] = {}
        for phase, name in names.items():
            if name is None:
                continue
            engines: set[EngineAddress] = set()
            key = f"discovery.{phase}"
            if d.record == "SRV":
                for srv in records(name, "SRV"):
                    target = srv.target.to_text(omit_final_dot=True)
                    for host in addresses(target):
                        engines.add(_address(host, srv.port, key))
            else:
                for host in addresses(name):
                    engines.add(_address(host, d.port, key))
            found[phase] = _sorted(engines)
        return found

    return lookup


def system_addresses(name: str) -> list[str]:
    """``getaddrinfo``: the system's resolver (``/etc/hosts`` included); a name it does not know has none."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return []
        raise DiscoveryFailed(f"{name}: {exc.strerror or exc}") from None
    return list(dict.fromkeys(str(info[4][0]).partition("%")[0] for info in infos))


# ----------------------------------------------------------------------- file


def parse_engine_file(text: str, *, json_file: bool) -> Found:
    """The ``prefill`` and ``decode`` URL lists of a discovery file; raises :class:`DiscoveryFailed`."""
    try:
        data = json.loads(text) if json_file else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise DiscoveryFailed(f"not valid {'JSON' if json_file else 'TOML'}: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise DiscoveryFailed("must hold an object with prefill and decode lists")
    unknown = set(data) - set(PHASES)
    if unknown:
        raise DiscoveryFailed(f"unknown key {sorted(unknown)[0]!r} (prefill and decode only)")
    found: dict[str, tuple[EngineAddress, ...]] = {}
    for phase in PHASES:
        urls = data.get(phase, [])
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise DiscoveryFailed(f"{phase} must be a list of http://HOST:PORT strings")
        engines: set[EngineAddress] = set()
        for i, url in enumerate(urls):
            try:
                engines.add(parse_engine_url(url, key=f"{phase}[{i}]"))
            except ConfigError as exc:
                raise DiscoveryFailed(str(exc)) from None
        found[phase] = _sorted(engines)
    return found


def file_lookup(config: Config) -> Callable[[], Found | None]:
    """A blocking look at ``discovery.file``: ``None`` when neither its mtime nor its content changed."""
    path = config.discovery.file
    assert path is not None  # (the config requires it with engine.discovery = "file")
    json_file = path.lower().endswith(".json")
    last: list[Any] = [None, None]  # (mtime_ns, size), content

    def lookup() -> Found | None:
        try:
            stat = os.stat(path)
            if last[0] == (stat.st_mtime_ns, stat.st_size):
                return None
            with open(path, "rb") as f:
                content = f.read(1 << 20)
        except OSError as exc:
            raise DiscoveryFailed(f"{path}: {exc.strerror or exc}") from None
        if content == last[1]:
            last[0] = (stat.st_mtime_ns, stat.st_size)
            return None
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError:
            raise DiscoveryFailed(f"{path}: not UTF-8 text") from None
        found = parse_engine_file(text, json_file=json_file)
        # Only a good read is remembered: a bad file is read again (its failure logged once) until it is fixed.
        last[0], last[1] = (stat.st_mtime_ns, stat.st_size), content
        return found

    return lookup


# ------------------------------------------------------------------ the loop


class Discovery:
    """Runs a lookup every ``discovery.interval_s`` and feeds the router what changed."""

    def __init__(self, source: str, lookup: Callable[[], Found | None], interval: float) -> None:
        self.source = source
        self.lookup = lookup
        self.interval = interval
        #: The URLs of each phase the router was last told.
        self.known: dict[str, tuple[str, ...]] = {}
        #: The last lookup failed (logged once until one succeeds).
        self.failing = False
        #: Lookups so far, and those that failed (tests read them).
        self.lookups = 0
        self.failures = 0

    def changes(self, found: Found) -> list[EnginesChanged]:
        """The events for the phases whose set differs from what the router was told."""
        events = []
        for phase in PHASES:
            engines = found.get(phase)
            if engines is None:
                continue
            urls = tuple(a.url for a in engines)
            if self.known.get(phase) != urls:
                self.known[phase] = urls
                events.append(EnginesChanged(phase, tuple(engines), self.source))
        return events

    def take(self, outcome: Found | None | DiscoveryFailed) -> list[EnginesChanged]:
        """One lookup's outcome: the events to feed; a failure is logged once."""
        self.lookups += 1
        if isinstance(outcome, DiscoveryFailed):
            self.failures += 1
            if not self.failing:
                self.failing = True
                log_event("discovery_failed", level="warning", source=self.source, error=str(outcome),
                          consequence="the engines found last are kept")
            return []
        if self.failing:
            self.failing = False
            log_event("discovery_recovered", source=self.source)
        return [] if outcome is None else self.changes(outcome)

    async def run(
        self, feed: Callable[[Event], object], sleep: Callable[[float], Awaitable[object]],
        in_thread: Callable[[Callable[[], Any]], Awaitable[Any]],
    ) -> None:
        """Look up, feed what changed, wait; until cancelled."""
        lookup = self.lookup

        def attempt() -> Found | None | DiscoveryFailed:
            try:
                return lookup()
            except DiscoveryFailed as exc:
                return exc
            except Exception as exc:  # noqa: BLE001 - a lookup's surprise is a failed lookup, never a dead task
                return DiscoveryFailed(f"{type(exc).__name__}: {exc}")

        while True:
            for event in self.take(await in_thread(attempt)):
                result = feed(event)
                if isinstance(result, Awaitable):
                    await result
            await sleep(self.interval)


def make_discovery(config: Config) -> Discovery | None:
    """The discovery ``engine.discovery`` asks for (``None``: static engines)."""
    mode = config.engine.discovery
    if mode == "dns":
        return Discovery("dns", dns_lookup(config), config.discovery.interval_s)
    if mode == "file":
        return Discovery("file", file_lookup(config), config.discovery.interval_s)
    return None
