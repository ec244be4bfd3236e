"""Typed settings from YAML (or a dict) into a frozen dataclass, with errors that say what to write.

Why a helper and not ``cls(**yaml.safe_load(f))``: that accepts ``lr: "1e-3"`` (a string) and a
misspelt key fails with a bare ``TypeError`` deep in a run, or not at all. Here every mistake fails
before anything starts, with one message shape, the same as the loader's own settings::

    configs/train_unet.yaml: epochs=-1 is not allowed: an int >= 1

The dataclass stays the single source of truth: its type hints give the types, and ``setting()`` adds
what a type cannot say (a range, a rule) as field metadata. Call ``validate(self)`` from
``__post_init__`` so that building the dataclass in Python is checked the same way.

    @dataclass(frozen=True)
    class Cfg:
        lr: float = setting(1e-3, "a number > 0", lambda v: v > 0)
        mode: Literal["a", "b"] = "a"

        def __post_init__(self) -> None:
            validate(self)

    cfg = load_config("cfg.yaml", Cfg, overrides=parse_overrides(["lr=0.01"]))
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import yaml

from ..errors import ConfigError

__all__ = ["ConfigError", "check", "load_config", "parse_overrides", "setting", "validate"]

T = TypeVar("T")


def check(name: str, value: Any, ok: bool, allowed: str) -> None:
    """Raise ``ConfigError("name=value is not allowed: allowed")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{name}={value!r} is not allowed: {allowed}")


def setting(default: Any, allowed: str | None = None, ok: Callable[[Any], bool] | None = None, *, doc: str = "") -> Any:
    """A dataclass field with a rule: ``ok(value)`` must hold, ``allowed`` says so in words (and replaces
    the type's own description in every message about this field, type errors included)."""
    return dataclasses.field(default=default, metadata={"allowed": allowed, "ok": ok, "doc": doc})


def _describe(tp: Any) -> str:
    """What a type accepts, in the words an error message needs."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if tp is type(None):
        return "null"
    if tp is bool:
        return "true or false"
    if tp in (int, float, str):
        return {int: "an int", float: "a number", str: "a string"}[tp]
    if origin in (tuple, list):
        return f"a list of {_describe(args[0])}" if args else "a list"
    return f"a {getattr(tp, '__name__', tp)}"


def _matches(value: Any, tp: Any) -> bool:
    """Does ``value`` have type ``tp``? (bool is not an int here; an int is a fine float.)"""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (tuple, list):
        if not isinstance(value, origin):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args, strict=True))
        return not args or all(_matches(v, args[0]) for v in value)
    return isinstance(value, origin or tp)


def validate(obj: Any) -> None:
    """Check every field of dataclass instance ``obj`` against its type and its ``setting`` rule."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        allowed = f.metadata.get("allowed") or _describe(hints[f.name])
        check(f.name, value, _matches(value, hints[f.name]), allowed)
        ok = f.metadata.get("ok")
        if ok is not None:
            check(f.name, value, bool(ok(value)), allowed)


def parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """``["lr=0.01", "loader=sync"]`` → ``{"lr": 0.01, "loader": "sync"}``; values are read as YAML, so
    numbers, ``true``/``false`` and ``null`` mean what they do in the file."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        check("--set", pair, bool(sep and key.strip()), "KEY=VALUE, e.g. --set epochs=3")
        try:
            out[key.strip()] = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {pair!r} is not allowed: the value is not valid YAML ({exc})") from None
    return out


def _coerce(value: Any, tp: Any) -> Any:
    """The two conversions YAML needs: an int where a float is expected, a list where a tuple is."""
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typing.get_origin(tp) is tuple and isinstance(value, list):
        return tuple(value)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and value is not None:
        for a in typing.get_args(tp):
            if a is not type(None):
                return _coerce(value, a)
    return value


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | None,
    cls: type[T],
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Build frozen dataclass ``cls`` from a YAML file, a mapping or ``None`` (all defaults), with
    ``overrides`` applied on top. Raises ``ConfigError`` naming the file, the key, the value and what is
    allowed for an unknown key, a wrong type or a value a rule forbids."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"load_config needs a dataclass type, got {cls!r}")
    if source is None:
        where, data = cls.__name__, {}
    elif isinstance(source, Mapping):
        where, data = cls.__name__, dict(source)
    else:
        where = os.fspath(source)
        with open(where, encoding="utf-8") as f:
            data = yaml.safe_load(f)
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"{where}: the file holds a {type(data).__name__}, but a mapping of key: value is required"
            )
        data = dict(data)
    data.update(overrides or {})
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    try:
        for name, fld in fields.items():
            if name not in data and fld.default is dataclasses.MISSING and fld.default_factory is dataclasses.MISSING:
                raise ConfigError(
                    f"{name} is missing: {fld.metadata.get('allowed') or _describe(hints[name])} is required"
                )
        for key, value in data.items():
            if key not in fields:
                near = difflib.get_close_matches(str(key), fields, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                check(str(key), value, False, f"unknown key{hint}; known keys: {', '.join(fields)}")
            data[key] = _coerce(value, hints[key])
        obj = cls(**data)
        validate(obj)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return obj
