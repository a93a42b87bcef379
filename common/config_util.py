"""Strict construction of config dataclasses from plain mappings (YAML, JSON, kwargs).

Job: one ``from_dict(cls, data, where)`` that every config section uses, so
that a misspelt key is an error naming it and the keys that exist, never a
silently ignored setting or a bare ``TypeError``.

Lives in replica/ because both replica/ and router/ build configs with it and
imports point one way (router -> replica). Pure stdlib.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Collection, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def from_dict(cls: type[T], data: Mapping[str, Any] | None, where: str) -> T:
    """Build dataclass ``cls`` from ``data``; ``where`` names the section in messages.

    * Unknown keys: ValueError ``unknown {where} keys [...]; known keys: [...]``.
    * Missing keys without a default: ValueError naming them.
    * A field typed as another dataclass and given a mapping is built with
      this same function (``where`` becomes ``{where}.{field}``).
    * ``None`` stands for an empty mapping (a YAML section left blank).
    * A field typed ``bool`` (or ``bool | None``) given anything else: ValueError
      ``{where}.{field} must be true or false``.

    Values are otherwise passed as given; ``cls.__post_init__`` validates them.
    """
    if not dataclasses.is_dataclass(cls) or not isinstance(cls, type):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a mapping of keys to values, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        raise ValueError(f"unknown {where} keys {unknown}; known keys: {sorted(fields) or 'none'}")
    missing = sorted(
        name
        for name, f in fields.items()
        if name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    if missing:
        raise ValueError(f"{where} needs keys {missing}")
    hints = _type_hints(cls)
    values: dict[str, Any] = {}
    for name, value in data.items():
        nested = hints.get(name)
        if isinstance(nested, type) and dataclasses.is_dataclass(nested) and isinstance(value, Mapping):
            value = from_dict(nested, value, f"{where}.{name}")
        elif not _fits_switch(nested, value):
            raise ValueError(f"{where}.{name} must be true or false, got {value!r}")
        values[name] = value
    return cls(**values)


def check_switches(obj: Any) -> None:
    """Raise ValueError naming the first ``bool`` (or ``bool | None``) field of dataclass ``obj``
    that holds something else: a YAML or JSON typo ("maybe", "no", 1) is not a truthy switch."""
    hints = _type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not _fits_switch(hints.get(f.name), value):
            raise ValueError(f"{f.name} must be true or false, got {value!r}")


def _fits_switch(hint: Any, value: Any) -> bool:
    """False only when ``hint`` is ``bool`` (or ``bool | None``) and ``value`` is not one of those."""
    if hint is bool:
        return isinstance(value, bool)
    if hint == (bool | None):
        return value is None or isinstance(value, bool)
    return True


def _type_hints(cls: type) -> dict[str, Any]:
    # Annotations are strings under ``from __future__ import annotations``; a
    # hint that cannot be resolved only means that field is not built as nested.
    try:
        return typing.get_type_hints(cls)
    except Exception:
        return {}


def add_cli_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    title: str,
    choices: Mapping[str, tuple[str, ...]] | None = None,
    only: Collection[str] | None = None,
    dest_prefix: str = "",
) -> argparse._ArgumentGroup:
    """Add one ``--kebab-case`` option per field of dataclass ``cls`` to a group named ``title``; returns the group.

    Defaults come from the dataclass; a field's ``metadata["help"]`` is its help
    text, ``metadata["flag"]`` another option name, ``metadata["choices"]`` its
    values. Fields typed ``bool`` become ``--x/--no-x``, ``list[int]`` and ``tuple[int, ...]``
    take several values, ``list[str]`` repeat the option once per value (or, with ``metadata["several"]``,
    also take several values after one option, as vLLM's ``--lora-modules``); ``choices`` restricts a
    field's values by name; ``only`` limits the options to those fields. The option
    stores under ``dest_prefix`` + the field's name (no prefix: :func:`from_cli_args` finds it).
    """
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        dest = dest_prefix + f.name
        flag = f.metadata.get("flag", "--" + dest.replace("_", "-"))
        kind = _field_type(f.type)
        # A renamed option shows its own name in the usage line, not the field's.
        named = {"metavar": flag.lstrip("-").replace("-", "_").upper()} if "flag" in f.metadata else {}
        text = f"{f.metadata['help']} " if "help" in f.metadata else ""
        text += "(repeat for several)" if kind is tuple else f"(default: {default})"
        if kind is list:
            group.add_argument(flag, dest=dest, type=int, nargs="+", default=default, help=text)
        elif kind is tuple and f.metadata.get("several"):
            group.add_argument(flag, dest=dest, action="extend", nargs="+", default=None, help=text, **named)
        elif kind is tuple:
            group.add_argument(flag, dest=dest, action="append", default=None, help=text, **named)
        elif kind is bool:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            allowed = (choices or {}).get(f.name, f.metadata.get("choices"))
            group.add_argument(flag, dest=dest, type=kind, default=default, choices=allowed, help=text, **named)
    return group


def from_cli_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build dataclass ``cls`` from a namespace parsed with :func:`add_cli_arguments`.

    A repeatable option given no value leaves its field to the dataclass's default.
    """
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}  # type: ignore[arg-type]
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if values.get(f.name, 0) is None and f.default_factory is not dataclasses.MISSING:
            del values[f.name]
        elif _is_int_tuple(f.type) and isinstance(values.get(f.name), list):
            values[f.name] = tuple(values[f.name])
    return cls(**values)


def _is_int_tuple(annotation: object) -> bool:
    return str(annotation).replace(" ", "") == "tuple[int,...]"


def _field_type(annotation: object) -> type:
    """The scalar type of a field annotation written as a string (``int | None`` -> int)."""
    base = str(annotation).replace(" ", "").replace("|None", "")
    # list[str] -> tuple: the marker of a repeated option (one value per occurrence);
    # list[int] and tuple[int, ...] -> list: several values after one option
    kinds = {"int": int, "float": float, "bool": bool, "str": str, "list[int]": list, "tuple[int,...]": list}
    return {**kinds, "list[str]": tuple}[base]
