"""Config dataclasses as the one source of their checks, YAML/JSON keys and CLI flags.

`knob` gives a field its help, choices, bounds and flag spelling (field metadata). Then:
`check` (each `__post_init__`) validates every field, naming it; `from_dict` reads YAML/JSON
into nested dataclasses, an unknown key an error naming the closest valid one; the *flat view*
(`flat_fields`, `from_flat`, `with_fields_of`) lifts a nested config's fields into its parent
behind the field's `prefix` (EngineConfig reads as block_size, threads, kv_host_bytes, ...);
`add_flags` / `flag_values` give one argparse flag per flat field (`--block-size`).

Not pydantic: it would still need the argparse derivation and the difflib hints, its lax mode
turns "1" into 1 where these configs reject it, and its multi-line errors need reformatting.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import operator
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from typing import Any, NoReturn


def knob(default: Any, help: str = "", **meta: Any) -> Any:
    """A config field. `meta` keys: choices, ge, gt, le, lt, pattern=(regex, description),
    parse (flag text -> value), flag (the flag's name when not the field's), prefix (for a
    nested config: its fields' flat names start with it), cli=False (no flag), repr=False."""
    return field(default=default, repr=meta.pop("repr", True), metadata={"help": help, **meta})


def same_as(cls: type, name: str) -> Any:
    """A copy of `cls`'s flat field `name`, default and metadata (one knob, two places)."""
    f = flat_fields(cls)[name].field
    return field(default=f.default, repr=f.repr, metadata=f.metadata)


def suggest(word: Any, valid: Any, prefix: str = "") -> str:
    """ " (did you mean 'x'?)" for the valid word closest to `word`, or ""."""
    close = difflib.get_close_matches(str(word), [str(v) for v in valid], n=1)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


hints = functools.cache(typing.get_type_hints)


def check(config: Any, prefix: str = "") -> None:
    """Validates every field of `config` from its type and metadata; `prefix` leads the
    field's name in messages ("kvstore." -> "kvstore.host_bytes must be >= 0, got -1")."""
    for f in fields(config):
        name, value = prefix + f.name, getattr(config, f.name)
        coerced = _typed(name, value, hints(type(config))[f.name])
        if coerced is not value:
            object.__setattr__(config, f.name, coerced)
        if coerced is not None:
            _check_meta(name, coerced, f.metadata)


def _options(hint: Any) -> tuple:
    """(int, NoneType) for `int | None`, (int,) for `int`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _scalar(hint: Any) -> Any:
    return next(o for o in _options(hint) if o is not type(None))


_DESCRIBE = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _typed(name: str, value: Any, hint: Any) -> Any:
    """`value` if it is a `hint` (a list for a tuple becomes a tuple), else ValueError."""
    if value is None and type(None) in _options(hint):
        return None
    hint = _scalar(hint)
    origin = typing.get_origin(hint) or hint
    if hint is Any:
        return value
    if origin is tuple and isinstance(value, (list, tuple)):
        args = typing.get_args(hint)
        element = args[0] if len(args) == 2 and args[1] is Ellipsis else Any
        return tuple(_typed(f"{name}[{i}]", v, element) for i, v in enumerate(value))
    if is_dataclass(hint) and isinstance(value, Mapping):
        return from_dict(hint, value, path=f"{name}.")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, origin) and not (origin is int and isinstance(value, bool)):
        return value
    what = "a list" if origin is tuple else "a mapping" if is_dataclass(hint) else None
    what = what or _DESCRIBE.get(hint, f"a {getattr(hint, '__name__', hint)}")
    raise ValueError(f"{name} must be {what}, got {value!r:.80}")


def _check_meta(name: str, value: Any, meta: Mapping[str, Any]) -> None:
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(
            f"{name} must be one of {tuple(choices)}, got {value!r}{suggest(value, choices)}"
        )
    pattern = meta.get("pattern")
    if pattern is not None and not re.fullmatch(pattern[0], value):
        raise ValueError(f"{name} must be {pattern[1]}, got {value!r}")
    for key, (within, sign) in _BOUNDS.items():
        if key in meta and not within(value, meta[key]):
            raise ValueError(f"{name} must be {sign} {meta[key]}, got {value!r}")


_BOUNDS = {
    "ge": (operator.ge, ">="),
    "gt": (operator.gt, ">"),
    "le": (operator.le, "<="),
    "lt": (operator.lt, "<"),
}


def from_dict(cls: type, data: Any, where: str | None = None, path: str = "") -> Any:
    """`cls` from a mapping; nested mappings become the nested dataclasses. Errors name the
    key's dotted path, after `where` (e.g. the file) when given."""
    lead = f"{where}: " if where else ""
    if not isinstance(data, Mapping):
        raise ValueError(
            f"{lead}{path.rstrip('.') or 'the config'} must be a mapping, got {data!r:.80}"
        )
    names = [f.name for f in fields(cls) if f.init]
    for key in data:
        if key not in names:
            within = f" in {where}" if where else ""
            raise ValueError(f"unknown key '{path}{key}'{within}{suggest(key, names, path)}")
    kwargs = {}
    for key, value in data.items():
        sub = _scalar(hints(cls)[key])  # Role for `Role | None`
        if is_dataclass(sub) and isinstance(value, Mapping):
            value = from_dict(sub, value, where, f"{path}{key}.")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise ValueError(f"{lead}{path}{exc}") from None


@dataclass(frozen=True)
class FlatField:
    path: tuple[str, ...]  # field names from the root config down to this field
    field: Field
    hint: Any

    @property
    def scalar(self) -> Any:  # `int` for `int | None`
        return _scalar(self.hint)

    @property
    def flaggable(self) -> bool:  # a scalar, or a tuple of scalars (a repeatable flag)
        scalar = (typing.get_args(self.scalar) or (None,))[0] if self.repeated else self.scalar
        return self.field.metadata.get("cli", True) and scalar in (bool, int, float, str)

    @property
    def repeated(self) -> bool:
        return typing.get_origin(self.scalar) is tuple


@functools.cache
def flat_fields(cls: type) -> dict[str, FlatField]:
    """Flat name -> field, nested configs (not `X | None` ones) expanded behind their prefix."""
    flat: dict[str, FlatField] = {}
    for f in fields(cls):
        hint = hints(cls)[f.name]
        if is_dataclass(hint):
            for name, sub in flat_fields(hint).items():
                prefixed = f.metadata.get("prefix", "") + name
                flat[prefixed] = FlatField((f.name, *sub.path), sub.field, sub.hint)
        else:
            flat[f.name] = FlatField((f.name,), f, hint)
    return flat


def nest(cls: type, values: Mapping[str, Any], into: dict | None = None) -> dict[str, Any]:
    """Flat names into the nested mapping `from_dict` takes (`into`, updated, or a new one);
    an unknown name is an error."""
    flat = flat_fields(cls)
    nested: dict[str, Any] = {} if into is None else into
    for name, value in values.items():
        if name not in flat:
            raise ValueError(f"unknown argument {name!r}{suggest(name, flat)}")
        *parents, leaf = flat[name].path
        node = nested
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return nested


def from_flat(cls: type, values: Mapping[str, Any]) -> Any:
    """`cls` from flat names: `from_flat(EngineConfig, {"block_size": 32, "threads": 1})`."""
    return from_dict(cls, nest(cls, values))


def with_fields_of(*parts: type, skip: tuple[str, ...] = ()):
    """Decorator: a frozen dataclass with its own fields, then the flat fields of `parts`
    (their defaults, help and checks), leaving out `skip`."""

    def wrap(cls: type) -> type:
        annotations = cls.__dict__.get("__annotations__", {})
        for part in parts:
            for name, flat in flat_fields(part).items():
                if name in skip or name in annotations:
                    continue
                annotations[name] = flat.hint
                setattr(cls, name, same_as(part, name))
        cls.__annotations__ = annotations
        return dataclass(frozen=True)(cls)

    return wrap


class OneLineArgumentParser(argparse.ArgumentParser):
    """Reports a bad flag as one line (no usage dump), then exits 2 like argparse."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments: "):
            message += suggest(message.split()[2], _option_strings(self))
        self.exit(2, f"{self.prog}: error: {message}\n")


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of `parser` and its subcommands (argparse reports unknown ones at the top)."""
    found = []
    for action in parser._actions:
        found += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _option_strings(sub)
    return found


def parse_bytes(text: str) -> int:
    """'512MiB', '2GB', '1048576' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    lowered = text.strip().lower()
    try:
        for unit, factor in units.items():
            if lowered.endswith(unit):
                return int(float(lowered[: -len(unit)]) * factor)
        return int(lowered)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GB)") from None


def _flag_type(flat: FlatField) -> Any:
    meta = flat.field.metadata
    parse, choices = meta.get("parse", flat.scalar), meta.get("choices")
    if choices is None:
        return parse

    def choice(text: str) -> Any:
        if (value := parse(text)) not in choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice {text!r} (choose from {', '.join(map(str, choices))})"
                + suggest(text, choices)
            )
        return value

    return choice


def add_flags(
    parser: argparse.ArgumentParser | Any, cls: type, dest_prefix: str = "", **defaults: Any
) -> None:
    """One flag per flaggable flat field of `cls`; a flag not given is absent from the args,
    unless `defaults` (by flat name) gives it a value other than the dataclass's."""
    for name, flat in flat_fields(cls).items():
        if not flat.flaggable:
            continue
        meta = flat.field.metadata
        default = defaults.get(name, flat.field.default)
        hidden = default in (None, MISSING, (), []) or flat.hint is bool
        shown = "" if hidden else f" (default: {default})"
        kwargs: dict[str, Any] = dict(
            dest=dest_prefix + name,
            default=defaults.get(name, argparse.SUPPRESS),
            help=meta.get("help", "") + shown,
        )
        if flat.hint is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["help"] += f" (default: {'on' if default else 'off'})"
        elif flat.repeated and "parse" not in meta:
            kwargs.update(action="append", type=typing.get_args(flat.scalar)[0])
            kwargs["metavar"] = name.upper()
            kwargs["help"] += " (repeatable)"
        else:
            kwargs["type"] = _flag_type(flat)
            choices = meta.get("choices")
            kwargs["metavar"] = "{" + ",".join(map(str, choices)) + "}" if choices else name.upper()
        parser.add_argument("--" + meta.get("flag", name).replace("_", "-"), **kwargs)


def flag_values(args: argparse.Namespace, cls: type, dest_prefix: str = "") -> dict[str, Any]:
    """The flat values of the flags `add_flags(..., cls, dest_prefix)` that were given."""
    given = vars(args)
    flat = flat_fields(cls).items()
    return {n: given[dest_prefix + n] for n, f in flat if f.flaggable and dest_prefix + n in given}
