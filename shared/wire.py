"""msgpack encoding of the explicit schema classes in `shared.schemas` (and core dataclasses).

A schema class is a dataclass; `encode` turns it into a msgpack map and `decode` rebuilds it from
its type hints, checking types on the way, so a malformed or foreign message raises `WireError`
instead of travelling on as a half-built object.

Every message of the request path goes through here several times (the request, the node's
admit command, its reply with the node's snapshot, the snapshots the placer reads each turn), so
both directions are compiled once per class: an encoder per dataclass that knows its field names,
and a decoder per type hint that knows its checks. The decoder only accepts; when it meets
anything it does not accept, the reference walk (`_reference`) decodes the value again and says
where it is wrong, so an error reads the same either way (tests/test_wire.py holds the two to
the same answers).
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
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
    kind = type(obj)
    if kind in _PLAIN_SCALARS:
        return obj
    plain = _TO_PLAIN.get(kind)
    if plain is None:
        plain = _TO_PLAIN[kind] = _to_plain_for(kind)
    return plain(obj)


# type -> its to_plain; the choice depends on the type alone, so it is made once per type.
_TO_PLAIN: dict[type, Callable[[Any], Any]] = {}


def _to_plain_for(kind: type) -> Callable[[Any], Any]:
    if issubclass(kind, (list, tuple)):
        return _sequence_to_plain
    if dataclasses.is_dataclass(kind):
        names = tuple(f.name for f in dataclasses.fields(kind))

        def dataclass_to_plain(obj: Any) -> dict[str, Any]:
            out = {}
            for name in names:
                value = getattr(obj, name)
                out[name] = value if type(value) in _PLAIN_SCALARS else to_plain(value)
            return out
        return dataclass_to_plain
    if issubclass(kind, enum.Enum):
        return _enum_value
    if issubclass(kind, dict):
        return lambda obj: {k: to_plain(v) for k, v in obj.items()}
    return _unchanged


def _sequence_to_plain(obj: list | tuple) -> list:
    if _PLAIN_SCALARS.issuperset(map(type, obj)):
        # The common long list (a prompt's token ids) needs no per-item call (a 1,024-token
        # prompt cost ~0.5 ms per message through the per-item path), and its check runs in C.
        return list(obj)
    return [to_plain(x) for x in obj]


def _enum_value(obj: enum.Enum) -> Any:
    return obj.value


def _unchanged(obj: Any) -> Any:
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
    """`value` (plain, as msgpack or JSON gives it) as the type `tp`; raises WireError naming
    where it does not fit."""
    try:
        return _decoder(tp)(value)
    except _Refused:
        return _reference(tp, value, where)  # raises the WireError that says where


class _Refused(Exception):
    """A compiled decoder met what it does not accept (the reference walk says why)."""


Decoder = Callable[[Any], Any]
_DECODERS: dict[Any, Decoder] = {}


def _decoder(tp: Any) -> Decoder:
    found = _DECODERS.get(tp)
    if found is None:
        found = _DECODERS[tp] = _compile(tp)
    return found


def _compile(tp: Any) -> Decoder:
    """The decoder for `tp`: the same checks and conversions as `_reference`, decided once."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return _unchanged
    if origin in (typing.Union, types.UnionType):
        return _union_decoder(typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return _dataclass_decoder(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_decoder(tp)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return _sequence_decoder(args[0] if args else Any, origin is tuple)
    if origin is dict:
        return _dict_decoder(*(typing.get_args(tp) or (Any, Any)))
    if tp is float:
        return _float
    if tp is int:
        return _int
    if tp in (str, bool, bytes):
        return _exactly(tp)
    return _refuse  # unsupported: the reference walk names it


def _refuse(value: Any) -> Any:
    raise _Refused()


def _float(value: Any) -> float:
    if type(value) is float:
        return value
    if type(value) is bool or not isinstance(value, (int, float)):
        raise _Refused()
    return float(value)


def _int(value: Any) -> int:
    if type(value) is int or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise _Refused()


def _exactly(tp: type) -> Decoder:
    def check(value: Any) -> Any:
        if not isinstance(value, tp):
            raise _Refused()
        return value
    return check


def _union_decoder(args: tuple) -> Decoder:
    optional = type(None) in args
    variants = [a for a in args if a is not type(None)]

    def decode_union(value: Any) -> Any:
        if value is None and optional:
            return None
        for variant in variants:
            try:
                return _decoder(variant)(value)
            except _Refused:
                continue
        raise _Refused()
    return decode_union


def _dataclass_decoder(cls: type) -> Decoder:
    # (name, decoder, required) per field, made on first use: a class may refer to itself.
    plan: list[tuple[str, Decoder, bool]] | None = None

    def decode_dataclass(value: Any) -> Any:
        nonlocal plan
        if not isinstance(value, dict):
            raise _Refused()
        if plan is None:
            hints = _hints(cls)
            plan = [(f.name, _decoder(hints[f.name]),
                     f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                    for f in dataclasses.fields(cls)]
        kwargs = {}
        for name, decode_field, required in plan:
            if name in value:
                kwargs[name] = decode_field(value[name])
            elif required:
                raise _Refused()
        return cls(**kwargs)
    return decode_dataclass


def _enum_decoder(cls: type[enum.Enum]) -> Decoder:
    def decode_enum(value: Any) -> Any:
        try:
            return cls(value)
        except ValueError:
            raise _Refused() from None
    return decode_enum


def _sequence_decoder(item: Any, as_tuple: bool) -> Decoder:
    exact = frozenset({item}) if item in _EXACT_ITEMS else None

    def decode_sequence(value: Any) -> Any:
        if not isinstance(value, (list, tuple)):
            raise _Refused()
        if exact is not None and exact.issuperset(map(type, value)):
            items = value  # already what the hint asks: no call per item
        else:
            decode_item = _decoder(item)
            items = [decode_item(v) for v in value]
        return tuple(items) if as_tuple else list(items)
    return decode_sequence


def _dict_decoder(key: Any, val: Any) -> Decoder:
    def decode_dict(value: Any) -> Any:
        if not isinstance(value, dict):
            raise _Refused()
        decode_key, decode_val = _decoder(key), _decoder(val)
        return {decode_key(k): decode_val(v) for k, v in value.items()}
    return decode_dict


def _reference(tp: Any, value: Any, where: str = "$") -> Any:
    """The plain walk the compiled decoders mirror; it names the place of an error."""
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
                return _reference(arg, value, where)
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
                kwargs[f.name] = _reference(hints[f.name], value[f.name], f"{where}.{f.name}")
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
        items = [_reference(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise WireError(f"{where}: expected a map, got {type(value).__name__}")
        kt, vt = typing.get_args(tp) or (Any, Any)
        return {_reference(kt, k, where): _reference(vt, v, f"{where}[{k!r}]") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WireError(f"{where}: expected a number, got {type(value).__name__}")
        return float(value)
    if tp in (int, str, bool, bytes):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise WireError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    raise WireError(f"{where}: unsupported schema type {tp!r}")
