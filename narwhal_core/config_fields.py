"""The building blocks of the configuration's fields (docs/configure.md).

The section classes of :mod:`narwhal_core.config` are made of these: the attrs
validators that check a value's type first and then its range, the converters
that run before them (``5`` to ``5.0``, a list to a tuple), the field
constructors for the many plain numeric fields, and the checks on single
strings. Every failure is a :class:`ConfigError` naming the dotted key
(``section.field``, ``section.field[i]``), the value shown as an operator
would write it in TOML (:func:`describe`).

The checks of hosts, addresses and networks are in :mod:`narwhal_core.addresses`.
"""

import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, cast, get_args

import attrs

from .errors import ConfigError

__all__ = [
    "Validator",
    "describe",
    "int_in",
    "float_in",
    "to_float",
    "string",
    "optional_string",
    "one_of",
    "as_str_tuple",
    "str_list",
    "section",
    "doc",
    "count",
    "seconds",
    "non_empty",
    "printable_path",
    "header_name",
    "env_name",
    "journal_path",
    "lower",
    "set_derived",
]

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HTTP_PATH = re.compile(r"/[\x21-\x7e]*")
_HTTP_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


# -- describing values in messages -------------------------------------------------


def describe(value: object) -> str:
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


def int_in(minimum: int, maximum: int | None = None) -> Validator:
    def check(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        key = _key(instance, attribute)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(key, f"must be an integer, got {describe(value)}")
        if maximum is not None and not minimum <= value <= maximum:
            raise ConfigError(key, f"must be between {minimum} and {maximum}, got {value}")
        if value < minimum:
            raise ConfigError(key, f"must be at least {minimum}, got {value}")

    return check


def float_in(*, positive: bool, maximum: float | None = None) -> Validator:
    def check(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        key = _key(instance, attribute)
        if not isinstance(value, float):
            raise ConfigError(key, f"must be a number, got {describe(value)}")
        if not math.isfinite(value):
            raise ConfigError(key, f"must be a finite number, got {describe(value)}")
        if positive and value <= 0:
            raise ConfigError(key, f"must be positive, got {value!r}")
        if value < 0:
            raise ConfigError(key, f"must not be negative, got {value!r}")
        if maximum is not None and value > maximum:
            raise ConfigError(key, f"must be at most {maximum!r}, got {value!r}")

    return check


def to_float(value: float) -> float:
    # TOML ``timeout = 5`` is an integer; a float field takes it. Anything else
    # (bools included) is left for the validator to refuse with a message.
    if _is_int(value):
        return float(value)
    return value


def string(check: Callable[[str], str | None] | None = None) -> Validator:
    """A string validator; ``check`` returns a problem or None."""

    def check_value(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        key = _key(instance, attribute)
        if not isinstance(value, str):
            raise ConfigError(key, f"must be a string, got {describe(value)}")
        if check is not None:
            problem = check(value)
            if problem is not None:
                raise ConfigError(key, problem)

    return check_value


def optional_string(check: Callable[[str], str | None]) -> Validator:
    inner = string(check)

    def check_value(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        if value is not None:
            inner(instance, attribute, value)

    return check_value


def one_of(choices: object) -> Validator:
    values: tuple[str, ...] = get_args(choices)
    listed = ", ".join(json.dumps(v) for v in values)

    def check(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        if not isinstance(value, str) or value not in values:
            raise ConfigError(_key(instance, attribute), f"must be one of {listed}, got {describe(value)}")

    return check


def as_str_tuple(value: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    # Lists become tuples so the value is truly immutable and hashable. A
    # non-list is passed through untouched for the validator to refuse with
    # the key's name (a TOML string must never become a tuple of characters).
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return cast("tuple[str, ...]", value)


def str_list(
    check: Callable[[str], str | None] | None = None, *, non_empty: str | None = None
) -> Validator:
    """A list-of-strings validator; ``check`` vets each element, ``non_empty`` is the message for []."""

    def check_value(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        key = _key(instance, attribute)
        if not isinstance(value, tuple):
            raise ConfigError(key, f"must be a list of strings, got {describe(value)}")
        if non_empty is not None and not value:
            raise ConfigError(key, non_empty)
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise ConfigError(f"{key}[{i}]", f"must be a string, got {describe(item)}")
            if check is not None:
                problem = check(item)
                if problem is not None:
                    raise ConfigError(f"{key}[{i}]", problem)

    return check_value


def doc(text: str) -> dict[str, str]:
    return {"doc": text}


# Field constructors for the many plain numeric fields. The mypy attrs plugin
# sees ``x: int = count(...)`` as a field with a default, which it is.


def count(default: int, text: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    return attrs.field(default=default, validator=int_in(minimum, maximum), metadata=doc(text))


def seconds(default: float, text: str, *, positive: bool = True) -> float:
    return attrs.field(
        default=default, converter=to_float, validator=float_in(positive=positive), metadata=doc(text)
    )


def section(cls: type) -> Validator:
    def check(instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        if not isinstance(value, cls):
            raise ConfigError(attribute.name, f"must be a {cls.__name__}, got {describe(value)}")

    return check


# -- checks on single strings (return a problem or None) ----------------------------


def non_empty(value: str) -> str | None:
    return "must not be empty" if not value else None


def printable_path(value: str) -> str | None:
    if not _HTTP_PATH.fullmatch(value):
        return f"must be a path starting with / (printable ASCII, no spaces), got {describe(value)}"
    return None


def header_name(value: str) -> str | None:
    if not _HTTP_TOKEN.fullmatch(value):
        return f"must be an HTTP header name, got {describe(value)}"
    return None


def env_name(value: str) -> str | None:
    if not _ENV_NAME.fullmatch(value):
        return f"must be an environment variable name (letters, digits, _), got {describe(value)}"
    return None


def journal_path(value: str) -> str | None:
    if not value:
        return 'must not be empty (use "-" for stdout)'
    if "\x00" in value:
        return "must not contain NUL"
    return None


# -- converters and derived fields -------------------------------------------------


def lower(value: str) -> str:
    return value.lower() if isinstance(value, str) else value


def set_derived(instance: object, name: str, value: object) -> None:
    # Derived fields of a frozen class are computed once, at construction.
    object.__setattr__(instance, name, value)
