"""Hosts, ports and networks as the configuration writes them (docs/configure.md).

Host names and IP addresses are compared in one canonical form
(:func:`normalize_host`: IPs compressed, names lowercased, IPv6 without
brackets), so that every spelling of one host counts as that host: the
listen address, the engines' URLs and ``engine.kv_hosts`` all go through it.
The ``check`` functions at the end are the string checks of the fields that
hold an address (they return a problem or None, like those of
:mod:`narwhal_core.config_fields`).
"""

import ipaddress
import re

from .config_fields import describe

__all__ = [
    "normalize_host",
    "split_host_port",
    "is_ip_address",
    "is_loopback_host",
    "names_loopback",
    "kv_network",
    "bracketed",
    "listen_address",
    "cidr",
    "kv_host",
]

_HOST_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"(?:{_HOST_LABEL})(?:\.{_HOST_LABEL})*\.?")
_DOTTED_NUMBERS = re.compile(r"[0-9.]+")


def normalize_host(text: str) -> str | None:
    """A host name or IP address in canonical form (IPs compressed, names lowercased), or None if invalid.

    IPv6 may be given with or without brackets; the result has none.
    """
    if text.startswith("[") and text.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(text[1:-1]))
        except ValueError:
            return None
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    # "10.0.0" is neither an address nor a sensible hostname.
    if len(text) > 253 or _DOTTED_NUMBERS.fullmatch(text) or not _HOSTNAME.fullmatch(text):
        return None
    return text.lower().rstrip(".")


def split_host_port(text: str, *, min_port: int) -> tuple[str, int]:
    """``HOST:PORT`` -> (normalised host without brackets, port); ValueError names the problem."""
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ValueError("has an unclosed [ in the IPv6 address")
        host_text, rest = text[: close + 1], text[close + 1 :]
        if not rest.startswith(":"):
            raise ValueError("must name a port after the IPv6 address, as in [::1]:8000")
        port_text = rest[1:]
    else:
        host_text, colon, port_text = text.rpartition(":")
        if not colon:
            raise ValueError("must name a port (HOST:PORT)")
        if ":" in host_text:
            raise ValueError("must put an IPv6 address in brackets, as in [::1]:8000")
    if not host_text:
        raise ValueError("must name a host before the port")
    host = normalize_host(host_text)
    if host is None:
        raise ValueError(f"names an invalid host {describe(host_text)}")
    if not port_text.isascii() or not port_text.isdigit() or len(port_text) > 5:
        raise ValueError(f"has an invalid port {describe(port_text)}")
    port = int(port_text)
    if not min_port <= port <= 65535:
        raise ValueError(f"port must be between {min_port} and 65535")
    return host, port


def is_ip_address(host: str) -> bool:
    """Whether ``host`` is an IP address rather than a name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_loopback_host(host: str) -> bool:
    """Whether a host in canonical form is this machine's loopback: ``localhost``, 127.0.0.0/8 or ``::1``.

    These all name one host, the machine itself (docs/configure.md, ``engine.kv_hosts``).
    Other spellings (IPv4-mapped, integer or octal forms) are not canonical and are not counted.
    """
    if host == "localhost":
        return True
    if host.startswith("127.") or host == "::1":
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False
    return False


def kv_network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """A ``kv_hosts`` entry in CIDR form (``10.244.0.0/16``), or None if it is not one."""
    if "/" not in text:
        return None
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None


def bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def names_loopback(host: str) -> bool:
    """Whether ``host``, in any spelling an IP address may take (IPv4-mapped included), is the loopback."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


# -- checks on single strings (return a problem or None) ----------------------------


def listen_address(value: str) -> str | None:
    try:
        split_host_port(value, min_port=0)
    except ValueError as exc:
        return f"{exc}: must be HOST:PORT (IPv6 as [::1]:8000), got {describe(value)}"
    return None


def cidr(value: str) -> str | None:
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        return f"must be an IP network in CIDR form (10.0.0.0/8, fd00::/8, 192.0.2.7), got {describe(value)}"
    return None


def kv_host(value: str) -> str | None:
    if normalize_host(value) is None and kv_network(value) is None:
        return (
            "must be a host name, an IP address or a network in CIDR form like 10.244.0.0/16 (no port), "
            f"got {describe(value)}"
        )
    return None
