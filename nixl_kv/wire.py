"""Versioned msgpack wire format with full validation of untrusted bytes.

Every message is a map ``{"nixl_kv": WIRE_VERSION, "type": <name>, "body": {...}}``. The body of a dataclass
is a map of its field names, less those at their default (so a peer built before a field was added still reads
messages that do not use it); enums travel as their values, tuples as arrays, bytes as bin. Decoding walks
the dataclass's type hints, so each field's type, bounds and length are checked, then each object's
``problems()`` checks cross-field rules. Whatever the input, the decoder raises only ``WireFormatError``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from functools import cache
from typing import Any, TypeVar

import msgpack

from nixl_kv.errors import WireFormatError

WIRE_VERSION = 1
MAX_MESSAGE_BYTES = 16 << 20
_DEFAULT_MAX_STR = 1024
_DEFAULT_MAX_BYTES = 64 << 10
_DEFAULT_MAX_ITEMS = 1 << 20
_MAX_DEPTH = 16
_U64_MAX = (1 << 64) - 1
_NO_DEFAULT = object()

T = TypeVar("T")


def encode(obj: Any) -> bytes:
    """Serialize a dataclass instance of the data model."""
    return msgpack.packb(
        {"nixl_kv": WIRE_VERSION, "type": type(obj).__name__, "body": _to_plain(obj)}, use_bin_type=True
    )


def decode(data: bytes, cls: type[T]) -> T:
    """Decode and validate ``data`` as an instance of ``cls``; raises WireFormatError on any problem."""
    return decode_one_of(data, (cls,))


def decode_one_of(data: bytes, classes: tuple[type, ...]) -> Any:
    """Decode a message whose type is any of ``classes`` (chosen by the envelope's type tag)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireFormatError("<message>", f"expected bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if size > MAX_MESSAGE_BYTES:
        raise WireFormatError("<message>", f"{size} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        envelope = msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=True,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many unrelated types on garbage; all mean the same thing
        raise WireFormatError("<message>", f"not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(envelope, dict) or set(envelope) != {"nixl_kv", "type", "body"}:
        raise WireFormatError("<message>", "not a nixl_kv envelope (expected keys nixl_kv, type, body)")
    version = envelope["nixl_kv"]
    if type(version) is not int or version != WIRE_VERSION:
        raise WireFormatError("nixl_kv", f"unsupported wire version {version!r}, this build speaks {WIRE_VERSION}")
    by_name = {cls.__name__: cls for cls in classes}
    cls = by_name.get(envelope["type"]) if isinstance(envelope["type"], str) else None
    if cls is None:
        raise WireFormatError("type", f"expected one of {', '.join(by_name)}, got {_show(envelope['type'])}")
    try:
        return _from_plain(envelope["body"], cls, {}, cls.__name__, 0)
    except WireFormatError:
        raise
    except RecursionError:
        raise WireFormatError(cls.__name__, "nested too deeply") from None


@cache
def _defaults(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, default) of each field; ``_NO_DEFAULT`` for fields without one."""
    return tuple(
        (f.name, _NO_DEFAULT if f.default is dataclasses.MISSING else f.default) for f in dataclasses.fields(cls)
    )


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        plain = {}
        for name, default in _defaults(type(value)):
            item = getattr(value, name)
            if default is _NO_DEFAULT or item != default:
                plain[name] = _to_plain(item)
        return plain
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return [_to_plain(item) for item in value]
    return value


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _from_plain(value: Any, hint: Any, meta: dict[str, Any], path: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise WireFormatError(path, "nested too deeply")
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if value is None:
            return None
        return _from_plain(value, options[0], meta, path, depth)
    if origin is tuple:
        return _tuple_from_plain(value, typing.get_args(hint)[0], meta, path, depth)
    if dataclasses.is_dataclass(hint):
        return _dataclass_from_plain(value, hint, path, depth)
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(value)
        except (ValueError, TypeError):
            allowed = ", ".join(str(member.value) for member in hint)
            raise WireFormatError(path, f"{_show(value)} is not one of {allowed}") from None
    if hint is bool:
        if type(value) is not bool:
            raise WireFormatError(path, f"expected a bool, got {_show(value)}")
        return value
    if hint is int:
        return _int_from_plain(value, meta, path)
    if hint is str:
        if not isinstance(value, str):
            raise WireFormatError(path, f"expected a string, got {_show(value)}")
        if len(value) > meta.get("max_len", _DEFAULT_MAX_STR):
            raise WireFormatError(path, f"string of {len(value)} characters is too long")
        return value
    if hint is bytes:
        if not isinstance(value, bytes):
            raise WireFormatError(path, f"expected bytes, got {_show(value)}")
        if len(value) > meta.get("max_bytes", _DEFAULT_MAX_BYTES):
            raise WireFormatError(path, f"{len(value)} bytes is too long")
        return value
    raise WireFormatError(path, f"no wire rule for type {hint!r}")  # a bug in the data model, not the input


def _int_from_plain(value: Any, meta: dict[str, Any], path: str) -> int:
    if type(value) is not int:
        raise WireFormatError(path, f"expected an integer, got {_show(value)}")
    lo, hi = meta.get("lo", 0), meta.get("hi", (1 << 64) - 1)
    if not lo <= value <= hi:
        raise WireFormatError(path, f"{value} is outside [{lo}, {hi}]")
    return value


def _tuple_from_plain(value: Any, item_hint: Any, meta: dict[str, Any], path: str, depth: int) -> tuple:
    if not isinstance(value, list):
        raise WireFormatError(path, f"expected an array, got {_show(value)}")
    nested = typing.get_origin(item_hint) is tuple
    limit = meta.get("max_outer" if nested else "max_items", _DEFAULT_MAX_ITEMS)
    if len(value) > limit:
        raise WireFormatError(path, f"{len(value)} items exceeds the limit of {limit}")
    if item_hint is int and all(type(item) is int for item in value):
        lo, hi = meta.get("lo", 0), meta.get("hi", (1 << 64) - 1)
        if value and not (lo <= min(value) and max(value) <= hi):
            bad = next(item for item in value if not lo <= item <= hi)
            raise WireFormatError(f"{path}[{value.index(bad)}]", f"{bad} is outside [{lo}, {hi}]")
        return tuple(value)
    return tuple(_from_plain(item, item_hint, meta, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


@dataclasses.dataclass(frozen=True)
class _FieldRule:
    name: str
    hint: Any
    meta: dict[str, Any]
    has_default: bool
    plain_int: bool  # an int field: checked inline (the hot messages are mostly ints)


@cache
def _field_rules(cls: type) -> tuple[dict[str, _FieldRule], ...]:
    """Each field's rule, worked out once per class rather than once per message."""
    hints = _hints(cls)
    rules = {}
    for spec in dataclasses.fields(cls):
        has_default = spec.default is not dataclasses.MISSING or spec.default_factory is not dataclasses.MISSING
        hint = hints[spec.name]
        rules[spec.name] = _FieldRule(spec.name, hint, dict(spec.metadata), has_default, hint is int)
    return (rules,)


def _dataclass_from_plain(value: Any, cls: type, path: str, depth: int) -> Any:
    if not isinstance(value, dict):
        raise WireFormatError(path, f"expected a map, got {_show(value)}")
    (rules,) = _field_rules(cls)
    unknown = [key for key in value if key not in rules]
    if unknown:
        raise WireFormatError(f"{path}.{str(unknown[0])[:64]}", "unknown field")
    kwargs = {}
    for name, rule in rules.items():
        if name not in value:
            if rule.has_default:
                continue
            raise WireFormatError(f"{path}.{name}", "missing")
        item = value[name]
        if rule.plain_int and type(item) is int and rule.meta.get("lo", 0) <= item <= rule.meta.get("hi", _U64_MAX):
            kwargs[name] = item
            continue
        kwargs[name] = _from_plain(item, rule.hint, rule.meta, f"{path}.{name}", depth + 1)
    obj = cls(**kwargs)
    problems = obj.problems() if hasattr(obj, "problems") else []
    if problems:
        raise WireFormatError(path, "; ".join(problems))
    return obj


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:48]}{'...' if len(text) > 48 else ''}"
