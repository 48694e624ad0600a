"""The shape of a configuration: TOML tables into the section classes (docs/configure.md).

A private cattrs converter owns the shape -- tables, unknown keys
(``forbid_extra_keys``), missing required keys -- and passes every leaf value
through untouched, so the attrs validators of :mod:`narwhal_core.config` judge
it exactly as they judge a config built in code. When it fails, its error tree
is walked (:func:`translate`) to the first problem, which becomes one
:class:`ConfigError` naming the dotted key (``engine.decode[1]``) and, for an
unknown key, the known key it was probably meant to be.
"""

import difflib
from collections.abc import Callable, Mapping
from typing import Any, get_args

import attrs
import cattrs
from cattrs.errors import ForbiddenExtraKeysError
from cattrs.gen import make_dict_structure_fn

from .config_fields import describe
from .errors import ConfigError

__all__ = ["make_converter", "translate"]


class _NotATable(Exception):
    def __init__(self, value: object) -> None:
        super().__init__("not a table")
        self.value = value


def make_converter() -> cattrs.Converter:
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

    def optional_table_factory(optional: object) -> Callable[[object, object], object]:
        # A section that may be absent (``[tenants]``): ``X | None`` with X an attrs class.
        cls = next(arg for arg in get_args(optional) if attrs.has(arg))
        return table_factory(cls)

    converter.register_structure_hook_factory(_is_optional_table, optional_table_factory)
    return converter


def _is_optional_table(annotation: object) -> bool:
    args = get_args(annotation)
    return len(args) == 2 and type(None) in args and any(attrs.has(arg) for arg in args)


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


def translate(exc: BaseException, path: tuple[str | int, ...]) -> ConfigError:
    """The first problem in a cattrs error tree, as one ConfigError with a dotted key."""
    if isinstance(exc, ConfigError):
        return exc  # an attrs validator: its key is already the full path
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            return translate(sub, path + _step(sub))
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
        return ConfigError(_dotted(path) or "config", f"must be a table, got {describe(exc.value)}")
    return ConfigError(_dotted(path) or "config", f"invalid value ({type(exc).__name__}: {exc})")

