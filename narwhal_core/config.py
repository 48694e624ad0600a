"""The configuration model (docs/configure.md): typed, frozen, validated values.

A config is a tree of frozen attrs classes, one per TOML section. The rules a
value must obey live in the classes themselves (attrs validators and
``__attrs_post_init__``), so a config built in Python code is checked exactly
like one parsed from TOML, and every failure is one :class:`ConfigError`
naming the dotted key (``engine.decode[1]``, ``ingress.auth``).

Parsing is split in two:

* shape — a private cattrs converter turns the TOML tables into the classes,
  refusing unknown keys (``forbid_extra_keys``) and reporting missing required
  keys; its errors are walked to find the dotted path of the first problem
  (:mod:`narwhal_core.config_shape`);
* types and meaning — the attrs validators: integers refuse ``true`` and
  ``1.5``, strings refuse numbers, URLs must be ``http://HOST:PORT``...
  (:mod:`narwhal_core.config_fields`, and :mod:`narwhal_core.addresses` for
  hosts, ports and networks).

The only check that needs the environment is ``engine.engine_api_key_env``:
:func:`validate` (run by :func:`parse_config` and :func:`config_from_dict`)
checks the variable is set, and :func:`engine_api_key` returns its value. The
credential itself is never stored in a :class:`Config`, so no repr, log line
or journal record can show it.

The adapter reads the file; this module only sees its text.
"""

import ipaddress
import tomllib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Final, Literal

import attrs

from .addresses import (
    cidr,
    is_ip_address,
    is_loopback_host,
    listen_address,
    names_loopback,
    normalize_host,
    split_host_port,
)
from .config_fields import (
    as_str_tuple,
    count,
    describe,
    doc,
    float_in,
    header_name,
    journal_path,
    lower,
    non_empty,
    one_of,
    optional_string,
    printable_path,
    seconds,
    section,
    set_derived,
    str_list,
    string,
    to_float,
)
from .config_shape import make_converter, translate
from .discovery_config import DiscoveryConfig
from .engine_config import EngineAddress, EngineConfig, KvRelease, kv_endpoint, kv_endpoint_problem, parse_engine_url
from .errors import ConfigError
from .routing_config import Disaggregation, RoutingConfig, RoutingMode, RoutingPolicy
from .tenants_config import TenantsConfig

__all__ = [
    "AuthMode", "KvRelease", "FsyncPolicy", "EngineAddress", "ModelConfig", "IngressConfig", "EngineConfig",
    "AdmissionConfig", "RetryConfig", "HealthConfig", "JournalConfig", "ShutdownConfig", "RoutingConfig",
    "RoutingPolicy", "RoutingMode", "Disaggregation", "TracingConfig", "TenantsConfig", "Config", "SECTIONS",
    "parse_config", "config_from_dict", "validate", "engine_api_key", "parse_engine_url", "normalize_host",
    "is_loopback_host", "is_ip_address", "kv_endpoint", "kv_endpoint_problem",
]

AuthMode = Literal["none", "api_keys", "trusted_header"]
FsyncPolicy = Literal["always", "interval", "never"]


@attrs.frozen(kw_only=True)
class ModelConfig:
    """``[model]``: the one model the fleet serves."""

    SECTION: ClassVar[str] = "model"

    name: str = attrs.field(
        validator=string(non_empty),
        metadata=doc("Model name clients use and the name sent to the engines (required)."),
    )
    aliases: tuple[str, ...] = attrs.field(
        factory=tuple,
        converter=as_str_tuple,
        validator=str_list(non_empty),
        metadata=doc("Further names clients may use for the model."),
    )
    tokenizer: str | None = attrs.field(
        default=None,
        validator=optional_string(non_empty),
        metadata=doc(
            "The model's Hugging Face tokenizer.json, or a directory holding it: Narwhal computes the token ids "
            'the engines cache (required by routing.policy = "kv"). Loaded by the runtime at start.'
        ),
    )
    chat_template: str | None = attrs.field(
        default=None,
        validator=optional_string(non_empty),
        metadata=doc(
            "A Jinja chat template file, as vLLM's --chat-template; unset: chat_template.jinja or the "
            "chat_template of tokenizer_config.json beside the tokenizer."
        ),
    )

    def __attrs_post_init__(self) -> None:
        if self.chat_template is not None and self.tokenizer is None:
            raise ConfigError("model.chat_template", "needs model.tokenizer (the template renders for that tokenizer)")
        seen = {self.name: "model.name"}
        for i, alias in enumerate(self.aliases):
            if alias in seen:
                raise ConfigError(f"model.aliases[{i}]", f"{describe(alias)} repeats {seen[alias]}")
            seen[alias] = f"model.aliases[{i}]"


#: The most worker processes ``ingress.workers`` may ask for.
MAX_WORKERS: Final = 256


def _workers(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
    """``ingress.workers``: an integer from 1 to :data:`MAX_WORKERS`, or ``"auto"`` (resolved by the runtime)."""
    if value == "auto":
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError("ingress.workers", f'must be an integer or "auto", got {describe(value)}')
    if not 1 <= value <= MAX_WORKERS:
        raise ConfigError("ingress.workers", f"must be between 1 and {MAX_WORKERS}, got {value}")


@attrs.frozen(kw_only=True)
class IngressConfig:
    """``[ingress]``: the client-facing listener, its authentication and limits."""

    SECTION: ClassVar[str] = "ingress"

    listen: str = attrs.field(
        default="127.0.0.1:8000",
        validator=string(listen_address),
        metadata=doc("Address to listen on, HOST:PORT (IPv6 as [::1]:8000; port 0 picks a free port)."),
    )
    auth: AuthMode = attrs.field(
        default="none",
        validator=one_of(AuthMode),
        metadata=doc("Ingress authentication: none (loopback listen only), api_keys or trusted_header."),
    )
    api_keys_file: str | None = attrs.field(
        default=None,
        validator=optional_string(non_empty),
        metadata=doc('TOML file of [[keys]] tables (client, sha256); required for auth = "api_keys".'),
    )
    client_header: str = attrs.field(
        default="x-narwhal-client",
        converter=lower,
        validator=string(header_name),
        metadata=doc('Header carrying the client ID for auth = "trusted_header" (stored lowercased).'),
    )
    trusted_proxies: tuple[str, ...] = attrs.field(
        factory=tuple,
        converter=as_str_tuple,
        validator=str_list(cidr),
        metadata=doc("CIDRs of the proxies allowed to name the client in client_header."),
    )
    max_body_bytes: int = count(4194304, "Largest request body accepted; a larger one gets 413.", minimum=1)
    max_header_bytes: int = count(16384, "Largest request header block accepted.", minimum=1)
    max_headers: int = count(100, "Most header fields accepted in one request.", minimum=1)
    max_request_line_bytes: int = count(8192, "Longest request line accepted.", minimum=1)
    header_timeout_s: float = seconds(10.0, "Time a client has to send the whole request head.")
    body_timeout_s: float = seconds(60.0, "Time a client has to send the whole request body.")
    keepalive_timeout_s: float = seconds(75.0, "How long an idle keep-alive client connection stays open.")
    send_timeout_s: float = seconds(
        30.0, "How long a client may take none of the bytes it was sent that wait unsent before its connection is "
        "dropped (docs/operate.md, \"Slow clients\")."
    )
    max_connections: int = count(20000, "Most client connections open at once.", minimum=1)
    max_buffered_bytes: int = count(
        536870912,
        "Most bytes of unfinished requests held across all client connections; past it, the "
        "connection that grows the total gets 503 overloaded.",
        minimum=1,
    )
    max_batch_prompts: int = count(
        8,
        "Most prompts one /v1/completions request may carry (a list of strings or of token-ID lists); each "
        "is served by its own prefill and decode legs, one prompt after another, and the answers are merged "
        "in prompt order. More get 400 with param prompt; 1 turns batches off (every list of two or more "
        "prompts gets that 400).",
        minimum=1,
        maximum=1024,
    )
    workers: int | Literal["auto"] = attrs.field(
        default=1,
        validator=_workers,
        metadata=doc(
            'Router processes sharing the listening port (SO_REUSEPORT) under one supervisor; "auto" is one per '
            "core. Admission limits stay fleet-wide figures, split across the workers (docs/operate.md, Workers)."
        ),
    )
    busy_poll_us: int = count(
        0,
        "After each event the router is fed, keep the event loop polling for this many microseconds before "
        "it sleeps: less added latency at low load, for up to one busy core while traffic is sparse. 0 never polls.",
        minimum=0,
        maximum=1000000,
    )

    listen_host: str = attrs.field(init=False, eq=False, repr=False, metadata=doc("Host part of listen."))
    listen_port: int = attrs.field(init=False, eq=False, repr=False, metadata=doc("Port part of listen."))
    trusted_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = attrs.field(
        init=False, eq=False, repr=False, metadata=doc("trusted_proxies, parsed.")
    )

    def __attrs_post_init__(self) -> None:
        host, port = split_host_port(self.listen, min_port=0)  # validated above
        set_derived(self, "listen_host", host)
        set_derived(self, "listen_port", port)
        networks = tuple(ipaddress.ip_network(p, strict=False) for p in self.trusted_proxies)
        set_derived(self, "trusted_networks", networks)
        # Without authentication Narwhal must not be reachable from elsewhere (docs/security.md).
        if self.auth == "none" and not names_loopback(host):
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
class AdmissionConfig:
    """``[admission]``: how many requests run and wait at once (docs/contract.md, "Admission, capacity and retries")."""

    SECTION: ClassVar[str] = "admission"

    max_inflight: int = count(256, "Most requests admitted at once across the fleet.", minimum=1)
    queue_size: int = count(1024, "Most requests waiting for admission (0 = no queue); beyond it, 503.")
    queue_timeout_s: float = seconds(10.0, "Longest a request waits in the admission queue before 503.")
    request_timeout_s: float = seconds(900.0, "Whole-request deadline, counted from ingress.")
    per_client_max_inflight: int = count(0, "Most requests in flight per client (0 = unlimited); beyond it, 429.")
    retry_after_s: int = count(1, "Seconds sent in Retry-After with 429 and 503 answers.")


@attrs.frozen(kw_only=True)
class RetryConfig:
    """``[retry]``: leg retries before any byte reached the client.

    (docs/contract.md, "Admission, capacity and retries".)
    """

    SECTION: ClassVar[str] = "retry"

    max_attempts: int = count(3, "Attempts per phase, the first one included.", minimum=1, maximum=100)
    backoff_base_s: float = seconds(
        0.05, "Delay before the first retry; doubles for each further one.", positive=False
    )
    backoff_max_s: float = seconds(2.0, "Longest delay between two attempts.", positive=False)

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

    probe_interval_s: float = seconds(5.0, "Time between two health probes of one engine.")
    probe_timeout_s: float = seconds(2.0, "Time a health probe may take.")
    probe_path: str = attrs.field(
        default="/health",
        validator=string(printable_path),
        metadata=doc("Path probed with GET (with the engine credential)."),
    )
    unhealthy_after: int = count(
        3, "Consecutive failures (probes or legs) that take an engine out of rotation.", minimum=1
    )
    healthy_after: int = count(2, "Consecutive successful probes that bring it back.", minimum=1)


@attrs.frozen(kw_only=True)
class JournalConfig:
    """``[journal]``: where request records go and how durably (docs/operate.md, "The journal")."""

    SECTION: ClassVar[str] = "journal"

    path: str = attrs.field(
        default="narwhal-journal.jsonl",
        validator=string(journal_path),
        metadata=doc('JSON Lines file the records are appended to; "-" writes to stdout.'),
    )
    fsync: FsyncPolicy = attrs.field(
        default="interval",
        validator=one_of(FsyncPolicy),
        metadata=doc("When the file is fsynced: always (every record), interval or never."),
    )
    fsync_interval_s: float = seconds(1.0, 'Time between fsyncs when fsync = "interval".')


@attrs.frozen(kw_only=True)
class ShutdownConfig:
    """``[shutdown]``: graceful stop on SIGTERM/SIGINT."""

    SECTION: ClassVar[str] = "shutdown"

    grace_s: float = seconds(
        30.0, "Time in-flight requests get to finish before they are cancelled.", positive=False
    )


def _otlp_endpoint(value: str) -> str | None:
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in ("http", "https") or "@" in rest or any(c in rest for c in "/?# "):
        return f"must be an http://HOST:PORT URL (an OTLP/HTTP collector), got {describe(value)}"
    try:
        split_host_port(rest, min_port=1)
    except ValueError as exc:
        return f"{exc} (http://HOST:PORT), got {describe(value)}"
    return None


@attrs.frozen(kw_only=True)
class TracingConfig:
    """``[tracing]``: exporting a span per request and per leg over OTLP/HTTP (docs/configure.md, "[tracing]")."""

    SECTION: ClassVar[str] = "tracing"

    endpoint: str | None = attrs.field(
        default=None,
        validator=optional_string(_otlp_endpoint),
        metadata=doc("OTLP/HTTP collector, http://HOST:PORT; spans go to its /v1/traces. Unset: no export."),
    )
    service_name: str = attrs.field(
        default="narwhal", validator=string(non_empty), metadata=doc("The service.name of the spans.")
    )
    export_timeout_s: float = seconds(10.0, "Time one export to the collector may take.")
    sample_ratio: float = attrs.field(
        default=1.0,
        converter=to_float,
        validator=float_in(positive=False, maximum=1.0),
        metadata=doc(
            "Share of the traces Narwhal starts that are sampled (exported, and flagged sampled to the engines), "
            "decided by the trace ID; a client's traceparent keeps its own flag."
        ),
    )


@attrs.frozen(kw_only=True)
class Config:
    """A whole Narwhal configuration. Build it in code or with :func:`parse_config`."""

    model: ModelConfig = attrs.field(validator=section(ModelConfig), metadata=doc("[model] section (required)."))
    ingress: IngressConfig = attrs.field(
        factory=IngressConfig, validator=section(IngressConfig), metadata=doc("[ingress] section.")
    )
    engine: EngineConfig = attrs.field(
        validator=section(EngineConfig), metadata=doc("[engine] section (required).")
    )
    admission: AdmissionConfig = attrs.field(
        factory=AdmissionConfig, validator=section(AdmissionConfig), metadata=doc("[admission] section.")
    )
    retry: RetryConfig = attrs.field(
        factory=RetryConfig, validator=section(RetryConfig), metadata=doc("[retry] section.")
    )
    health: HealthConfig = attrs.field(
        factory=HealthConfig, validator=section(HealthConfig), metadata=doc("[health] section.")
    )
    journal: JournalConfig = attrs.field(
        factory=JournalConfig, validator=section(JournalConfig), metadata=doc("[journal] section.")
    )
    shutdown: ShutdownConfig = attrs.field(
        factory=ShutdownConfig, validator=section(ShutdownConfig), metadata=doc("[shutdown] section.")
    )
    routing: RoutingConfig = attrs.field(
        factory=RoutingConfig, validator=section(RoutingConfig), metadata=doc("[routing] section.")
    )
    discovery: DiscoveryConfig = attrs.field(
        factory=DiscoveryConfig, validator=section(DiscoveryConfig), metadata=doc("[discovery] section.")
    )
    tracing: TracingConfig = attrs.field(
        factory=TracingConfig, validator=section(TracingConfig), metadata=doc("[tracing] section.")
    )
    tenants: TenantsConfig | None = attrs.field(
        default=None, validator=attrs.validators.optional(section(TenantsConfig)),
        metadata=doc("[tenants] section (unset: the admission queue is first come, first served)."),
    )

    model_names: frozenset[str] = attrs.field(
        init=False, eq=False, repr=False, metadata=doc("model.name and model.aliases: the names clients may use.")
    )

    def __attrs_post_init__(self) -> None:
        self.discovery.check(self.engine.discovery)
        self.routing.check(self.engine, self.discovery)
        self._check_kv_policy()
        if self.engine.kv_events_socket == "bind" and self.ingress.workers != 1 and self.engine.kv_events is not None:
            raise ConfigError(
                "engine.kv_events_socket",
                '"bind" needs ingress.workers = 1: each worker subscribes on its own, and only one can bind an '
                "endpoint (docs/operate.md, \"KV events\")",
            )
        set_derived(self, "model_names", frozenset((self.model.name, *self.model.aliases)))

    def _check_kv_policy(self) -> None:
        """``policy = "kv"`` routes by the engines' KV events: it needs their streams and the model's tokenizer."""
        if self.routing.policy != "kv":
            return
        if self.model.tokenizer is None:
            raise ConfigError(
                "routing.policy",
                'policy = "kv" needs model.tokenizer: set it to the model\'s tokenizer.json (or its directory), '
                "the one the engines load, so Narwhal computes the token ids they cache",
            )
        if self.engine.kv_events is None:
            raise ConfigError(
                "routing.policy",
                'policy = "kv" needs engine.kv_events: set it to the engines\' KV event endpoint, for example '
                '"tcp://{host}:5557" (vLLM\'s --kv-events-config endpoint)',
            )


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
    "routing": RoutingConfig,
    "discovery": DiscoveryConfig,
    "tracing": TracingConfig,
    "tenants": TenantsConfig,
})


# -- parsing ------------------------------------------------------------------------


def config_from_dict(data: Mapping[str, object], *, env: Mapping[str, str]) -> Config:
    """Build and validate a :class:`Config` from parsed TOML tables; raise one ConfigError."""
    try:
        # A converter of its own per call: cattrs fills a converter's hook caches as it goes, and
        # such a cache at module level would be state every router in the process shares.
        config = make_converter().structure(data, Config)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one ConfigError
        raise translate(exc, ()) from exc
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
