"""The configuration model (docs/configure.md): typed, frozen, validated values.

A config is a tree of frozen attrs classes, one per TOML section. The rules a
value must obey live in the classes themselves (attrs validators and
``__attrs_post_init__``), so a config built in Python code is checked exactly
like one parsed from TOML, and every failure is one :class:`ConfigError`
naming the dotted key (``engine.decode[1]``, ``ingress.auth``).

Parsing is split in two:

* shape — a private cattrs converter turns the TOML tables into the classes,
  refusing unknown keys (``forbid_extra_keys``) and reporting missing required
  keys; its errors are walked to find the dotted path of the first problem;
* types and meaning — the attrs validators: integers refuse ``true`` and
  ``1.5``, strings refuse numbers, URLs must be ``http://HOST:PORT``...

The only check that needs the environment is ``engine.engine_api_key_env``:
:func:`validate` (run by :func:`parse_config` and :func:`config_from_dict`)
checks the variable is set, and :func:`engine_api_key` returns its value. The
credential itself is never stored in a :class:`Config`, so no repr, log line
or journal record can show it.

The adapter reads the file; this module only sees its text.
"""

import difflib
import ipaddress
import json
import math
import re
import tomllib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Final, Literal, cast, get_args

import attrs
import cattrs
from cattrs.errors import ForbiddenExtraKeysError
from cattrs.gen import make_dict_structure_fn

from .errors import ConfigError

__all__ = [
    "AuthMode",
    "KvRelease",
    "FsyncPolicy",
    "EngineAddress",
    "ModelConfig",
    "IngressConfig",
    "EngineConfig",
    "AdmissionConfig",
    "RetryConfig",
    "HealthConfig",
    "JournalConfig",
    "ShutdownConfig",
    "Config",
    "SECTIONS",
    "parse_config",
    "config_from_dict",
    "validate",
    "engine_api_key",
    "parse_engine_url",
    "normalize_host",
    "is_loopback_host",
    "is_ip_address",
]

AuthMode = Literal["none", "api_keys", "trusted_header"]
KvRelease = Literal["decode_pull", "abort_endpoint", "decode_abort", "lease"]
FsyncPolicy = Literal["always", "interval", "never"]

_Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


# -- describing values in messages -------------------------------------------------


def _describe(value: object) -> str:
    """A value as an operator would write it in TOML, short enough for one line."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        if len(value) > 60:
            value = value[:57] + "..."
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, Mapping):
        return "a table"
    return f"a {type(value).__name__}"


def _key(instance: object, attribute: "attrs.Attribute[Any]") -> str:
    section: str = getattr(type(instance), "SECTION")
    return f"{section}.{attribute.name}"


# -- field validators: types first, then ranges ------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(minimum: int, maximum: int | None = None) -> _Validator:
    def check(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        key = _key(instance, attribute)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(key, f"must be an integer, got {_describe(value)}")
        if maximum is not None and not minimum <= value <= maximum:
            raise ConfigError(key, f"must be between {minimum} and {maximum}, got {value}")
        if value < minimum:
            raise ConfigError(key, f"must be at least {minimum}, got {value}")

    return check


def _float_in(*, positive: bool) -> _Validator:
    def check(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        key = _key(instance, attribute)
        if not isinstance(value, float):
            raise ConfigError(key, f"must be a number, got {_describe(value)}")
        if not math.isfinite(value):
            raise ConfigError(key, f"must be a finite number, got {_describe(value)}")
        if positive and value <= 0:
            raise ConfigError(key, f"must be positive, got {value!r}")
        if value < 0:
            raise ConfigError(key, f"must not be negative, got {value!r}")

    return check


def _to_float(value: float) -> float:
    # TOML ``timeout = 5`` is an integer; a float field takes it. Anything else
    # (bools included) is left for the validator to refuse with a message.
    if _is_int(value):
        return float(value)
    return value


def _string(check: Callable[[str], str | None] | None = None) -> _Validator:
    """A string validator; ``check`` returns a problem or None."""

    def check_value(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        key = _key(instance, attribute)
        if not isinstance(value, str):
            raise ConfigError(key, f"must be a string, got {_describe(value)}")
        if check is not None:
            problem = check(value)
            if problem is not None:
                raise ConfigError(key, problem)

    return check_value


def _optional_string(check: Callable[[str], str | None]) -> _Validator:
    inner = _string(check)

    def check_value(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        if value is not None:
            inner(instance, attribute, value)

    return check_value


def _one_of(choices: object) -> _Validator:
    values: tuple[str, ...] = get_args(choices)
    listed = ", ".join(json.dumps(v) for v in values)

    def check(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        if not isinstance(value, str) or value not in values:
            raise ConfigError(_key(instance, attribute), f"must be one of {listed}, got {_describe(value)}")

    return check


def _as_str_tuple(value: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    # Lists become tuples so the value is truly immutable and hashable. A
    # non-list is passed through untouched for the validator to refuse with
    # the key's name (a TOML string must never become a tuple of characters).
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return cast("tuple[str, ...]", value)


def _str_list(
    check: Callable[[str], str | None] | None = None, *, non_empty: str | None = None
) -> _Validator:
    """A list-of-strings validator; ``check`` vets each element, ``non_empty`` is the message for []."""

    def check_value(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        key = _key(instance, attribute)
        if not isinstance(value, tuple):
            raise ConfigError(key, f"must be a list of strings, got {_describe(value)}")
        if non_empty is not None and not value:
            raise ConfigError(key, non_empty)
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise ConfigError(f"{key}[{i}]", f"must be a string, got {_describe(item)}")
            if check is not None:
                problem = check(item)
                if problem is not None:
                    raise ConfigError(f"{key}[{i}]", problem)

    return check_value


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


# Field constructors for the many plain numeric fields. The mypy attrs plugin
# sees ``x: int = _count(...)`` as a field with a default, which it is.


def _count(default: int, doc: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    return attrs.field(default=default, validator=_int_in(minimum, maximum), metadata=_doc(doc))


def _seconds(default: float, doc: str, *, positive: bool = True) -> float:
    return attrs.field(
        default=default, converter=_to_float, validator=_float_in(positive=positive), metadata=_doc(doc)
    )


# -- hosts, ports, URLs -------------------------------------------------------------

_HOST_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"(?:{_HOST_LABEL})(?:\.{_HOST_LABEL})*\.?")
_DOTTED_NUMBERS = re.compile(r"[0-9.]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HTTP_PATH = re.compile(r"/[\x21-\x7e]*")
_HTTP_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _normalize_host(text: str) -> str | None:
    """A host in canonical form (IPs compressed, names lowercased), or None if invalid.

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


def _split_host_port(text: str, *, min_port: int) -> tuple[str, int]:
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
    host = _normalize_host(host_text)
    if host is None:
        raise ValueError(f"names an invalid host {_describe(host_text)}")
    if not port_text.isascii() or not port_text.isdigit() or len(port_text) > 5:
        raise ValueError(f"has an invalid port {_describe(port_text)}")
    port = int(port_text)
    if not min_port <= port <= 65535:
        raise ValueError(f"port must be between {min_port} and 65535")
    return host, port


def normalize_host(text: str) -> str | None:
    """A host name or IP address in canonical form (IPs compressed, names lowercased), or None if invalid."""
    return _normalize_host(text)


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


def _kv_network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """A ``kv_hosts`` entry in CIDR form (``10.244.0.0/16``), or None if it is not one."""
    if "/" not in text:
        return None
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


@attrs.frozen(kw_only=True)
class EngineAddress:
    """Where one engine listens, parsed from its ``http://HOST:PORT`` URL."""

    url: str = attrs.field(metadata=_doc("Normalised base URL, no trailing slash: http://10.0.0.5:8100."))
    host: str = attrs.field(metadata=_doc("Host to connect to; IPv6 without brackets, names lowercased."))
    port: int = attrs.field(metadata=_doc("TCP port, 1-65535."))
    authority: bytes = attrs.field(metadata=_doc("Value of the Host header: b'10.0.0.5:8100', b'[::1]:8100'."))


def parse_engine_url(url: str, *, key: str) -> EngineAddress:
    """Parse an engine URL ``http://HOST:PORT`` (a trailing ``/`` allowed), or raise ConfigError(key)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        raise ConfigError(key, f"must be an http://HOST:PORT URL, got {_describe(url)}")
    if scheme.lower() == "https":
        raise ConfigError(
            key, f"https:// is not supported yet (engines are reached over plain http://), got {_describe(url)}"
        )
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        # Never echo the URL: it carries credentials.
        raise ConfigError(key, "must not contain credentials; use engine.engine_api_key_env")
    if slash and path:
        raise ConfigError(
            key, f"must not have a path, query or fragment (http://HOST:PORT), got {_describe(url)}"
        )
    if "?" in authority or "#" in authority:
        raise ConfigError(key, f"must not have a query or fragment (http://HOST:PORT), got {_describe(url)}")
    try:
        host, port = _split_host_port(authority, min_port=1)
    except ValueError as exc:
        raise ConfigError(key, f"{exc} (http://HOST:PORT), got {_describe(url)}") from None
    authority_text = f"{_bracketed(host)}:{port}"
    return EngineAddress(
        url=f"http://{authority_text}", host=host, port=port, authority=authority_text.encode("ascii")
    )


# -- checks on single strings (return a problem or None) ----------------------------


def _non_empty(value: str) -> str | None:
    return "must not be empty" if not value else None


def _printable_path(value: str) -> str | None:
    if not _HTTP_PATH.fullmatch(value):
        return f"must be a path starting with / (printable ASCII, no spaces), got {_describe(value)}"
    return None


def _listen_address(value: str) -> str | None:
    try:
        _split_host_port(value, min_port=0)
    except ValueError as exc:
        return f"{exc}: must be HOST:PORT (IPv6 as [::1]:8000), got {_describe(value)}"
    return None


def _header_name(value: str) -> str | None:
    if not _HTTP_TOKEN.fullmatch(value):
        return f"must be an HTTP header name, got {_describe(value)}"
    return None


def _cidr(value: str) -> str | None:
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        return f"must be an IP network in CIDR form (10.0.0.0/8, fd00::/8, 192.0.2.7), got {_describe(value)}"
    return None


def _kv_host(value: str) -> str | None:
    if _normalize_host(value) is None and _kv_network(value) is None:
        return (
            "must be a host name, an IP address or a network in CIDR form like 10.244.0.0/16 (no port), "
            f"got {_describe(value)}"
        )
    return None


def _env_name(value: str) -> str | None:
    if not _ENV_NAME.fullmatch(value):
        return f"must be an environment variable name (letters, digits, _), got {_describe(value)}"
    return None


def _journal_path(value: str) -> str | None:
    if not value:
        return 'must not be empty (use "-" for stdout)'
    if "\x00" in value:
        return "must not contain NUL"
    return None


def _lower(value: str) -> str:
    return value.lower() if isinstance(value, str) else value


def _set_derived(instance: object, name: str, value: object) -> None:
    # Derived fields of a frozen class are computed once, at construction.
    object.__setattr__(instance, name, value)


# -- the sections -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ModelConfig:
    """``[model]``: the one model the fleet serves."""

    SECTION: ClassVar[str] = "model"

    name: str = attrs.field(
        validator=_string(_non_empty),
        metadata=_doc("Model name clients use and the name sent to the engines (required)."),
    )
    aliases: tuple[str, ...] = attrs.field(
        factory=tuple,
        converter=_as_str_tuple,
        validator=_str_list(_non_empty),
        metadata=_doc("Further names clients may use for the model."),
    )

    def __attrs_post_init__(self) -> None:
        seen = {self.name: "model.name"}
        for i, alias in enumerate(self.aliases):
            if alias in seen:
                raise ConfigError(f"model.aliases[{i}]", f"{_describe(alias)} repeats {seen[alias]}")
            seen[alias] = f"model.aliases[{i}]"


@attrs.frozen(kw_only=True)
class IngressConfig:
    """``[ingress]``: the client-facing listener, its authentication and limits."""

    SECTION: ClassVar[str] = "ingress"

    listen: str = attrs.field(
        default="127.0.0.1:8000",
        validator=_string(_listen_address),
        metadata=_doc("Address to listen on, HOST:PORT (IPv6 as [::1]:8000; port 0 picks a free port)."),
    )
    auth: AuthMode = attrs.field(
        default="none",
        validator=_one_of(AuthMode),
        metadata=_doc("Ingress authentication: none (loopback listen only), api_keys or trusted_header."),
    )
    api_keys_file: str | None = attrs.field(
        default=None,
        validator=_optional_string(_non_empty),
        metadata=_doc('TOML file of [[keys]] tables (client, sha256); required for auth = "api_keys".'),
    )
    client_header: str = attrs.field(
        default="x-narwhal-client",
        converter=_lower,
        validator=_string(_header_name),
        metadata=_doc('Header carrying the client ID for auth = "trusted_header" (stored lowercased).'),
    )
    trusted_proxies: tuple[str, ...] = attrs.field(
        factory=tuple,
        converter=_as_str_tuple,
        validator=_str_list(_cidr),
        metadata=_doc("CIDRs of the proxies allowed to name the client in client_header."),
    )
    max_body_bytes: int = _count(4194304, "Largest request body accepted; a larger one gets 413.", minimum=1)
    max_header_bytes: int = _count(16384, "Largest request header block accepted.", minimum=1)
    max_headers: int = _count(100, "Most header fields accepted in one request.", minimum=1)
    max_request_line_bytes: int = _count(8192, "Longest request line accepted.", minimum=1)
    header_timeout_s: float = _seconds(10.0, "Time a client has to send the whole request head.")
    body_timeout_s: float = _seconds(60.0, "Time a client has to send the whole request body.")
    keepalive_timeout_s: float = _seconds(75.0, "How long an idle keep-alive client connection stays open.")
    send_timeout_s: float = _seconds(
        30.0, "How long a client may leave written bytes unread before its connection is dropped."
    )
    max_connections: int = _count(20000, "Most client connections open at once.", minimum=1)
    max_buffered_bytes: int = _count(
        536870912,
        "Most bytes of unfinished requests held across all client connections; past it, the "
        "connection that grows the total gets 503 overloaded.",
        minimum=1,
    )
    max_batch_prompts: int = _count(
        8,
        "Most prompts one /v1/completions request may carry (a list of strings or of token-ID lists); each "
        "is served by its own prefill and decode legs, one prompt after another, and the answers are merged "
        "in prompt order. More get 400 with param prompt; 1 turns batches off (every list of two or more "
        "prompts gets that 400).",
        minimum=1,
        maximum=1024,
    )
    busy_poll_us: int = _count(
        0,
        "After each event the router is fed, keep the event loop polling for this many microseconds before "
        "it sleeps: less added latency at low load, for up to one busy core while traffic is sparse. 0 never polls.",
        minimum=0,
        maximum=1000000,
    )

    listen_host: str = attrs.field(init=False, eq=False, repr=False, metadata=_doc("Host part of listen."))
    listen_port: int = attrs.field(init=False, eq=False, repr=False, metadata=_doc("Port part of listen."))
    trusted_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = attrs.field(
        init=False, eq=False, repr=False, metadata=_doc("trusted_proxies, parsed.")
    )

    def __attrs_post_init__(self) -> None:
        host, port = _split_host_port(self.listen, min_port=0)  # validated above
        _set_derived(self, "listen_host", host)
        _set_derived(self, "listen_port", port)
        networks = tuple(ipaddress.ip_network(p, strict=False) for p in self.trusted_proxies)
        _set_derived(self, "trusted_networks", networks)
        # Without authentication Narwhal must not be reachable from elsewhere (docs/security.md).
        if self.auth == "none" and not _is_loopback(host):
            raise ConfigError(
                "ingress.auth", f'auth = "none" is only allowed on a loopback listen address, not {host}'
            )
        if self.max_buffered_bytes < self.max_body_bytes:
            raise ConfigError(
                "ingress.max_buffered_bytes",
                f"must be at least ingress.max_body_bytes ({self.max_body_bytes}), got {self.max_buffered_bytes}",
            )
        if self.auth == "api_keys" and self.api_keys_file is None:
            raise ConfigError("ingress.api_keys_file", 'is required when auth = "api_keys"')
        if self.auth == "trusted_header" and not networks:
            raise ConfigError(
                "ingress.trusted_proxies", 'auth = "trusted_header" needs at least one trusted proxy CIDR'
            )


@attrs.frozen(kw_only=True)
class EngineConfig:
    """``[engine]``: the prefill and decode pools and how legs reach them."""

    SECTION: ClassVar[str] = "engine"

    prefill: tuple[str, ...] = attrs.field(
        factory=tuple,
        converter=_as_str_tuple,
        validator=_str_list(),
        metadata=_doc("Prefill engine URLs, http://HOST:PORT; empty runs single-leg on the decode pool."),
    )
    decode: tuple[str, ...] = attrs.field(
        converter=_as_str_tuple,
        validator=_str_list(non_empty="must be a non-empty list of http:// URLs"),
        metadata=_doc("Decode engine URLs, http://HOST:PORT (required, non-empty)."),
    )
    engine_api_key_env: str | None = attrs.field(
        default=None,
        validator=_optional_string(_env_name),
        metadata=_doc(
            "Environment variable holding the engine credential, sent on every leg and control request."
        ),
    )
    kv_release: KvRelease = attrs.field(
        default="decode_pull",
        validator=_one_of(KvRelease),
        metadata=_doc(
            "How unpulled prefill KV is released: decode_pull (vLLM), abort_endpoint (engines that offer one, "
            "SGLang-style), decode_abort or lease."
        ),
    )
    abort_path: str = attrs.field(
        default="/abort_request",
        validator=_string(_printable_path),
        metadata=_doc('Prefill engine path for KV releases when kv_release = "abort_endpoint".'),
    )
    kv_lease_s: float = _seconds(
        30.0, "Seconds a prefill engine keeps unpulled KV (vLLM's kv_lease_duration); decode legs start well within it."
    )
    kv_hosts: tuple[str, ...] = attrs.field(
        factory=tuple,
        converter=_as_str_tuple,
        validator=_str_list(_kv_host),
        metadata=_doc(
            "Extra hosts (names, addresses, or networks in CIDR form) a prefill answer's remote_host may name "
            "besides the prefill engines' hosts and the addresses their names resolve to."
        ),
    )
    max_inflight_per_engine: int = _count(256, "Most legs running on one engine at once.", minimum=1)
    pool_connections_per_engine: int = _count(128, "Most pooled connections kept open to one engine.", minimum=1)
    connect_timeout_s: float = _seconds(2.0, "Time to open a connection to an engine.")
    prefill_timeout_s: float = _seconds(60.0, "Time for a whole prefill-leg answer.")
    decode_timeout_s: float = _seconds(
        600.0, "Time for a whole non-streaming decode answer, or for the first event of a stream."
    )
    stream_idle_timeout_s: float = _seconds(60.0, "Longest gap between two chunks of a streamed decode answer.")
    max_response_bytes: int = _count(67108864, "Largest engine response body accepted.", minimum=1)
    control_timeout_s: float = _seconds(5.0, "Time for a control request (KV release) to an engine.")

    prefill_engines: tuple[EngineAddress, ...] = attrs.field(
        init=False, eq=False, repr=False, metadata=_doc("prefill, parsed.")
    )
    decode_engines: tuple[EngineAddress, ...] = attrs.field(
        init=False, eq=False, repr=False, metadata=_doc("decode, parsed.")
    )
    allowed_kv_hosts: frozenset[str] = attrs.field(
        init=False, eq=False, repr=False, metadata=_doc("Prefill URL hosts plus kv_hosts, normalised.")
    )
    kv_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = attrs.field(
        init=False, eq=False, repr=False, metadata=_doc("The networks (CIDR) of kv_hosts.")
    )
    kv_loopback: bool = attrs.field(
        init=False, eq=False, repr=False,
        metadata=_doc("A prefill host or kv_hosts entry is loopback: every loopback name and address is allowed."),
    )

    def __attrs_post_init__(self) -> None:
        # A URL may be in both lists (a "mixed" engine serves both phases), but
        # not twice in one list: that would double its share of the load.
        pools: dict[str, tuple[EngineAddress, ...]] = {}
        for phase, urls in (("prefill", self.prefill), ("decode", self.decode)):
            seen: dict[str, int] = {}
            engines = []
            for i, url in enumerate(urls):
                key = f"engine.{phase}[{i}]"
                address = parse_engine_url(url, key=key)
                if address.url in seen:
                    raise ConfigError(key, f"{address.url} repeats engine.{phase}[{seen[address.url]}]")
                seen[address.url] = i
                engines.append(address)
            pools[phase] = tuple(engines)
        _set_derived(self, "prefill_engines", pools["prefill"])
        _set_derived(self, "decode_engines", pools["decode"])
        extra = {_normalize_host(h) for h in self.kv_hosts}
        hosts = {a.host for a in pools["prefill"]} | {h for h in extra if h is not None}
        _set_derived(self, "allowed_kv_hosts", frozenset(hosts))
        networks = (_kv_network(h) for h in self.kv_hosts if _normalize_host(h) is None)
        _set_derived(self, "kv_networks", tuple(n for n in networks if n is not None))
        _set_derived(self, "kv_loopback", any(is_loopback_host(h) for h in hosts))

    def kv_host_allowed(self, host: str) -> bool:
        """Whether a prefill answer's ``remote_host`` names a host of this fleet, as configured.

        Allowed: a prefill engine's host or a ``kv_hosts`` entry, in any
        spelling that normalises to it; any loopback name or address when one
        of those is loopback (they all name this machine); an address inside
        a ``kv_hosts`` network. (The addresses the engines' names resolve to
        are the fleet's to add: :meth:`narwhal_core.fleet.Fleet.kv_host_allowed`.)
        """
        if host in self.allowed_kv_hosts:
            return True  # already in normal form: the common case, without parsing
        normal = _normalize_host(host)
        if normal is None:
            return False
        if normal in self.allowed_kv_hosts or (self.kv_loopback and is_loopback_host(normal)):
            return True
        if self.kv_networks:
            try:
                address = ipaddress.ip_address(normal)
            except ValueError:
                return False
            return any(address in network for network in self.kv_networks)
        return False


@attrs.frozen(kw_only=True)
class AdmissionConfig:
    """``[admission]``: how many requests run and wait at once (docs/contract.md, "Admission, capacity and retries")."""

    SECTION: ClassVar[str] = "admission"

    max_inflight: int = _count(256, "Most requests admitted at once across the fleet.", minimum=1)
    queue_size: int = _count(1024, "Most requests waiting for admission (0 = no queue); beyond it, 503.")
    queue_timeout_s: float = _seconds(10.0, "Longest a request waits in the admission queue before 503.")
    request_timeout_s: float = _seconds(900.0, "Whole-request deadline, counted from ingress.")
    per_client_max_inflight: int = _count(0, "Most requests in flight per client (0 = unlimited); beyond it, 429.")
    retry_after_s: int = _count(1, "Seconds sent in Retry-After with 429 and 503 answers.")


@attrs.frozen(kw_only=True)
class RetryConfig:
    """``[retry]``: leg retries before any byte reached the client.

    (docs/contract.md, "Admission, capacity and retries".)
    """

    SECTION: ClassVar[str] = "retry"

    max_attempts: int = _count(3, "Attempts per phase, the first one included.", minimum=1, maximum=100)
    backoff_base_s: float = _seconds(
        0.05, "Delay before the first retry; doubles for each further one.", positive=False
    )
    backoff_max_s: float = _seconds(2.0, "Longest delay between two attempts.", positive=False)

    def __attrs_post_init__(self) -> None:
        if self.backoff_max_s < self.backoff_base_s:
            raise ConfigError(
                "retry.backoff_max_s",
                f"must be at least retry.backoff_base_s ({self.backoff_base_s!r}), got {self.backoff_max_s!r}",
            )


@attrs.frozen(kw_only=True)
class HealthConfig:
    """``[health]``: active probes and passive failure counting (docs/operate.md, "Engine health and rotation")."""

    SECTION: ClassVar[str] = "health"

    probe_interval_s: float = _seconds(5.0, "Time between two health probes of one engine.")
    probe_timeout_s: float = _seconds(2.0, "Time a health probe may take.")
    probe_path: str = attrs.field(
        default="/health",
        validator=_string(_printable_path),
        metadata=_doc("Path probed with GET (with the engine credential)."),
    )
    unhealthy_after: int = _count(
        3, "Consecutive failures (probes or legs) that take an engine out of rotation.", minimum=1
    )
    healthy_after: int = _count(2, "Consecutive successful probes that bring it back.", minimum=1)


@attrs.frozen(kw_only=True)
class JournalConfig:
    """``[journal]``: where request records go and how durably (docs/operate.md, "The journal")."""

    SECTION: ClassVar[str] = "journal"

    path: str = attrs.field(
        default="narwhal-journal.jsonl",
        validator=_string(_journal_path),
        metadata=_doc('JSON Lines file the records are appended to; "-" writes to stdout.'),
    )
    fsync: FsyncPolicy = attrs.field(
        default="interval",
        validator=_one_of(FsyncPolicy),
        metadata=_doc("When the file is fsynced: always (every record), interval or never."),
    )
    fsync_interval_s: float = _seconds(1.0, 'Time between fsyncs when fsync = "interval".')


@attrs.frozen(kw_only=True)
class ShutdownConfig:
    """``[shutdown]``: graceful stop on SIGTERM/SIGINT."""

    SECTION: ClassVar[str] = "shutdown"

    grace_s: float = _seconds(
        30.0, "Time in-flight requests get to finish before they are cancelled.", positive=False
    )


def _section(cls: type) -> _Validator:
    def check(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        if not isinstance(value, cls):
            raise ConfigError(attribute.name, f"must be a {cls.__name__}, got {_describe(value)}")

    return check


@attrs.frozen(kw_only=True)
class Config:
    """A whole Narwhal configuration. Build it in code or with :func:`parse_config`."""

    model: ModelConfig = attrs.field(validator=_section(ModelConfig), metadata=_doc("[model] section (required)."))
    ingress: IngressConfig = attrs.field(
        factory=IngressConfig, validator=_section(IngressConfig), metadata=_doc("[ingress] section.")
    )
    engine: EngineConfig = attrs.field(
        validator=_section(EngineConfig), metadata=_doc("[engine] section (required).")
    )
    admission: AdmissionConfig = attrs.field(
        factory=AdmissionConfig, validator=_section(AdmissionConfig), metadata=_doc("[admission] section.")
    )
    retry: RetryConfig = attrs.field(
        factory=RetryConfig, validator=_section(RetryConfig), metadata=_doc("[retry] section.")
    )
    health: HealthConfig = attrs.field(
        factory=HealthConfig, validator=_section(HealthConfig), metadata=_doc("[health] section.")
    )
    journal: JournalConfig = attrs.field(
        factory=JournalConfig, validator=_section(JournalConfig), metadata=_doc("[journal] section.")
    )
    shutdown: ShutdownConfig = attrs.field(
        factory=ShutdownConfig, validator=_section(ShutdownConfig), metadata=_doc("[shutdown] section.")
    )

    model_names: frozenset[str] = attrs.field(
        init=False, eq=False, repr=False, metadata=_doc("model.name and model.aliases: the names clients may use.")
    )

    def __attrs_post_init__(self) -> None:
        _set_derived(self, "model_names", frozenset((self.model.name, *self.model.aliases)))


#: Section name -> section class, in file order.
SECTIONS: Final[Mapping[str, type]] = MappingProxyType({
    "model": ModelConfig,
    "ingress": IngressConfig,
    "engine": EngineConfig,
    "admission": AdmissionConfig,
    "retry": RetryConfig,
    "health": HealthConfig,
    "journal": JournalConfig,
    "shutdown": ShutdownConfig,
})


# -- parsing ------------------------------------------------------------------------


class _NotATable(Exception):
    def __init__(self, value: object) -> None:
        super().__init__("not a table")
        self.value = value


def _make_converter() -> cattrs.Converter:
    # Private: hooks registered here must never leak into cattrs' global converter.
    converter = cattrs.Converter(forbid_extra_keys=True)

    def passthrough(value: object, _type: object) -> object:
        return value

    # cattrs owns the shape (tables, unknown and missing keys); leaf values pass
    # through unchanged so the attrs validators judge them, exactly as they do
    # for a config built in code. (cattrs' own hooks would turn "5" into 5 and
    # "abc" into ("a", "b", "c").)
    converter.register_structure_hook_factory(lambda t: not attrs.has(t), lambda _t: passthrough)
    # Primitives are dispatched directly, ahead of any factory: override them too.
    for primitive in (str, int, float, bool):
        converter.register_structure_hook(primitive, passthrough)

    def table_factory(cls: type) -> Callable[[object, object], object]:
        structure: Callable[[Mapping[str, object], Any], object] = make_dict_structure_fn(
            cls, converter, _cattrs_forbid_extra_keys=True
        )

        def structure_table(value: object, _type: object) -> object:
            if not isinstance(value, Mapping):
                raise _NotATable(value)
            return structure(value, cls)

        return structure_table

    converter.register_structure_hook_factory(attrs.has, table_factory)
    return converter




def _dotted(path: tuple[str | int, ...]) -> str:
    out = ""
    for step in path:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else step)
    return out


def _step(exc: BaseException) -> tuple[str | int, ...]:
    for note in getattr(exc, "__notes__", ()):
        if isinstance(note, cattrs.AttributeValidationNote):
            return (note.name,)
        if isinstance(note, cattrs.IterableValidationNote):
            return (note.index,)
    return ()


def _translate(exc: BaseException, path: tuple[str | int, ...]) -> ConfigError:
    """The first problem in a cattrs error tree, as one ConfigError with a dotted key."""
    if isinstance(exc, ConfigError):
        return exc  # an attrs validator: its key is already the full path
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            return _translate(sub, path + _step(sub))
    if isinstance(exc, ForbiddenExtraKeysError):
        name = min(exc.extra_fields)
        known = [a.name for a in attrs.fields(exc.cl) if a.init]
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return ConfigError(_dotted((*path, name)), f"unknown key{hint}")
    if isinstance(exc, KeyError) and path:
        what = "section" if len(path) == 1 else "key"
        return ConfigError(_dotted(path), f"missing required {what}")
    if isinstance(exc, _NotATable):
        return ConfigError(_dotted(path) or "config", f"must be a table, got {_describe(exc.value)}")
    return ConfigError(_dotted(path) or "config", f"invalid value ({type(exc).__name__}: {exc})")


def config_from_dict(data: Mapping[str, object], *, env: Mapping[str, str]) -> Config:
    """Build and validate a :class:`Config` from parsed TOML tables; raise one ConfigError."""
    try:
        # A converter of its own per call: cattrs fills a converter's hook caches as it goes, and
        # such a cache at module level would be state every router in the process shares.
        config = _make_converter().structure(data, Config)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one ConfigError
        raise _translate(exc, ()) from exc
    validate(config, env)
    return config


def parse_config(text: str, *, env: Mapping[str, str]) -> Config:
    """Parse the TOML text of a config file; raise one ConfigError naming the key."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("toml", str(exc)) from None
    return config_from_dict(data, env=env)


def validate(config: Config, env: Mapping[str, str]) -> None:
    """The checks that need the environment; the rest ran when ``config`` was built."""
    engine_api_key(config, env)


def engine_api_key(config: Config, env: Mapping[str, str]) -> str | None:
    """The engine credential named by ``engine.engine_api_key_env``, or None when unset.

    Raises ConfigError when the variable is missing, empty or unfit for an
    HTTP header; the message names the variable, never its value.
    """
    name = config.engine.engine_api_key_env
    if name is None:
        return None
    key = "engine.engine_api_key_env"
    value = env.get(name)
    if value is None:
        raise ConfigError(key, f"environment variable {name} is not set")
    if not value:
        raise ConfigError(key, f"environment variable {name} is empty")
    # It becomes "Authorization: Bearer <value>": no spaces, controls or non-ASCII.
    if not all("\x21" <= ch <= "\x7e" for ch in value):
        raise ConfigError(key, f"environment variable {name} holds characters not allowed in an HTTP header")
    return value
