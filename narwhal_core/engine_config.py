"""``[engine]``: the engines, how Narwhal talks to them, and their addresses (docs/configure.md, ``[engine]``).

Part of the configuration model (:mod:`narwhal_core.config`, which
re-exports every name here): :class:`EngineAddress` and
:func:`parse_engine_url` (an engine's ``http://HOST:PORT``), the KV-event
endpoint templates (:func:`kv_endpoint`), and :class:`EngineConfig`.
"""

import ipaddress
from typing import ClassVar, Final, Literal

import attrs

from .addresses import (
    bracketed,
    is_loopback_host,
    kv_host,
    kv_network,
    normalize_host,
    split_host_port,
)
from .config_fields import (
    as_str_tuple,
    count,
    describe,
    doc,
    env_name,
    one_of,
    optional_string,
    printable_path,
    seconds,
    set_derived,
    str_list,
    string,
)
from .discovery_config import DiscoveryMode
from .errors import ConfigError

__all__ = [
    "EngineAddress", "EngineConfig", "EngineProtocolName", "KvEventsSocket", "KvRelease", "kv_endpoint", "kv_endpoint_problem",
    "kv_rank_endpoint", "parse_engine_url",
]

#: The engine protocols (docs/design.md, "Engine protocols"): vLLM's NIXL connector in pull mode, and in push mode.
EngineProtocolName = Literal["vllm-nixl", "vllm-nixl-push"]
KvRelease = Literal["decode_pull", "abort_endpoint", "decode_abort", "lease"]
KvEventsSocket = Literal["connect", "bind"]

# -- engine addresses ---------------------------------------------------------------


@attrs.frozen(kw_only=True)
class EngineAddress:
    """Where one engine listens, parsed from its ``http://HOST:PORT`` URL."""

    url: str = attrs.field(metadata=doc("Normalised base URL, no trailing slash: http://10.0.0.5:8100."))
    host: str = attrs.field(metadata=doc("Host to connect to; IPv6 without brackets, names lowercased."))
    port: int = attrs.field(metadata=doc("TCP port, 1-65535."))
    authority: bytes = attrs.field(metadata=doc("Value of the Host header: b'10.0.0.5:8100', b'[::1]:8100'."))


def parse_engine_url(url: str, *, key: str) -> EngineAddress:
    """Parse an engine URL ``http://HOST:PORT`` (a trailing ``/`` allowed), or raise ConfigError(key)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        raise ConfigError(key, f"must be an http://HOST:PORT URL, got {describe(url)}")
    if scheme.lower() == "https":
        raise ConfigError(
            key, f"https:// is not supported yet (engines are reached over plain http://), got {describe(url)}"
        )
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        # Never echo the URL: it carries credentials.
        raise ConfigError(key, "must not contain credentials; use engine.engine_api_key_env")
    if slash and path:
        raise ConfigError(
            key, f"must not have a path, query or fragment (http://HOST:PORT), got {describe(url)}"
        )
    if "?" in authority or "#" in authority:
        raise ConfigError(key, f"must not have a query or fragment (http://HOST:PORT), got {describe(url)}")
    try:
        host, port = split_host_port(authority, min_port=1)
    except ValueError as exc:
        raise ConfigError(key, f"{exc} (http://HOST:PORT), got {describe(url)}") from None
    authority_text = f"{bracketed(host)}:{port}"
    return EngineAddress(
        url=f"http://{authority_text}", host=host, port=port, authority=authority_text.encode("ascii")
    )


# -- the sections -------------------------------------------------------------------


# -- KV-event endpoints -------------------------------------------------------------

#: The placeholders an ``engine.kv_events`` template may hold.
_KV_PLACEHOLDERS: Final = ("{host}", "{port}")


def kv_endpoint(template: str, address: EngineAddress) -> str:
    """An engine's KV-event endpoint: ``template`` with its URL's ``{host}`` (bracketed if IPv6) and ``{port}``.

    (docs/configure.md, ``engine.kv_events``.) Plain replacement, not
    :meth:`str.format`: a template is an address, never a format language.
    """
    return template.replace("{host}", bracketed(address.host)).replace("{port}", str(address.port))


def kv_rank_endpoint(endpoint: str, rank: int) -> str:
    """A data-parallel rank's endpoint: ``tcp://HOST:PORT`` with the port + ``rank``.

    vLLM's ``ZmqEventPublisher.offset_endpoint_port``
    (``vllm/distributed/kv_events.py``): each rank of an engine started with
    ``--data-parallel-size`` publishes on the endpoint's port + its rank, and
    its replay socket on the replay port + its rank.
    """
    base, _, port = endpoint.rpartition(":")
    return endpoint if rank == 0 else f"{base}:{int(port) + rank}"


def kv_endpoint_problem(endpoint: str) -> str | None:
    """Why ``endpoint`` (a template already filled in) is not ``tcp://HOST:PORT``; ``None`` when it is."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme != "tcp":
        return f"must be tcp://HOST:PORT once {{host}} and {{port}} are filled in, got {describe(endpoint)}"
    try:
        split_host_port(rest, min_port=1)
    except ValueError as exc:
        return f"{exc}: must be tcp://HOST:PORT once {{host}} and {{port}} are filled in, got {describe(endpoint)}"
    return None


def _kv_template(value: str) -> str | None:
    # Checked filled in with an example engine; the configured engines are checked in EngineConfig.
    rest = value
    for placeholder in _KV_PLACEHOLDERS:
        rest = rest.replace(placeholder, "")
    if "{" in rest or "}" in rest:
        return f"may hold only the placeholders {{host}} and {{port}}, got {describe(value)}"
    return kv_endpoint_problem(value.replace("{host}", "engine.example").replace("{port}", "1"))


@attrs.frozen(kw_only=True)
class EngineConfig:
    """``[engine]``: the prefill and decode pools and how legs reach them."""

    SECTION: ClassVar[str] = "engine"

    prefill: tuple[str, ...] = attrs.field(
        factory=tuple,
        converter=as_str_tuple,
        validator=str_list(),
        metadata=doc("Prefill engine URLs, http://HOST:PORT; empty runs single-leg on the decode pool."),
    )
    decode: tuple[str, ...] = attrs.field(
        converter=as_str_tuple,
        validator=str_list(),
        metadata=doc("Decode engine URLs, http://HOST:PORT (required; non-empty, or [] with engine.discovery dns or file)."),
    )
    engine_api_key_env: str | None = attrs.field(
        default=None,
        validator=optional_string(env_name),
        metadata=doc(
            "Environment variable holding the engine credential, sent on every leg and control request."
        ),
    )
    protocol: EngineProtocolName = attrs.field(
        default="vllm-nixl",
        validator=one_of(EngineProtocolName),
        metadata=doc(
            "How the legs talk to the engines: vllm-nixl (vLLM's NIXL connector in pull mode) or vllm-nixl-push "
            "(its push mode)."
        ),
    )
    kv_release: KvRelease = attrs.field(
        default="decode_pull",
        validator=one_of(KvRelease),
        metadata=doc(
            "How unpulled prefill KV is released: decode_pull (vLLM), abort_endpoint (engines that offer one, "
            "SGLang-style), decode_abort or lease."
        ),
    )
    abort_path: str = attrs.field(
        default="/abort_request",
        validator=string(printable_path),
        metadata=doc('Prefill engine path for KV releases when kv_release = "abort_endpoint".'),
    )
    kv_lease_s: float = seconds(
        30.0, "Seconds a prefill engine keeps unpulled KV (vLLM's kv_lease_duration); decode legs start well within it."
    )
    kv_hosts: tuple[str, ...] = attrs.field(
        factory=tuple,
        converter=as_str_tuple,
        validator=str_list(kv_host),
        metadata=doc(
            "Extra hosts (names, addresses, or networks in CIDR form) a prefill answer's remote_host may name "
            "besides the prefill engines' hosts and the addresses their names resolve to."
        ),
    )
    max_inflight_per_engine: int = count(256, "Most legs running on one engine at once.", minimum=1)
    pool_connections_per_engine: int = count(128, "Most pooled connections kept open to one engine.", minimum=1)
    connect_timeout_s: float = seconds(2.0, "Time to open a connection to an engine.")
    prefill_timeout_s: float = seconds(60.0, "Time for a whole prefill-leg answer.")
    decode_timeout_s: float = seconds(
        600.0, "Time for a whole non-streaming decode answer, or for the first event of a stream."
    )
    stream_idle_timeout_s: float = seconds(60.0, "Longest gap between two chunks of a streamed decode answer.")
    max_response_bytes: int = count(67108864, "Largest engine response body accepted.", minimum=1)
    control_timeout_s: float = seconds(5.0, "Time for a control request (KV release) to an engine.")
    discovery: DiscoveryMode = attrs.field(
        default="static",
        validator=one_of(DiscoveryMode),
        metadata=doc(
            "Where the engines come from: static (prefill and decode as written), dns (the [discovery] names, "
            "re-resolved) or file (the [discovery] file, read again when it changes)."
        ),
    )

    kv_events: str | None = attrs.field(
        default=None,
        validator=optional_string(_kv_template),
        metadata=doc(
            "Where each engine publishes its KV-cache events (vLLM's ZMQ PUB), a template: tcp://{host}:5557, "
            "{host} and {port} from the engine URL; unset: no subscription."
        ),
    )
    kv_events_replay: str | None = attrs.field(
        default=None,
        validator=optional_string(_kv_template),
        metadata=doc(
            "Each engine's KV-event replay socket (vLLM's ROUTER), a template like kv_events; unset: no replay."
        ),
    )

    kv_events_socket: KvEventsSocket = attrs.field(
        default="connect",
        validator=one_of(KvEventsSocket),
        metadata=doc(
            "connect: Narwhal connects to each engine's kv_events endpoint (the engine binds, vLLM's tcp://*:5557); "
            "bind: Narwhal binds it and the engine connects (vLLM's endpoint tcp://NARWHAL_HOST:PORT)."
        ),
    )
    data_parallel_size: int = count(
        1,
        "Data-parallel ranks behind each engine URL (vLLM's --data-parallel-size): the KV events of rank r "
        "are read on the kv_events and kv_events_replay ports + r.",
        minimum=1,
        maximum=64,
    )

    prefill_engines: tuple[EngineAddress, ...] = attrs.field(
        init=False, eq=False, repr=False, metadata=doc("prefill, parsed.")
    )
    decode_engines: tuple[EngineAddress, ...] = attrs.field(
        init=False, eq=False, repr=False, metadata=doc("decode, parsed.")
    )
    allowed_kv_hosts: frozenset[str] = attrs.field(
        init=False, eq=False, repr=False, metadata=doc("Prefill URL hosts plus kv_hosts, normalised.")
    )
    kv_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = attrs.field(
        init=False, eq=False, repr=False, metadata=doc("The networks (CIDR) of kv_hosts.")
    )
    kv_loopback: bool = attrs.field(
        init=False, eq=False, repr=False,
        metadata=doc("A prefill host or kv_hosts entry is loopback: every loopback name and address is allowed."),
    )

    def __attrs_post_init__(self) -> None:
        # A URL may be in both lists (a "mixed" engine serves both phases), but
        # not twice in one list: that would double its share of the load.
        if self.discovery == "static" and not self.decode:
            raise ConfigError("engine.decode", "must be a non-empty list of http:// URLs")
        if self.discovery != "static" and (self.decode or self.prefill):
            key = "engine.decode" if self.decode else "engine.prefill"
            raise ConfigError(key, f"must be [] with engine.discovery = {self.discovery!r} (discovery finds the engines)")
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
        set_derived(self, "prefill_engines", pools["prefill"])
        set_derived(self, "decode_engines", pools["decode"])
        extra = {normalize_host(h) for h in self.kv_hosts}
        hosts = {a.host for a in pools["prefill"]} | {h for h in extra if h is not None}
        set_derived(self, "allowed_kv_hosts", frozenset(hosts))
        networks = (kv_network(h) for h in self.kv_hosts if normalize_host(h) is None)
        set_derived(self, "kv_networks", tuple(n for n in networks if n is not None))
        set_derived(self, "kv_loopback", any(is_loopback_host(h) for h in hosts))
        self._check_kv_events(pools["prefill"] + pools["decode"])

    def _check_kv_events(self, engines: tuple[EngineAddress, ...]) -> None:
        """The KV-event templates, filled in for every configured engine, are ``tcp://HOST:PORT``."""
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ConfigError("engine.kv_events_replay", "needs engine.kv_events (the stream it replays)")
        for name, template in (("kv_events", self.kv_events), ("kv_events_replay", self.kv_events_replay)):
            if template is None:
                continue
            for address in engines:
                endpoint = kv_endpoint(template, address)
                problem = kv_endpoint_problem(endpoint) or kv_endpoint_problem(
                    kv_rank_endpoint(endpoint, self.data_parallel_size - 1)
                )
                if problem is not None:
                    raise ConfigError(f"engine.{name}", f"for {address.url}: {problem}")
        if self.kv_events_socket == "bind" and self.kv_events is not None:
            self._check_kv_binds(self.prefill_engines)  # (decode engines' streams are not read)

    def _check_kv_binds(self, engines: tuple[EngineAddress, ...]) -> None:
        """Bound, each engine's stream needs an endpoint of its own: one socket cannot tell two streams apart."""
        assert self.kv_events is not None
        owner: dict[str, str] = {}
        for address in engines:
            endpoint = kv_endpoint(self.kv_events, address)
            for rank in range(self.data_parallel_size):
                bound = kv_rank_endpoint(endpoint, rank)
                other = owner.setdefault(bound, address.url)
                if other != address.url:
                    raise ConfigError(
                        "engine.kv_events",
                        f'with kv_events_socket = "bind" every engine needs an endpoint of its own; {bound} '
                        f"is both {other}'s and {address.url}'s",
                    )

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
        normal = normalize_host(host)
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

