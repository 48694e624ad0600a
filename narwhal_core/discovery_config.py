"""``[discovery]``: how ``engine.discovery`` finds the engines (docs/configure.md, "Engines that come and go").

``engine.discovery = "static"`` (the default): ``engine.prefill`` and
``engine.decode`` as written, for the life of the process, and this section
is not read. ``dns``: a name per phase re-resolved
every ``interval_s`` (A and AAAA records with ``port``, as a Kubernetes
headless Service answers, or SRV records that carry host and port). ``file``:
a TOML or JSON file listing the URLs, read again when it changes. The
looking up is I/O and runs in the runtime (``narwhal_runtime/discovery.py``);
the core hears the result as :class:`~narwhal_core.events.EnginesChanged`.
"""

from typing import ClassVar, Literal

import attrs

from .addresses import split_host_port
from .config_fields import count, doc, one_of, optional_string, seconds
from .errors import ConfigError

__all__ = ["DiscoveryConfig", "DiscoveryMode", "DnsRecord"]

DiscoveryMode = Literal["static", "dns", "file"]
DnsRecord = Literal["A", "SRV"]


def _dns_name(value: str) -> str | None:
    name = value.rstrip(".")
    if not name or len(name) > 253 or any(not label or len(label) > 63 for label in name.split(".")):
        return f"must be a DNS name, got {value!r}"
    if not all(ch.isalnum() or ch in "-_." for ch in name):
        return f"must be a DNS name (letters, digits, '-', '_', '.'), got {value!r}"
    return None


def _nameserver(value: str) -> str | None:
    try:
        split_host_port(value, min_port=1)
    except ValueError as exc:
        return f"must be HOST:PORT of a DNS server ({exc}), got {value!r}"
    return None


def _path(value: str) -> str | None:
    return None if value and "\x00" not in value else f"must be a file path, got {value!r}"


@attrs.frozen(kw_only=True)
class DiscoveryConfig:
    """``[discovery]``: the names (dns) or the file (file) ``engine.discovery`` finds the engines with."""

    SECTION: ClassVar[str] = "discovery"

    prefill: str | None = attrs.field(
        default=None,
        validator=optional_string(_dns_name),
        metadata=doc('With engine.discovery = "dns": the DNS name of the prefill engines (none: single-leg on the decode pool).'),
    )
    decode: str | None = attrs.field(
        default=None,
        validator=optional_string(_dns_name),
        metadata=doc('With engine.discovery = "dns": the DNS name of the decode engines (required).'),
    )
    record: DnsRecord = attrs.field(
        default="A",
        validator=one_of(DnsRecord),
        metadata=doc("A (A and AAAA records, each engine on discovery.port) or SRV (host and port in the record)."),
    )
    port: int = count(8000, 'The engines\' port with record = "A".', minimum=1, maximum=65535)
    interval_s: float = seconds(5.0, "Time between two lookups (dns) or two looks at the file (file).")
    nameserver: str | None = attrs.field(
        default=None,
        validator=optional_string(_nameserver),
        metadata=doc("HOST:PORT of the DNS server to ask (none: the system's resolver)."),
    )
    file: str | None = attrs.field(
        default=None,
        validator=optional_string(_path),
        metadata=doc('With engine.discovery = "file": a TOML or JSON file with prefill and decode lists of http://HOST:PORT URLs.'),
    )

    def check(self, mode: str) -> None:
        """What ``engine.discovery = mode`` needs of this section; raises ConfigError."""
        if mode == "dns" and self.decode is None:
            raise ConfigError("discovery.decode", 'is required with engine.discovery = "dns"')
        if mode == "file" and self.file is None:
            raise ConfigError("discovery.file", 'is required with engine.discovery = "file"')

    def may_prefill(self, mode: str) -> bool:
        """Whether prefill engines may be found with ``engine.discovery = mode`` (so requests may be disaggregated)."""
        return mode == "file" or (mode == "dns" and self.prefill is not None)
