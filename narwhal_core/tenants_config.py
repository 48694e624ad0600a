"""``[tenants]``: priority bands and weights per client (docs/configure.md, ``[tenants]``).

A tenant is the client identity authentication gives a request
(:mod:`~narwhal_core.auth`): the name of an API key's entry, or what the
trusted proxy put in ``ingress.client_header``. Each ``[[tenants.tenant]]``
table gives one client its band, weight and budget; every other client is a
tenant of its own with the ``default_*`` values. Without a ``[tenants]``
section the admission queue is first come, first served and no client has
a budget (docs/operate.md, "Tenants").
"""

from collections.abc import Mapping
from typing import Any, ClassVar, Final

import attrs

from .config_fields import (
    as_str_tuple, describe, doc, float_in, int_in, non_empty, optional_string, set_derived, str_list, string,
    to_float,
)
from .errors import ConfigError, ContractError

__all__ = ["PRIORITY_HEADER", "UNNAMED", "Budget", "TenantConfig", "TenantsConfig"]

#: The header a request lowers its own band with (docs/operate.md, "Tenants").
PRIORITY_HEADER: Final = b"x-narwhal-priority"
#: The ``tenant`` label of the metrics of every client no ``[[tenants.tenant]]`` names.
UNNAMED: Final = "(unnamed)"
_KEY: Final = "tenants.tenant"


def _band_name(value: str) -> str | None:
    if not value or len(value) > 64 or not all(ch.isalnum() or ch in "-_." for ch in value):
        return f"must be a band name (1 to 64 letters, digits, '-', '_', '.'), got {describe(value)}"
    return None


def _optional_float(value: float | None) -> float | None:
    return None if value is None else to_float(value)


#: The largest rate a budget may set (requests per second, prompt tokens per minute).
_MAX_RATE: Final = 1e12


def _rate(text: str, *, optional: bool) -> Any:
    check = float_in(positive=False, maximum=_MAX_RATE)
    if optional:
        return attrs.field(default=None, converter=_optional_float, validator=attrs.validators.optional(check),
                           metadata=doc(text))
    return attrs.field(default=0.0, converter=to_float, validator=check, metadata=doc(text))


def _inflight(text: str) -> Any:
    return attrs.field(default=None, validator=attrs.validators.optional(int_in(0)), metadata=doc(text))


@attrs.frozen(kw_only=True)
class Budget:
    """One tenant's budget (docs/operate.md, "Tenants"), its tables' values and the defaults resolved."""

    #: Requests per second (0: no such budget).
    requests_per_s: float
    #: Estimated prompt tokens per minute (0: no such budget).
    prompt_tokens_per_min: float
    #: Requests admitted or queued at once (``None``: ``admission.per_client_max_inflight``; 0: unlimited).
    max_inflight: int | None

    @property
    def rated(self) -> bool:
        """Whether it limits a rate (requests or prompt tokens), not only what is in flight."""
        return self.requests_per_s > 0 or self.prompt_tokens_per_min > 0


@attrs.frozen(kw_only=True)
class TenantConfig:
    """One ``[[tenants.tenant]]`` table: a client's band and weight."""

    SECTION: ClassVar[str] = _KEY

    name: str = attrs.field(validator=string(non_empty), metadata=doc("The client ID, as authentication gives it."))
    band: str | None = attrs.field(
        default=None, validator=optional_string(_band_name),
        metadata=doc("Its band, one of tenants.bands (unset: tenants.default_band)."),
    )
    weight: float | None = attrs.field(
        default=None, converter=_optional_float,
        validator=attrs.validators.optional(float_in(positive=True, maximum=1e6)),
        metadata=doc("Its weight within its band (unset: tenants.default_weight)."),
    )
    requests_per_s: float | None = _rate("Its requests per second, 0 none (unset: tenants.default_requests_per_s).",
                                         optional=True)
    prompt_tokens_per_min: float | None = _rate(
        "Its prompt tokens per minute, 0 none (unset: tenants.default_prompt_tokens_per_min).", optional=True
    )
    max_inflight: int | None = _inflight("Its requests in flight, 0 unlimited (unset: tenants.default_max_inflight).")


def _tenant_tables(value: Any) -> Any:
    """The ``[[tenants.tenant]]`` tables, each as a :class:`TenantConfig`; a bad one is a ConfigError naming it."""
    if not isinstance(value, (list, tuple)):
        return value  # the validator refuses it, with the key
    known = {a.name for a in attrs.fields(TenantConfig)}
    out = []
    for i, table in enumerate(value):
        key = f"{_KEY}[{i}]"
        if isinstance(table, TenantConfig):
            out.append(table)
            continue
        if not isinstance(table, Mapping):
            raise ConfigError(key, f"must be a table, got {describe(table)}")
        for name in table:
            if name not in known:
                raise ConfigError(f"{key}.{name}", "unknown key")
        if "name" not in table:
            raise ConfigError(f"{key}.name", "missing required key")
        try:
            out.append(TenantConfig(**table))
        except ConfigError as exc:
            problem = exc.message.partition(": ")[2]
            raise ConfigError(exc.key.replace(_KEY, key, 1), problem) from None
    return tuple(out)


def _is_tenant_tuple(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
    if not isinstance(value, tuple):
        raise ConfigError(_KEY, f"must be an array of tables, got {describe(value)}")


@attrs.frozen(kw_only=True)
class TenantsConfig:
    """``[tenants]``: the priority bands, and each client's band and weight in them."""

    SECTION: ClassVar[str] = "tenants"

    bands: tuple[str, ...] = attrs.field(
        default=("default",), converter=as_str_tuple,
        validator=str_list(_band_name, non_empty="must name at least one band"),
        metadata=doc("The priority bands, highest first: a waiting request of a band is admitted before any below."),
    )
    default_band: str | None = attrs.field(
        default=None, validator=optional_string(_band_name),
        metadata=doc("The band of a client no [[tenants.tenant]] names (unset: the last, lowest, band)."),
    )
    default_weight: float = attrs.field(
        default=1.0, converter=to_float, validator=float_in(positive=True, maximum=1e6),
        metadata=doc("The weight of a client no [[tenants.tenant]] names, or one that sets none."),
    )
    tenant: tuple[TenantConfig, ...] = attrs.field(
        factory=tuple, converter=_tenant_tables, validator=_is_tenant_tuple,
        metadata=doc("One table per named client: name, band, weight and budget."),
    )
    default_requests_per_s: float = _rate("Each other client's requests per second (0: no such budget).",
                                          optional=False)
    default_prompt_tokens_per_min: float = _rate(
        "Each other client's estimated prompt tokens per minute (0: no such budget).", optional=False
    )
    default_max_inflight: int | None = _inflight(
        "Each other client's requests in flight, 0 unlimited (unset: admission.per_client_max_inflight)."
    )

    #: Band name -> its position, 0 the highest.
    band_index: Mapping[str, int] = attrs.field(init=False, eq=False, repr=False, metadata=doc("bands, by name."))
    #: Named client -> (band position, weight).
    named: Mapping[str, tuple[int, float]] = attrs.field(
        init=False, eq=False, repr=False, metadata=doc("Each named client's band position and weight.")
    )
    #: The band position of every other client.
    default_position: int = attrs.field(init=False, eq=False, repr=False, metadata=doc("default_band's position."))
    #: Named client -> its budget; and every other client's.
    budgets: Mapping[str, Budget] = attrs.field(init=False, eq=False, repr=False,
                                                metadata=doc("Each named client's budget."))
    default_budget: Budget = attrs.field(init=False, eq=False, repr=False, metadata=doc("Every other client's budget."))
    #: Whether any client has a rate budget (else the router keeps no buckets).
    rated: bool = attrs.field(init=False, eq=False, repr=False, metadata=doc("Whether any budget limits a rate."))

    def __attrs_post_init__(self) -> None:
        index: dict[str, int] = {}
        for i, name in enumerate(self.bands):
            if name in index:
                raise ConfigError(f"tenants.bands[{i}]", f"{describe(name)} repeats tenants.bands[{index[name]}]")
            index[name] = i
        if self.default_band is not None and self.default_band not in index:
            raise ConfigError("tenants.default_band", f"must be one of tenants.bands, got {describe(self.default_band)}")
        default = len(self.bands) - 1 if self.default_band is None else index[self.default_band]
        named: dict[str, tuple[int, float]] = {}
        for i, entry in enumerate(self.tenant):
            if entry.name == UNNAMED:
                raise ConfigError(f"{_KEY}[{i}].name", f"{describe(UNNAMED)} is the label of the unnamed clients")
            if entry.name in named:
                raise ConfigError(f"{_KEY}[{i}].name", f"{describe(entry.name)} is named twice")
            if entry.band is not None and entry.band not in index:
                raise ConfigError(f"{_KEY}[{i}].band", f"must be one of tenants.bands, got {describe(entry.band)}")
            band = default if entry.band is None else index[entry.band]
            named[entry.name] = (band, self.default_weight if entry.weight is None else entry.weight)
        fallback = Budget(
            requests_per_s=self.default_requests_per_s, prompt_tokens_per_min=self.default_prompt_tokens_per_min,
            max_inflight=self.default_max_inflight,
        )
        budgets = {entry.name: _budget(entry, fallback) for entry in self.tenant}
        set_derived(self, "band_index", index)
        set_derived(self, "named", named)
        set_derived(self, "default_position", default)
        set_derived(self, "budgets", budgets)
        set_derived(self, "default_budget", fallback)
        set_derived(self, "rated", fallback.rated or any(b.rated for b in budgets.values()))

    def band_and_weight(self, client: str, priority: bytes | None) -> tuple[int, float]:
        """The band position (0 the highest) and weight a request of ``client`` is queued with.

        ``priority`` is its ``x-narwhal-priority`` header: a band name, which
        may lower the request's band, never raise it (a higher band than the
        client's own is taken as its own). A value that names no band is a
        400 ``invalid_priority``.
        """
        band, weight = self.named.get(client) or (self.default_position, self.default_weight)
        if priority is None:
            return band, weight
        asked = self.band_index.get(priority.strip(b" \t").decode("latin-1"))
        if asked is None:
            raise ContractError(
                f"The {PRIORITY_HEADER.decode()} header must name one of the bands: {', '.join(self.bands)}.",
                status=400, param=None, code="invalid_priority",
            )
        return max(band, asked), weight

    def budget(self, client: str) -> Budget:
        """``client``'s budget: its table's, or the defaults'."""
        return self.budgets.get(client) or self.default_budget

    def label(self, client: str) -> str:
        """The ``tenant`` label of ``client``'s metrics: its name if a table names it, else :data:`UNNAMED`."""
        return client if client in self.named else UNNAMED


def _budget(entry: TenantConfig, fallback: Budget) -> Budget:
    """A named client's budget: each value its table sets, else the default's."""
    return Budget(
        requests_per_s=fallback.requests_per_s if entry.requests_per_s is None else entry.requests_per_s,
        prompt_tokens_per_min=(
            fallback.prompt_tokens_per_min if entry.prompt_tokens_per_min is None else entry.prompt_tokens_per_min
        ),
        max_inflight=fallback.max_inflight if entry.max_inflight is None else entry.max_inflight,
    )
