"""The configuration model (docs/configure.md): defaults, types, unknown keys, semantics, docs."""

from __future__ import annotations

import copy
import math
import re
from typing import Any, Literal, get_args, get_origin

import attrs
import cattrs
import pytest

from narwhal_core.config import (
    SECTIONS,
    AdmissionConfig,
    Config,
    EngineAddress,
    EngineConfig,
    HealthConfig,
    IngressConfig,
    JournalConfig,
    ModelConfig,
    RetryConfig,
    RoutingConfig,
    ShutdownConfig,
    config_from_dict,
    engine_api_key,
    parse_config,
    parse_engine_url,
    validate,
)
from narwhal_core.errors import ConfigError, ContractError
from narwhal_core.tenants_config import Budget, TenantConfig, TenantsConfig

from ..helpers import REPO

DOCS = REPO / "docs" / "configure.md"

DECODE = "http://127.0.0.1:8200"
MINIMAL: dict[str, Any] = {"model": {"name": "m"}, "engine": {"decode": [DECODE]}}

#: A short config of the shape docs/configure.md shows, with its comments.
EXAMPLE = """
[model]
name = "meta-llama/Llama-3.1-8B-Instruct"
aliases = ["llama-3.1-8b"]

[ingress]
listen = "127.0.0.1:8000"
auth = "none"                  # none | api_keys | trusted_header

[engine]
prefill = ["http://127.0.0.1:8100"]
decode  = ["http://127.0.0.1:8200"]
engine_api_key_env = "NARWHAL_ENGINE_API_KEY"   # optional
kv_release = "decode_abort"    # abort_endpoint | decode_abort | lease

[admission]
max_inflight = 256

[journal]
path = "narwhal-journal.jsonl"
"""

SECRET = "sk-very-secret-engine-key-0123456789"


def with_values(**sections: dict[str, Any]) -> dict[str, Any]:
    """MINIMAL with the given keys set (merged into each section)."""
    data = copy.deepcopy(MINIMAL)
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return data


def error_of(data: dict[str, Any], env: dict[str, str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, env=env or {})
    return info.value


def all_keys() -> list[tuple[str, attrs.Attribute[Any]]]:
    """Every (section, field) of the model that a config file may set."""
    return [(name, a) for name, cls in SECTIONS.items() for a in attrs.fields(cls) if a.init]


KEY_IDS = [f"{s}.{a.name}" for s, a in all_keys()]


# -- the whole file -----------------------------------------------------------------


def test_the_short_example_parses() -> None:
    config = parse_config(EXAMPLE, env={"NARWHAL_ENGINE_API_KEY": SECRET})
    assert config.model.name == "meta-llama/Llama-3.1-8B-Instruct"
    assert config.model_names == {"meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"}
    assert config.engine.prefill_engines == (
        EngineAddress(url="http://127.0.0.1:8100", host="127.0.0.1", port=8100, authority=b"127.0.0.1:8100"),
    )
    assert [e.url for e in config.engine.decode_engines] == ["http://127.0.0.1:8200"]
    assert config.engine.kv_release == "decode_abort"
    assert engine_api_key(config, {"NARWHAL_ENGINE_API_KEY": SECRET}) == SECRET
    assert SECRET not in repr(config)


def test_docs_example_file_parses() -> None:
    """The full example in docs/configure.md is a valid config."""
    text = DOCS.read_text(encoding="utf-8")
    match = re.search(r"## A full example file\n.*?```toml\n(.*?)```", text, re.S)
    assert match, "docs/configure.md has no full example"
    config = parse_config(match.group(1), env={"NARWHAL_ENGINE_API_KEY": SECRET})
    assert config.ingress.auth == "api_keys"


def test_toml_syntax_error_is_one_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config("[model\nname = 1", env={})
    assert info.value.key == "toml"
    assert "\n" not in info.value.line()


def test_top_level_must_be_a_table() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict([], env={})  # type: ignore[arg-type]
    assert info.value.key == "config"


def test_minimal_config_and_code_built_config_agree() -> None:
    parsed = config_from_dict(MINIMAL, env={})
    built = Config(model=ModelConfig(name="m"), engine=EngineConfig(decode=[DECODE]))
    assert parsed == built
    assert hash(parsed) == hash(built)


def test_config_is_frozen() -> None:
    config = config_from_dict(MINIMAL, env={})
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.model = ModelConfig(name="x")  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.ingress.listen = "0.0.0.0:1"  # type: ignore[misc]
    assert isinstance(config.engine.decode, tuple)


def test_error_line_is_one_line() -> None:
    error = error_of(with_values(admission={"max_inflight": True}))
    assert error.line() == "narwhal: bad config: admission.max_inflight: must be an integer, got true"


# -- defaults -----------------------------------------------------------------------

DEFAULTS: dict[str, object] = {
    "model.aliases": (),
    "model.tokenizer": None,
    "model.chat_template": None,
    "ingress.listen": "127.0.0.1:8000",
    "ingress.auth": "none",
    "ingress.api_keys_file": None,
    "ingress.client_header": "x-narwhal-client",
    "ingress.trusted_proxies": (),
    "ingress.max_body_bytes": 4194304,
    "ingress.max_header_bytes": 16384,
    "ingress.max_headers": 100,
    "ingress.max_request_line_bytes": 8192,
    "ingress.header_timeout_s": 10.0,
    "ingress.body_timeout_s": 60.0,
    "ingress.keepalive_timeout_s": 75.0,
    "ingress.send_timeout_s": 30.0,
    "ingress.max_connections": 20000,
    "ingress.max_buffered_bytes": 536870912,
    "ingress.busy_poll_us": 0,
    "ingress.workers": 1,
    "ingress.max_batch_prompts": 8,
    "engine.prefill": (),
    "engine.engine_api_key_env": None,
    "engine.protocol": "vllm-nixl",
    "engine.kv_release": "decode_pull",
    "engine.abort_path": "/abort_request",
    "engine.kv_lease_s": 30.0,
    "engine.kv_hosts": (),
    "engine.max_inflight_per_engine": 256,
    "engine.pool_connections_per_engine": 128,
    "engine.connect_timeout_s": 2.0,
    "engine.prefill_timeout_s": 60.0,
    "engine.decode_timeout_s": 600.0,
    "engine.stream_idle_timeout_s": 60.0,
    "engine.max_response_bytes": 67108864,
    "engine.control_timeout_s": 5.0,
    "admission.max_inflight": 256,
    "admission.queue_size": 1024,
    "admission.queue_timeout_s": 10.0,
    "admission.request_timeout_s": 900.0,
    "admission.per_client_max_inflight": 0,
    "admission.retry_after_s": 1,
    "retry.max_attempts": 3,
    "retry.backoff_base_s": 0.05,
    "retry.backoff_max_s": 2.0,
    "health.probe_interval_s": 5.0,
    "health.probe_timeout_s": 2.0,
    "health.probe_path": "/health",
    "health.unhealthy_after": 3,
    "health.healthy_after": 2,
    "journal.path": "narwhal-journal.jsonl",
    "journal.fsync": "interval",
    "journal.fsync_interval_s": 1.0,
    "shutdown.grace_s": 30.0,
    "routing.policy": "prefix",
    "routing.mode": "always",
    "routing.disaggregation": "optional",
    "routing.disaggregate_min_uncached_tokens": 512,
    "routing.metrics_interval_s": 1.0,
    "routing.prefill_tokens_per_s": 8000.0,
    "routing.kv_capacity_tokens": 2000000,
    "routing.miss_cost": 3.0,
    "routing.kv_block_size": 16,
    "routing.kv_events_stale_s": 30.0,
    "routing.kv_speculative_ttl_s": 2.0,
    "routing.tokenize_inline_max_bytes": 1024,
    "engine.discovery": "static",
    "engine.kv_events": None,
    "engine.kv_events_replay": None,
    "engine.kv_events_socket": "connect",
    "engine.data_parallel_size": 1,
    "discovery.prefill": None,
    "discovery.decode": None,
    "discovery.record": "A",
    "discovery.port": 8000,
    "discovery.interval_s": 5.0,
    "discovery.nameserver": None,
    "discovery.file": None,
    "tracing.endpoint": None,
    "tracing.service_name": "narwhal",
    "tracing.export_timeout_s": 10.0,
    "tracing.sample_ratio": 1.0,
    "tenants.bands": ("default",),
    "tenants.default_band": None,
    "tenants.default_weight": 1.0,
    "tenants.tenant": (),
    "tenants.default_requests_per_s": 0.0,
    "tenants.default_prompt_tokens_per_min": 0.0,
    "tenants.default_max_inflight": None,
}
#: Sections a config without them does not have (``None``): their defaults are those of an empty table.
ABSENT_UNLESS_WRITTEN = {"tenants"}
REQUIRED = {"model.name", "engine.decode"}


def test_defaults_table_covers_every_key() -> None:
    assert set(DEFAULTS) | REQUIRED == set(KEY_IDS)


@pytest.mark.parametrize("key", sorted(DEFAULTS))
def test_default(key: str) -> None:
    section, name = key.split(".")
    data = with_values(**{section: {}}) if section in ABSENT_UNLESS_WRITTEN else MINIMAL
    config = config_from_dict(data, env={})
    value = getattr(getattr(config, section), name)
    assert value == DEFAULTS[key]
    assert type(value) is type(DEFAULTS[key])


@pytest.mark.parametrize("key", sorted(REQUIRED))
def test_required_key_missing(key: str) -> None:
    section, name = key.split(".")
    data = copy.deepcopy(MINIMAL)
    del data[section][name]
    error = error_of(data)
    assert (error.key, error.line()) == (key, f"narwhal: bad config: {key}: missing required key")


@pytest.mark.parametrize("section", ["model", "engine"])
def test_required_section_missing(section: str) -> None:
    data = copy.deepcopy(MINIMAL)
    del data[section]
    error = error_of(data)
    assert (error.key, str(error)) == (section, f"{section}: missing required section")


@pytest.mark.parametrize("section", [s for s in SECTIONS if s not in ("model", "engine")])
def test_optional_sections_may_be_omitted_or_empty(section: str) -> None:
    cls = SECTIONS[section]
    config = config_from_dict(with_values(**{section: {}}), env={})
    assert getattr(config, section) == cls()


# -- types --------------------------------------------------------------------------


def wrong_values(annotation: object) -> list[tuple[object, str]]:
    """Values of the wrong type for a field, each with the error message's tail."""
    if annotation is int or annotation == (int | None):
        return [(True, "must be an integer, got true"), (1.5, "must be an integer, got 1.5"),
                ("5", 'must be an integer, got "5"'), ([1], "must be an integer, got an array")]
    if annotation is float:
        return [(False, "must be a number, got false"), ("1.0", 'must be a number, got "1.0"'),
                ({}, "must be a number, got a table")]
    if annotation is str or annotation == (str | None):
        return [(5, "must be a string, got 5"), (True, "must be a string, got true"),
                (["x"], "must be a string, got an array")]
    if annotation == tuple[str, ...]:
        return [("x", 'must be a list of strings, got "x"'), (5, "must be a list of strings, got 5")]
    if annotation == tuple[TenantConfig, ...]:
        return [(5, "must be an array of tables, got 5"), ("x", 'must be an array of tables, got "x"')]
    if get_origin(annotation) is Literal:
        listed = ", ".join(f'"{v}"' for v in get_args(annotation))
        return [(5, f"must be one of {listed}, got 5"), ("bogus", f'must be one of {listed}, got "bogus"')]
    if annotation == (int | Literal["auto"]):
        return [(True, 'must be an integer or "auto", got true'), (1.5, 'must be an integer or "auto", got 1.5'),
                ("bogus", 'must be an integer or "auto", got "bogus"'), (0, "must be between 1 and 256, got 0")]
    raise AssertionError(f"no wrong values for {annotation!r}")


WRONG_TYPES = [
    pytest.param(section, a.name, value, message, id=f"{section}.{a.name}={value!r}")
    for section, a in all_keys()
    for value, message in wrong_values(a.type)
]


@pytest.mark.parametrize(("section", "name", "value", "message"), WRONG_TYPES)
def test_wrong_type_names_the_key(section: str, name: str, value: object, message: str) -> None:
    error = error_of(with_values(**{section: {name: value}}))
    assert error.key == f"{section}.{name}"
    assert str(error) == f"{section}.{name}: {message}"


@pytest.mark.parametrize(
    ("section", "name"),
    [(s, a.name) for s, a in all_keys() if a.type == tuple[str, ...]],
)
def test_list_elements_are_type_checked(section: str, name: str) -> None:
    error = error_of(with_values(**{section: {name: [1]}}))
    assert (error.key, error.message) == (f"{section}.{name}[0]", f"{section}.{name}[0]: must be a string, got 1")


@pytest.mark.parametrize(("section", "name"), [(s, a.name) for s, a in all_keys() if a.type is float])
def test_float_keys_accept_integers(section: str, name: str) -> None:
    value = 1000 if name not in ("backoff_base_s", "sample_ratio") else 1
    config = config_from_dict(with_values(**{section: {name: value}}), env={})
    stored = getattr(getattr(config, section), name)
    assert stored == float(value) and type(stored) is float


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_floats_must_be_finite(value: float) -> None:
    error = error_of(with_values(engine={"connect_timeout_s": value}))
    assert error.key == "engine.connect_timeout_s"
    assert "must be a finite number" in str(error)


# -- unknown keys -------------------------------------------------------------------


def test_unknown_top_level_key() -> None:
    error = error_of(with_values(bogus={}))
    assert (error.key, str(error)) == ("bogus", "bogus: unknown key")


@pytest.mark.parametrize("section", list(SECTIONS))
def test_unknown_key_in_each_section(section: str) -> None:
    error = error_of(with_values(**{section: {"bogus": 1}}))
    assert error.key == f"{section}.bogus"
    assert str(error) == f"{section}.bogus: unknown key"


def test_unknown_key_suggests_a_close_one() -> None:
    error = error_of(with_values(ingress={"max_body_byte": 1}))
    assert str(error) == "ingress.max_body_byte: unknown key (did you mean max_body_bytes?)"


@pytest.mark.parametrize("derived", ["prefill_engines", "decode_engines", "allowed_kv_hosts"])
def test_derived_fields_are_not_keys(derived: str) -> None:
    assert error_of(with_values(engine={derived: []})).key == f"engine.{derived}"


@pytest.mark.parametrize("section", list(SECTIONS))
def test_section_must_be_a_table(section: str) -> None:
    data = copy.deepcopy(MINIMAL)
    data[section] = 5
    error = error_of(data)
    assert (error.key, str(error)) == (section, f"{section}: must be a table, got 5")


# -- semantics: model ---------------------------------------------------------------


def test_model_name_must_not_be_empty() -> None:
    assert str(error_of(with_values(model={"name": ""}))) == "model.name: must not be empty"


def test_aliases_are_distinct_from_the_name_and_each_other() -> None:
    error = error_of(with_values(model={"aliases": ["a", "m"]}))
    assert str(error) == 'model.aliases[1]: "m" repeats model.name'
    error = error_of(with_values(model={"aliases": ["a", "b", "a"]}))
    assert str(error) == 'model.aliases[2]: "a" repeats model.aliases[0]'
    assert error_of(with_values(model={"aliases": [""]})).key == "model.aliases[0]"


def test_model_tokenizer_and_chat_template() -> None:
    config = config_from_dict(with_values(model={"tokenizer": "/models/llama", "chat_template": "/t.jinja"}), env={})
    assert (config.model.tokenizer, config.model.chat_template) == ("/models/llama", "/t.jinja")
    assert str(error_of(with_values(model={"tokenizer": ""}))) == "model.tokenizer: must not be empty"
    error = error_of(with_values(model={"chat_template": "/t.jinja"}))
    assert str(error) == "model.chat_template: needs model.tokenizer (the template renders for that tokenizer)"


def test_required_disaggregation_needs_mode_always_and_prefill_engines() -> None:
    required = {"disaggregation": "required"}
    assert str(error_of(with_values(routing=required))) == (
        'routing.disaggregation: "required" needs prefill engines: engine.prefill, engine.discovery = "file", '
        'or "dns" with discovery.prefill'
    )
    prefill = {"prefill": ["http://127.0.0.1:8100"]}
    for mode in ("auto", "never"):
        assert str(error_of(with_values(engine=prefill, routing={**required, "mode": mode}))) == (
            f'routing.disaggregation: "required" needs routing.mode = "always", got "{mode}" (with it a request '
            "may run whole on a decode engine)"
        )
    assert config_from_dict(with_values(engine=prefill, routing=required), env={}).routing.disaggregation == "required"
    dns = {"engine": {"discovery": "dns", "decode": []}, "routing": required}
    assert error_of(with_values(**dns, discovery={"decode": "d.test"})).key == "routing.disaggregation"
    config_from_dict(with_values(**dns, discovery={"decode": "d.test", "prefill": "p.test"}), env={})
    config_from_dict(with_values(engine={"discovery": "file", "decode": []}, discovery={"file": "/etc/engines.toml"},
                                 routing=required), env={})  # fmt: skip


def test_the_kv_policy_needs_a_tokenizer_and_the_engines_kv_events() -> None:
    error = error_of(with_values(routing={"policy": "kv"}))
    assert error.key == "routing.policy"
    assert str(error).startswith('routing.policy: policy = "kv" needs model.tokenizer: set it to the model\'s '
                                 "tokenizer.json (or its directory)")  # fmt: skip
    error = error_of(with_values(routing={"policy": "kv"}, model={"tokenizer": "/models/llama"}))
    assert error.key == "routing.policy"
    assert str(error).startswith('routing.policy: policy = "kv" needs engine.kv_events: set it to ')
    assert '"tcp://{host}:5557"' in str(error)
    if "kv_events" in attrs.fields_dict(EngineConfig):  # [engine] kv_events, where this tree has it
        data = with_values(routing={"policy": "kv"}, model={"tokenizer": "/models/llama"},
                           engine={"kv_events": "tcp://{host}:5557"})  # fmt: skip
        assert config_from_dict(data, env={}).routing.policy == "kv"


def test_data_parallel_ranks_and_the_bound_kv_event_sockets() -> None:
    # Rank r's events are on the port + r (vLLM's offset_endpoint_port): the last rank's must be a port too.
    two = {"kv_events": "tcp://{host}:5557", "data_parallel_size": 2}
    assert config_from_dict(with_values(engine=two), env={}).engine.data_parallel_size == 2
    error = error_of(with_values(engine={**two, "kv_events": "tcp://{host}:65535"}))
    assert error.key == "engine.kv_events" and "65536" in str(error), str(error)
    assert error_of(with_values(engine={"data_parallel_size": 0})).key == "engine.data_parallel_size"
    # Bound, each prefill engine needs endpoints of its own; decode engines' streams are not read.
    bound = {"kv_events": "tcp://127.0.0.1:7000", "kv_events_socket": "bind"}
    error = error_of(with_values(engine={**bound, "prefill": ["http://p1:8000", "http://p2:8000"]}))
    assert str(error) == (
        'engine.kv_events: with kv_events_socket = "bind" every engine needs an endpoint of its own; '
        "tcp://127.0.0.1:7000 is both http://p1:8000's and http://p2:8000's"
    )
    ranks = {**bound, "kv_events": "tcp://127.0.0.1:{port}", "data_parallel_size": 2}
    error = error_of(with_values(engine={**ranks, "prefill": ["http://p1:8000", "http://p2:8001"]}))
    assert "tcp://127.0.0.1:8001 is both http://p1:8000's and http://p2:8001's" in str(error)
    config = config_from_dict(with_values(engine={**bound, "prefill": ["http://p1:8000"]}), env={})
    assert config.engine.kv_events_socket == "bind"
    error = error_of(with_values(engine={**bound, "prefill": ["http://p1:8000"]}, ingress={"workers": 2}))
    assert error.key == "engine.kv_events_socket" and "ingress.workers = 1" in str(error)
    assert error_of(with_values(engine={**bound, "kv_events_socket": "listen"})).key == "engine.kv_events_socket"


def test_model_names() -> None:
    config = config_from_dict(with_values(model={"aliases": ["a", "b"]}), env={})
    assert config.model_names == frozenset({"m", "a", "b"})


# -- semantics: ingress -------------------------------------------------------------


@pytest.mark.parametrize(
    ("listen", "host", "port"),
    [
        ("127.0.0.1:8000", "127.0.0.1", 8000),
        ("127.0.0.1:0", "127.0.0.1", 0),
        ("127.9.9.9:65535", "127.9.9.9", 65535),
        ("[::1]:8000", "::1", 8000),
        ("[0:0:0:0:0:0:0:1]:8000", "::1", 8000),
        ("localhost:8000", "localhost", 8000),
        ("LocalHost:1", "localhost", 1),
    ],
)
def test_listen_parses(listen: str, host: str, port: int) -> None:
    config = config_from_dict(with_values(ingress={"listen": listen}), env={})
    assert (config.ingress.listen_host, config.ingress.listen_port) == (host, port)


@pytest.mark.parametrize(
    "listen",
    ["127.0.0.1", "127.0.0.1:", ":8000", "127.0.0.1:65536", "127.0.0.1:-1", "127.0.0.1:80a", "::1:8000",
     "[::1]8000", "[::1:8000", "[nope]:8000", "999.0.0.1:80", "10.0.0:80", "host name:80", "", "127.0.0.1:８０"],
)
def test_listen_rejects(listen: str) -> None:
    error = error_of(with_values(ingress={"listen": listen}))
    assert error.key == "ingress.listen"
    assert "must be HOST:PORT (IPv6 as [::1]:8000)" in str(error)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "[::]", "[2001:db8::1]", "example.com", "narwhal"])
def test_auth_none_needs_loopback(host: str) -> None:
    error = error_of(with_values(ingress={"listen": f"{host}:8000"}))
    shown = host.strip("[]")
    assert error.key == "ingress.auth"
    assert str(error) == f'ingress.auth: auth = "none" is only allowed on a loopback listen address, not {shown}'


def test_auth_none_refusal_message_matches_the_spec_example() -> None:
    error = error_of(with_values(ingress={"listen": "0.0.0.0:8000"}))
    assert error.message.endswith('auth = "none" is only allowed on a loopback listen address, not 0.0.0.0')


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "[::1]", "localhost", "[::ffff:127.0.0.1]"])
def test_auth_none_on_loopback_is_fine(host: str) -> None:
    assert config_from_dict(with_values(ingress={"listen": f"{host}:8000"}), env={}).ingress.auth == "none"


def test_api_keys_requires_a_keys_file() -> None:
    error = error_of(with_values(ingress={"auth": "api_keys", "listen": "0.0.0.0:8000"}))
    assert str(error) == 'ingress.api_keys_file: is required when auth = "api_keys"'
    config = config_from_dict(
        with_values(ingress={"auth": "api_keys", "listen": "0.0.0.0:8000", "api_keys_file": "keys.toml"}), env={}
    )
    assert config.ingress.api_keys_file == "keys.toml"
    assert error_of(with_values(ingress={"api_keys_file": ""})).key == "ingress.api_keys_file"


def test_trusted_header_requires_a_proxy() -> None:
    error = error_of(with_values(ingress={"auth": "trusted_header", "listen": "0.0.0.0:8000"}))
    assert error.key == "ingress.trusted_proxies"
    assert "at least one trusted proxy" in str(error)


def test_trusted_proxies_parse_ipv4_and_ipv6() -> None:
    config = config_from_dict(
        with_values(
            ingress={
                "auth": "trusted_header",
                "listen": "[::]:8000",
                "trusted_proxies": ["10.0.0.0/8", "192.0.2.7", "fd00::/8", "10.1.2.3/16"],
            }
        ),
        env={},
    )
    assert [str(n) for n in config.ingress.trusted_networks] == [
        "10.0.0.0/8", "192.0.2.7/32", "fd00::/8", "10.1.0.0/16"
    ]


@pytest.mark.parametrize("bad", ["10.0.0.0/33", "nope", "fd00::/129", "10.0.0.0/8/8", ""])
def test_trusted_proxies_must_be_cidrs(bad: str) -> None:
    error = error_of(with_values(ingress={"trusted_proxies": ["10.0.0.0/8", bad]}))
    assert error.key == "ingress.trusted_proxies[1]"
    assert "CIDR" in str(error)


def test_client_header_is_lowercased_and_must_be_a_header_name() -> None:
    config = config_from_dict(with_values(ingress={"client_header": "X-Auth-User"}), env={})
    assert config.ingress.client_header == "x-auth-user"
    assert IngressConfig(client_header="X-A").client_header == "x-a"
    for bad in ["", "x user", "x:user", "x\nuser"]:
        assert error_of(with_values(ingress={"client_header": bad})).key == "ingress.client_header"


# -- semantics: engine --------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "normal", "host", "port", "authority"),
    [
        ("http://127.0.0.1:8200", "http://127.0.0.1:8200", "127.0.0.1", 8200, b"127.0.0.1:8200"),
        ("http://127.0.0.1:8200/", "http://127.0.0.1:8200", "127.0.0.1", 8200, b"127.0.0.1:8200"),
        ("HTTP://Decode-0.Example:9", "http://decode-0.example:9", "decode-0.example", 9, b"decode-0.example:9"),
        ("http://[::1]:8200", "http://[::1]:8200", "::1", 8200, b"[::1]:8200"),
        ("http://[fd00:0::5]:80/", "http://[fd00::5]:80", "fd00::5", 80, b"[fd00::5]:80"),
    ],
)
def test_engine_urls_normalise(url: str, normal: str, host: str, port: int, authority: bytes) -> None:
    address = parse_engine_url(url, key="k")
    assert address == EngineAddress(url=normal, host=host, port=port, authority=authority)


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("https://127.0.0.1:8200", "https:// is not supported yet"),
        ("ftp://127.0.0.1:8200", "must be an http://HOST:PORT URL"),
        ("127.0.0.1:8200", "must be an http://HOST:PORT URL"),
        ("http://127.0.0.1:8200/v1", "must not have a path"),
        ("http://127.0.0.1:8200//", "must not have a path"),
        ("http://127.0.0.1:8200?x=1", "must not have a query"),
        ("http://127.0.0.1:8200#x", "must not have a query"),
        ("http://127.0.0.1", "must name a port"),
        ("http://127.0.0.1:0", "port must be between 1 and 65535"),
        ("http://127.0.0.1:70000", "port must be between 1 and 65535"),
        ("http://::1:8200", "must put an IPv6 address in brackets"),
        ("http://:8200", "must name a host"),
        ("http://bad_host!:8200", "invalid host"),
    ],
)
def test_engine_url_rejects(url: str, fragment: str) -> None:
    error = error_of(with_values(engine={"decode": [DECODE, url]}))
    assert error.key == "engine.decode[1]"
    assert fragment in str(error)


def test_engine_url_with_credentials_is_not_echoed() -> None:
    error = error_of(with_values(engine={"prefill": ["http://user:hunter2@10.0.0.1:8100"]}))
    assert error.key == "engine.prefill[0]"
    assert "hunter2" not in str(error)
    assert "engine_api_key_env" in str(error)


def test_decode_must_not_be_empty() -> None:
    error = error_of(with_values(engine={"decode": []}))
    assert (error.key, str(error)) == ("engine.decode", "engine.decode: must be a non-empty list of http:// URLs")


def test_no_url_twice_in_one_pool() -> None:
    error = error_of(with_values(engine={"prefill": ["http://10.0.0.1:8100", "http://10.0.0.1:8100/"]}))
    assert str(error) == "engine.prefill[1]: http://10.0.0.1:8100 repeats engine.prefill[0]"


def test_a_mixed_engine_may_serve_both_phases() -> None:
    config = config_from_dict(with_values(engine={"prefill": [DECODE]}), env={})
    assert config.engine.prefill_engines == config.engine.decode_engines


def test_the_engine_protocol_is_pull_unless_set_and_names_only_protocols_driven() -> None:
    # docs/configure.md, engine.protocol; docs/design.md, "Engine protocols".
    assert config_from_dict(MINIMAL, env={}).engine.protocol == "vllm-nixl"
    assert config_from_dict(with_values(engine={"protocol": "vllm-nixl-push"}), env={}).engine.protocol == (
        "vllm-nixl-push"
    )
    assert str(error_of(with_values(engine={"protocol": "sglang"}))) == (
        'engine.protocol: must be one of "vllm-nixl", "vllm-nixl-push", got "sglang"'
    )


def test_single_leg_fleet_has_no_prefill_engines() -> None:
    assert config_from_dict(MINIMAL, env={}).engine.prefill_engines == ()


def test_kv_hosts() -> None:
    config = config_from_dict(
        with_values(engine={"prefill": ["http://10.0.0.1:8100", "http://[FD00::1]:8100"],
                            "kv_hosts": ["10.9.9.9", "RDMA-0.Example", "[fd00::2]"]}),
        env={},
    )
    assert config.engine.allowed_kv_hosts == {"10.0.0.1", "fd00::1", "10.9.9.9", "rdma-0.example", "fd00::2"}
    assert config.engine.kv_host_allowed("10.0.0.1")
    assert config.engine.kv_host_allowed("rdma-0.example.")
    assert config.engine.kv_host_allowed("FD00:0::1")
    assert not config.engine.kv_host_allowed("127.0.0.1")
    assert not config.engine.kv_host_allowed("")
    for bad in ["10.0.0.1:80", "", "a b"]:
        assert error_of(with_values(engine={"kv_hosts": [bad]})).key == "engine.kv_hosts[0]"


@pytest.mark.parametrize(("section", "name"), [("engine", "abort_path"), ("health", "probe_path")])
@pytest.mark.parametrize("bad", ["", "abort", "/with space", "/tab\t"])
def test_paths_start_with_a_slash(section: str, name: str, bad: str) -> None:
    error = error_of(with_values(**{section: {name: bad}}))
    assert error.key == f"{section}.{name}"
    assert "must be a path starting with /" in str(error)


# -- semantics: the engine credential -----------------------------------------------

ENV_KEY = "NARWHAL_ENGINE_API_KEY"
WITH_KEY_ENV = with_values(engine={"engine_api_key_env": ENV_KEY})


def test_engine_api_key_resolves_from_env_and_is_never_stored() -> None:
    config = config_from_dict(WITH_KEY_ENV, env={ENV_KEY: SECRET})
    assert engine_api_key(config, {ENV_KEY: SECRET}) == SECRET
    assert SECRET not in repr(config)
    assert SECRET not in str(attrs.asdict(config))
    assert engine_api_key(config_from_dict(MINIMAL, env={ENV_KEY: SECRET}), {ENV_KEY: SECRET}) is None


def test_engine_api_key_env_must_be_set() -> None:
    error = error_of(WITH_KEY_ENV, env={"OTHER": SECRET})
    assert error.key == "engine.engine_api_key_env"
    assert str(error) == f"engine.engine_api_key_env: environment variable {ENV_KEY} is not set"


@pytest.mark.parametrize(
    ("value", "fragment"),
    [("", "is empty"), (SECRET + "\r\nX-Evil: 1", "not allowed in an HTTP header"),
     (SECRET + " x", "not allowed in an HTTP header"), (SECRET + "é", "not allowed in an HTTP header")],
)
def test_engine_api_key_env_value_is_checked_but_never_shown(value: str, fragment: str) -> None:
    error = error_of(WITH_KEY_ENV, env={ENV_KEY: value})
    assert error.key == "engine.engine_api_key_env"
    assert fragment in str(error)
    if value:
        assert SECRET not in str(error) and SECRET not in repr(error) and SECRET not in error.line()
        assert SECRET not in error.body().decode()


def test_validate_runs_the_env_check_for_code_built_configs() -> None:
    config = Config(model=ModelConfig(name="m"), engine=EngineConfig(decode=[DECODE], engine_api_key_env=ENV_KEY))
    with pytest.raises(ConfigError) as info:
        validate(config, {})
    assert info.value.key == "engine.engine_api_key_env"
    validate(config, {ENV_KEY: SECRET})


@pytest.mark.parametrize("name", ["", "1ABC", "A-B", "A B"])
def test_engine_api_key_env_must_be_a_variable_name(name: str) -> None:
    assert error_of(with_values(engine={"engine_api_key_env": name})).key == "engine.engine_api_key_env"


# -- semantics: numbers -------------------------------------------------------------

POSITIVE_SECONDS = [
    (s, a.name) for s, a in all_keys()
    if a.type is float and a.name not in (
        "backoff_base_s", "backoff_max_s", "grace_s", "metrics_interval_s", "kv_speculative_ttl_s", "sample_ratio",
        "default_requests_per_s", "default_prompt_tokens_per_min",  # rates: 0 is no budget
    )
]


@pytest.mark.parametrize(("section", "name"), POSITIVE_SECONDS)
@pytest.mark.parametrize("value", [0, 0.0, -1.5])
def test_timeouts_are_positive(section: str, name: str, value: float) -> None:
    error = error_of(with_values(**{section: {name: value}}))
    assert str(error) == f"{section}.{name}: must be positive, got {float(value)!r}"


@pytest.mark.parametrize(
    ("section", "name"),
    [("retry", "backoff_base_s"), ("shutdown", "grace_s"), ("routing", "metrics_interval_s"), ("tracing", "sample_ratio")],
)
def test_zero_is_allowed_where_it_means_no_wait(section: str, name: str) -> None:
    config = config_from_dict(with_values(**{section: {name: 0}}), env={})
    assert getattr(getattr(config, section), name) == 0.0
    assert error_of(with_values(**{section: {name: -0.5}})).message.endswith("must not be negative, got -0.5")


MINIMUMS = {
    "ingress.max_body_bytes": 1, "ingress.max_header_bytes": 1, "ingress.max_headers": 1,
    "ingress.max_request_line_bytes": 1, "ingress.max_connections": 1,
    "engine.max_inflight_per_engine": 1, "engine.pool_connections_per_engine": 1,
    "engine.max_response_bytes": 1, "admission.max_inflight": 1, "admission.queue_size": 0,
    "admission.per_client_max_inflight": 0, "admission.retry_after_s": 0,
    "health.unhealthy_after": 1, "health.healthy_after": 1,
    "routing.disaggregate_min_uncached_tokens": 0, "routing.kv_capacity_tokens": 1,
    "routing.tokenize_inline_max_bytes": 0,
}


def test_minimums_table_covers_every_integer_key() -> None:
    ints = {f"{s}.{a.name}" for s, a in all_keys() if a.type is int}
    assert set(MINIMUMS) | {
        "retry.max_attempts", "ingress.max_buffered_bytes", "ingress.busy_poll_us",
        "ingress.max_batch_prompts",  # 1..1024: tests/core/test_router_prompts.py
        "discovery.port",  # 1..65535: tests/core/test_dynamic_fleet.py
        "routing.kv_block_size",  # 1..4096: tests/core/test_kv_policy.py
        "engine.data_parallel_size",  # 1..64: test_data_parallel_ranks_and_the_bound_kv_event_sockets
    } == ints


def test_max_buffered_bytes_is_at_least_max_body_bytes() -> None:
    data = with_values(ingress={"max_body_bytes": 1000, "max_buffered_bytes": 1000})
    assert config_from_dict(data, env={}).ingress.max_buffered_bytes == 1000
    error = error_of(with_values(ingress={"max_body_bytes": 1000, "max_buffered_bytes": 999}))
    assert str(error) == "ingress.max_buffered_bytes: must be at least ingress.max_body_bytes (1000), got 999"
    error = error_of(with_values(ingress={"max_buffered_bytes": 0}))
    assert str(error) == "ingress.max_buffered_bytes: must be at least 1, got 0"


@pytest.mark.parametrize("good", [0, 1, 200, 1000000])
def test_busy_poll_is_zero_to_one_second(good: int) -> None:
    assert config_from_dict(with_values(ingress={"busy_poll_us": good}), env={}).ingress.busy_poll_us == good


@pytest.mark.parametrize("bad", [-1, 1000001])
def test_busy_poll_out_of_range(bad: int) -> None:
    error = error_of(with_values(ingress={"busy_poll_us": bad}))
    assert str(error) == f"ingress.busy_poll_us: must be between 0 and 1000000, got {bad}"


@pytest.mark.parametrize("key", sorted(MINIMUMS))
def test_counts_have_a_minimum(key: str) -> None:
    section, name = key.split(".")
    low = MINIMUMS[key]
    config = config_from_dict(with_values(**{section: {name: low}}), env={})
    assert getattr(getattr(config, section), name) == low
    error = error_of(with_values(**{section: {name: low - 1}}))
    assert str(error) == f"{key}: must be at least {low}, got {low - 1}"


@pytest.mark.parametrize(("value", "ok"), [(0, False), (1, True), (100, True), (101, False), (-3, False)])
def test_retry_max_attempts_range(value: int, ok: bool) -> None:
    data = with_values(retry={"max_attempts": value})
    if ok:
        assert config_from_dict(data, env={}).retry.max_attempts == value
    else:
        assert str(error_of(data)) == f"retry.max_attempts: must be between 1 and 100, got {value}"


def test_backoff_max_is_at_least_backoff_base() -> None:
    error = error_of(with_values(retry={"backoff_base_s": 1, "backoff_max_s": 0.5}))
    assert str(error) == "retry.backoff_max_s: must be at least retry.backoff_base_s (1.0), got 0.5"


# -- semantics: enums and journal ---------------------------------------------------


@pytest.mark.parametrize(
    ("section", "name", "values"),
    [
        ("ingress", "auth", ["none", "api_keys", "trusted_header"]),
        ("engine", "protocol", ["vllm-nixl", "vllm-nixl-push"]),
        ("engine", "kv_release", ["decode_pull", "abort_endpoint", "decode_abort", "lease"]),
        ("journal", "fsync", ["always", "interval", "never"]),
        ("routing", "policy", ["least_loaded", "round_robin", "prefix", "kv"]),
        ("routing", "mode", ["always", "never", "auto"]),
        ("routing", "disaggregation", ["optional", "required"]),
    ],
)
def test_enums_accept_exactly_their_values(section: str, name: str, values: list[str]) -> None:
    field = getattr(attrs.fields(SECTIONS[section]), name)
    assert list(get_args(field.type)) == values
    error = error_of(with_values(**{section: {name: values[0].upper()}}))
    assert error.key == f"{section}.{name}"


def test_routing_table_parses_and_refuses_with_the_key() -> None:
    text = EXAMPLE + '\n[routing]\npolicy = "prefix"\nmode = "auto"\nmetrics_interval_s = 0\nprefill_tokens_per_s = 12000\n'
    routing = parse_config(text, env={"NARWHAL_ENGINE_API_KEY": SECRET}).routing
    assert routing == RoutingConfig(policy="prefix", mode="auto", metrics_interval_s=0.0, prefill_tokens_per_s=12000.0)
    assert str(error_of(with_values(routing={"policy": "cache_aware"}))) == (
        'routing.policy: must be one of "least_loaded", "round_robin", "prefix", "kv", got "cache_aware"'
    )
    assert str(error_of(with_values(routing={"mode": "sometimes"}))) == (
        'routing.mode: must be one of "always", "never", "auto", got "sometimes"'
    )
    assert str(error_of(with_values(routing={"prefill_tokens_per_s": -5}))) == (
        "routing.prefill_tokens_per_s: must be positive, got -5.0"
    )
    assert str(error_of(with_values(routing={"metrics_interval_s": -1}))) == (
        "routing.metrics_interval_s: must not be negative, got -1.0"
    )
    assert error_of(with_values(routing={"kv_capacity": 5})).key == "routing.kv_capacity"


def test_journal_path() -> None:
    assert config_from_dict(with_values(journal={"path": "-"}), env={}).journal.path == "-"
    assert error_of(with_values(journal={"path": ""})).key == "journal.path"


# -- configs built in code ----------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "key"),
    [
        (lambda: ModelConfig(name=""), "model.name"),
        (lambda: IngressConfig(listen="0.0.0.0:8000"), "ingress.auth"),
        (lambda: IngressConfig(max_body_bytes=True), "ingress.max_body_bytes"),
        (lambda: EngineConfig(decode=[]), "engine.decode"),
        (lambda: EngineConfig(decode="http://127.0.0.1:1"), "engine.decode"),  # type: ignore[arg-type]
        (lambda: EngineConfig(decode=["https://127.0.0.1:1"]), "engine.decode[0]"),
        (lambda: AdmissionConfig(queue_size=-1), "admission.queue_size"),
        (lambda: RetryConfig(max_attempts=1000), "retry.max_attempts"),
        (lambda: HealthConfig(probe_timeout_s=0), "health.probe_timeout_s"),
        (lambda: JournalConfig(fsync="sometimes"), "journal.fsync"),  # type: ignore[arg-type]
        (lambda: ShutdownConfig(grace_s=-1), "shutdown.grace_s"),
        (lambda: RoutingConfig(policy="fastest"), "routing.policy"),  # type: ignore[arg-type]
        (lambda: RoutingConfig(prefill_tokens_per_s=0), "routing.prefill_tokens_per_s"),
        (lambda: Config(model="m", engine=EngineConfig(decode=[DECODE])), "model"),  # type: ignore[arg-type]
    ],
)
def test_code_built_configs_are_validated(build: Any, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    assert info.value.key == key


def test_code_built_engine_config_derives_addresses() -> None:
    engine = EngineConfig(prefill=["http://10.0.0.1:8100/"], decode=[DECODE])
    assert engine.prefill == ("http://10.0.0.1:8100/",)
    assert engine.prefill_engines[0].url == "http://10.0.0.1:8100"
    assert engine.decode_engines[0].authority == b"127.0.0.1:8200"
    assert attrs.evolve(engine, decode=["http://10.0.0.2:1"]).decode_engines[0].host == "10.0.0.2"


# -- semantics: tenants -------------------------------------------------------------


TENANTS_TOML = """
[tenants]
bands = ["interactive", "batch"]
default_band = "batch"
default_weight = 2

[[tenants.tenant]]
name = "chat-frontend"
band = "interactive"
weight = 4

[[tenants.tenant]]
name = "nightly-eval"
"""


def test_tenants_absent_is_none_and_a_table_parses() -> None:
    assert config_from_dict(MINIMAL, env={}).tenants is None
    tenants = parse_config(EXAMPLE + TENANTS_TOML, env={"NARWHAL_ENGINE_API_KEY": SECRET}).tenants
    assert tenants is not None
    assert tenants.bands == ("interactive", "batch") and tenants.default_weight == 2.0
    assert [t.name for t in tenants.tenant] == ["chat-frontend", "nightly-eval"]
    # Each named client's band and weight; every other client: the defaults.
    assert tenants.band_and_weight("chat-frontend", None) == (0, 4.0)
    assert tenants.band_and_weight("nightly-eval", None) == (1, 2.0)
    assert tenants.band_and_weight("someone", None) == (1, 2.0)
    assert tenants.label("someone") == "(unnamed)" and tenants.label("nightly-eval") == "nightly-eval"


def test_the_priority_header_lowers_and_never_raises() -> None:
    tenants = TenantsConfig(bands=("a", "b", "c"), default_band="b", tenant=(TenantConfig(name="x", band="a"),))
    assert tenants.band_and_weight("x", b"c") == (2, 1.0)
    assert tenants.band_and_weight("y", b"a") == (1, 1.0)  # clamped to its own band, no error
    assert tenants.band_and_weight("y", b" c ") == (2, 1.0)
    for bad in (b"", b"urgent", b"0", b"\xff"):
        with pytest.raises(ContractError) as caught:
            tenants.band_and_weight("y", bad)
        assert (caught.value.status, caught.value.code, caught.value.param) == (400, "invalid_priority", None)


@pytest.mark.parametrize(("tenants", "message"), [
    ({"bands": []}, "tenants.bands: must name at least one band"),
    ({"bands": ["a", "a"]}, 'tenants.bands[1]: "a" repeats tenants.bands[0]'),
    ({"bands": ["a b"]}, "tenants.bands[0]: must be a band name"),
    ({"default_band": "z"}, 'tenants.default_band: must be one of tenants.bands, got "z"'),
    ({"default_weight": 0}, "tenants.default_weight: must be positive, got 0.0"),
    ({"tenant": [5]}, "tenants.tenant[0]: must be a table, got 5"),
    ({"tenant": [{"band": "default"}]}, "tenants.tenant[0].name: missing required key"),
    ({"tenant": [{"name": "x", "wieght": 2}]}, "tenants.tenant[0].wieght: unknown key"),
    ({"tenant": [{"name": "x"}, {"name": "y", "weight": -1}]}, "tenants.tenant[1].weight: must be positive, got -1.0"),
    ({"tenant": [{"name": "x", "band": "z"}]}, 'tenants.tenant[0].band: must be one of tenants.bands, got "z"'),
    ({"tenant": [{"name": "x"}, {"name": "x"}]}, 'tenants.tenant[1].name: "x" is named twice'),
    ({"tenant": [{"name": "(unnamed)"}]}, "tenants.tenant[0].name: \"(unnamed)\" is the label of the unnamed clients"),
])
def test_tenants_errors_name_the_key(tenants: dict[str, Any], message: str) -> None:
    assert str(error_of(with_values(tenants=tenants))).startswith(message)


def test_tenant_budgets_take_each_table_value_else_the_default() -> None:
    tenants = parse_config(EXAMPLE + """
[tenants]
default_requests_per_s = 2
default_prompt_tokens_per_min = 6000
default_max_inflight = 4

[[tenants.tenant]]
name = "batch"
requests_per_s = 0.5
max_inflight = 0

[[tenants.tenant]]
name = "free"
requests_per_s = 0
prompt_tokens_per_min = 0
""", env={"NARWHAL_ENGINE_API_KEY": SECRET}).tenants
    assert tenants is not None and tenants.rated
    assert tenants.budget("batch") == Budget(requests_per_s=0.5, prompt_tokens_per_min=6000.0, max_inflight=0)
    assert tenants.budget("free") == Budget(requests_per_s=0.0, prompt_tokens_per_min=0.0, max_inflight=4)
    assert not tenants.budget("free").rated
    assert tenants.budget("anyone") == Budget(requests_per_s=2.0, prompt_tokens_per_min=6000.0, max_inflight=4)
    # Without any rate, admission keeps no buckets: an in-flight limit alone is not a rate.
    assert not TenantsConfig(default_max_inflight=3).rated
    assert TenantsConfig().budget("x") == Budget(requests_per_s=0.0, prompt_tokens_per_min=0.0, max_inflight=None)


@pytest.mark.parametrize(("tenants", "message"), [
    ({"default_requests_per_s": -1}, "tenants.default_requests_per_s: must not be negative, got -1.0"),
    ({"default_prompt_tokens_per_min": 1e13}, "tenants.default_prompt_tokens_per_min: must be at most 1000000000000.0"),
    ({"default_max_inflight": -1}, "tenants.default_max_inflight: must be at least 0, got -1"),
    ({"tenant": [{"name": "x", "requests_per_s": "5"}]}, 'tenants.tenant[0].requests_per_s: must be a number, got "5"'),
    ({"tenant": [{"name": "x", "prompt_tokens_per_min": -5}]},
     "tenants.tenant[0].prompt_tokens_per_min: must not be negative, got -5.0"),
    ({"tenant": [{"name": "x"}, {"name": "y", "max_inflight": 1.5}]},
     "tenants.tenant[1].max_inflight: must be an integer, got 1.5"),
])
def test_tenant_budget_errors_name_the_key(tenants: dict[str, Any], message: str) -> None:
    assert str(error_of(with_values(tenants=tenants))).startswith(message)


# -- the converter ------------------------------------------------------------------


def test_global_cattrs_converter_is_untouched() -> None:
    config_from_dict(MINIMAL, env={})
    assert cattrs.structure("5", int) == 5  # the global converter still coerces


# -- documentation ------------------------------------------------------------------


def test_every_field_has_a_one_line_doc() -> None:
    classes = [*SECTIONS.values(), Config, EngineAddress]
    for cls in classes:
        for a in attrs.fields(cls):
            doc = a.metadata.get("doc")
            assert isinstance(doc, str) and doc and "\n" not in doc, f"{cls.__name__}.{a.name}"


def type_cell(annotation: object) -> str:
    if annotation is int:
        return "integer"
    if annotation == (int | None):
        return "integer, optional"
    if annotation is float:
        return "float"
    if annotation is str:
        return "string"
    if annotation == (str | None):
        return "string, optional"
    if annotation == tuple[str, ...]:
        return "array of strings"
    if annotation == tuple[TenantConfig, ...]:
        return "array of tables"
    if get_origin(annotation) is Literal:
        return "enum"
    if annotation == (int | Literal["auto"]):
        return 'integer or "auto"'
    raise AssertionError(annotation)


def default_cell(a: attrs.Attribute[Any]) -> str:
    if a.default is attrs.NOTHING:
        return "required"
    factory = getattr(a.default, "factory", None)
    default = factory() if callable(factory) else a.default
    if default is None:
        return "unset"
    if isinstance(default, tuple):
        return "`[" + ", ".join(f'"{item}"' for item in default) + "]`"
    if isinstance(default, str):
        return f'`"{default}"`'
    return f"`{default!r}`"


@pytest.mark.parametrize(("section", "name"), [(s, a.name) for s, a in all_keys()], ids=KEY_IDS)
def test_docs_list_every_key_with_type_and_default(section: str, name: str) -> None:
    attribute = getattr(attrs.fields(SECTIONS[section]), name)
    rows = [line for line in DOCS.read_text(encoding="utf-8").splitlines()
            if line.startswith(f"| `{section}.{name}` |")]
    assert len(rows) == 1, f"docs/configure.md must have one table row for {section}.{name}"
    cells = [c.strip() for c in rows[0].strip("|").split(" | ")]
    assert cells[1] == type_cell(attribute.type)
    assert cells[2] == default_cell(attribute)
    assert cells[3], "meaning missing"
    if get_origin(attribute.type) is Literal:
        for value in get_args(attribute.type):
            assert f"`{value}`" in cells[3]


def test_docs_have_no_stale_keys() -> None:
    documented = set(re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \|", DOCS.read_text(encoding="utf-8"), re.M))
    assert documented == set(KEY_IDS)
