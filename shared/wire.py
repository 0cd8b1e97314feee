"""msgpack encoding of the explicit schema classes in `shared.schemas` (and core dataclasses).

A schema class is a dataclass; `encode` turns it into a msgpack map and `decode` rebuilds it from
its type hints, checking types on the way, so a malformed or foreign message raises `WireError`
instead of travelling on as a half-built object.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from functools import cache
from typing import Any, TypeVar

import msgpack

T = TypeVar("T")


class WireError(ValueError):
    """A message could not be decoded into the schema class it claims to be."""


# Types msgpack packs as they are. Checked with `type(x) in`, so subclasses (an IntEnum, say)
# still go through `to_plain` and come out as their value.
_PLAIN_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


def to_plain(obj: Any) -> Any:
    """Dataclasses/enums/tuples -> plain dicts, lists and scalars."""
    if isinstance(obj, (list, tuple)) and all(type(x) in _PLAIN_SCALARS for x in obj):
        # The common long list (a prompt's token ids) needs no per-item call: a 1,024-token
        # prompt cost ~0.5 ms per message through the recursion below.
        return list(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


def encode(obj: Any) -> bytes:
    return msgpack.packb(to_plain(obj), use_bin_type=True)


def decode(cls: type[T], data: bytes) -> T:
    try:
        plain = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise WireError(f"not msgpack: {exc}") from exc
    return from_plain(cls, plain)


# Item types whose check is an exact type match (float is not: it takes ints and converts them).
_EXACT_ITEMS = frozenset({int, str, bool, bytes})


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_plain(tp: Any, value: Any, where: str = "$") -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return from_plain(arg, value, where)
            except WireError as exc:
                errors.append(str(exc))
        raise WireError(f"{where}: no variant of {tp} matched ({'; '.join(errors)})")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise WireError(f"{where}: expected a map for {tp.__name__}, got {type(value).__name__}")
        hints = _hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kwargs[f.name] = from_plain(hints[f.name], value[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise WireError(f"{where}: missing field {f.name!r} of {tp.__name__}")
        return tp(**kwargs)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError as exc:
            raise WireError(f"{where}: {value!r} is not a {tp.__name__}") from exc
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise WireError(f"{where}: expected a list, got {type(value).__name__}")
        args = typing.get_args(tp)
        item = args[0] if args else Any
        if item in _EXACT_ITEMS and all(type(v) is item for v in value):
            # Every item already is what the hint asks (`type(v) is int` leaves bools out, as
            # the per-item check does); a long list skips one call and one f-string per item.
            return tuple(value) if origin is tuple else list(value)
        items = [from_plain(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise WireError(f"{where}: expected a map, got {type(value).__name__}")
        kt, vt = typing.get_args(tp) or (Any, Any)
        return {from_plain(kt, k, where): from_plain(vt, v, f"{where}[{k!r}]") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WireError(f"{where}: expected a number, got {type(value).__name__}")
        return float(value)
    if tp in (int, str, bool, bytes):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise WireError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    raise WireError(f"{where}: unsupported schema type {tp!r}")
