"""Versioned msgpack wire format with full validation of untrusted bytes.

Every message is a map ``{"nixl_kv": WIRE_VERSION, "type": <name>, "body": {...}}``. The body of a dataclass
is a map of its field names, less those at their default (so a peer built before a field was added still reads
messages that do not use it); enums travel as their values, tuples as arrays, bytes as bin. Decoding walks
the dataclass's type hints, so each field's type, bounds and length are checked, then each object's
``problems()`` checks cross-field rules. Whatever the input, the decoder raises only ``WireFormatError``.

The envelope, and the body of every flat dataclass (the params and the control messages: see ``_flat_rules``), are
decoded by compiled code (``nixl_kv._fastpath``), from the rules worked out here; the closures below decode the
others (the transceiver state, decoded once per instance).
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

try:
    from nixl_kv import _fastpath
except ImportError as exc:  # a source checkout on sys.path that was never built
    raise ImportError(
        "nixl_kv._fastpath, the compiled part of nixl_kv, is not built: in the checkout, run `pip install -e .` "
        "(or `python setup.py build_ext --inplace`; both need gcc, the Python headers and Cython)"
    ) from exc

WIRE_VERSION = 2  # 2: control messages carry a MAC as their proof, not the secret
MAX_MESSAGE_BYTES = 16 << 20
_DEFAULT_MAX_STR = 1024
_DEFAULT_MAX_BYTES = 64 << 10
_DEFAULT_MAX_ITEMS = 1 << 20
_MAX_DEPTH = _fastpath.DEPTH_LIMIT  # one limit for the compiled decoders and these
_U64_MAX = (1 << 64) - 1
_NO_DEFAULT = object()

T = TypeVar("T")


def encode(obj: Any, omit: str = "") -> bytes:
    """Serialize a dataclass instance of the data model (without its field ``omit``, when given: what a MAC
    over the rest of the message covers)."""
    body = _to_plain(obj)
    if omit:
        body.pop(omit, None)
    return msgpack.packb({"nixl_kv": WIRE_VERSION, "type": type(obj).__name__, "body": body}, use_bin_type=True)


def encode_with_last(obj: Any, value: Any) -> bytes:
    """``encode(dataclasses.replace(obj, <its last field>=value))`` without making the copy."""
    body = _to_plain(obj)
    name, default, _ = _fields(type(obj))[-1]
    body.pop(name, None)  # (it is the last key where present)
    if default is _NO_DEFAULT or value != default:
        body[name] = value if type(value) in (bool, int, str, bytes) else _to_plain(value)
    return msgpack.packb({"nixl_kv": WIRE_VERSION, "type": type(obj).__name__, "body": body}, use_bin_type=True)


def decode(data: bytes, cls: type[T]) -> T:
    """Decode and validate ``data`` as an instance of ``cls``; raises WireFormatError on any problem."""
    return decode_one_of(data, (cls,))


def decode_one_of(data: bytes, classes: tuple[type, ...]) -> Any:
    """Decode a message whose type is any of ``classes`` (chosen by the envelope's type tag)."""
    return _message_decoder(classes)(data)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0)


@cache
def _message_decoder(classes: tuple[type, ...]) -> _fastpath.MessageDecoder:
    """The compiled decoder of messages of these classes: the size limit, msgpack, the envelope, the body."""
    return _fastpath.MessageDecoder(classes, _unpack, WIRE_VERSION, MAX_MESSAGE_BYTES, _body_decoder, _show)


def _body_decoder(cls: type) -> Decoder:
    return _decoder(cls, ())


@cache
def _fields(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    """(name, default or ``_NO_DEFAULT``, plain) of each field; a plain field (bool, int, str, bytes) is sent
    as it is, the others (nested dataclasses, enums, tuples) are converted."""
    hints = _hints(cls)
    return tuple(
        (
            f.name,
            _NO_DEFAULT if f.default is dataclasses.MISSING else f.default,
            hints[f.name] in (bool, int, str, bytes),
        )
        for f in dataclasses.fields(cls)
    )


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        flat = _flat_encoder(type(value))
        return flat(value) if flat is not None else _generic_dataclass_plain(value)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return [_to_plain(item) for item in value]
    return value


def _generic_dataclass_plain(value: Any) -> dict[str, Any]:
    """The body of a dataclass that is not flat (the tests also hold each flat one's compiled encoder to it)."""
    plain = {}
    for name, default, is_plain in _fields(type(value)):
        item = getattr(value, name)
        if default is _NO_DEFAULT or item != default:
            plain[name] = item if is_plain else _to_plain(item)
    return plain


@cache
def _flat_encoder(cls: type) -> _fastpath.FlatEncoder | None:
    """The compiled body encoder of a flat dataclass (see ``_flat_rules``), None for the others."""
    if not isinstance(cls, type) or _flat_rules(cls) is None:
        return None
    return _fastpath.FlatEncoder(
        [(name, default is not _NO_DEFAULT, default, plain) for name, default, plain in _fields(cls)], _to_plain
    )


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


Decoder = typing.Callable[[Any, str, int], Any]


@cache
def _decoder(hint: Any, meta_items: tuple[tuple[str, Any], ...]) -> Decoder:
    """The checking decoder of one (type hint, field metadata), worked out once: a message is then decoded by a
    few closures rather than by walking type hints per value (params 52 -> ~15 µs)."""
    meta = dict(meta_items)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        inner = _decoder([arg for arg in typing.get_args(hint) if arg is not type(None)][0], meta_items)
        return lambda value, path, depth: None if value is None else inner(value, path, depth)
    if origin is tuple:
        return _tuple_decoder(typing.get_args(hint)[0], meta, meta_items)
    if dataclasses.is_dataclass(hint):
        return _dataclass_decoder(hint)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return _enum_decoder(hint)
    if hint is bool:
        return _bool
    if hint is int:
        lo, hi = meta.get("lo", 0), meta.get("hi", _U64_MAX)
        return lambda value, path, depth: _int(value, lo, hi, path)
    if hint is str:
        return _sized(str, "a string", "string of {} characters is too long", meta.get("max_len", _DEFAULT_MAX_STR))
    if hint is bytes:
        return _sized(bytes, "bytes", "{} bytes is too long", meta.get("max_bytes", _DEFAULT_MAX_BYTES))
    raise WireFormatError("<schema>", f"no wire rule for type {hint!r}")  # a bug in the data model, not the input


def _bool(value: Any, path: str, depth: int) -> bool:
    if type(value) is not bool:
        raise WireFormatError(path, f"expected a bool, got {_show(value)}")
    return value


def _int(value: Any, lo: int, hi: int, path: str) -> int:
    if type(value) is not int:
        raise WireFormatError(path, f"expected an integer, got {_show(value)}")
    if not lo <= value <= hi:
        raise WireFormatError(path, f"{value} is outside [{lo}, {hi}]")
    return value


def _sized(kind: type, name: str, too_long: str, limit: int) -> Decoder:
    def decode(value: Any, path: str, depth: int) -> Any:
        if not isinstance(value, kind):
            raise WireFormatError(path, f"expected {name}, got {_show(value)}")
        if len(value) > limit:
            raise WireFormatError(path, too_long.format(len(value)))
        return value

    return decode


def _enum_decoder(hint: type[Enum]) -> Decoder:
    def decode(value: Any, path: str, depth: int) -> Enum:
        try:
            return hint(value)
        except (ValueError, TypeError):
            allowed = ", ".join(str(member.value) for member in hint)
            raise WireFormatError(path, f"{_show(value)} is not one of {allowed}") from None

    return decode


def _tuple_decoder(item_hint: Any, meta: dict[str, Any], meta_items: tuple[tuple[str, Any], ...]) -> Decoder:
    nested = typing.get_origin(item_hint) is tuple
    limit = meta.get("max_outer" if nested else "max_items", _DEFAULT_MAX_ITEMS)
    lo, hi = meta.get("lo", 0), meta.get("hi", _U64_MAX)
    of_ints = item_hint is int
    item = _decoder(item_hint, meta_items)

    def decode(value: Any, path: str, depth: int) -> tuple:
        if depth > _MAX_DEPTH:
            raise WireFormatError(path, "nested too deeply")
        if not isinstance(value, list):
            raise WireFormatError(path, f"expected an array, got {_show(value)}")
        if len(value) > limit:
            raise WireFormatError(path, f"{len(value)} items exceeds the limit of {limit}")
        if of_ints and all(type(entry) is int for entry in value):
            if value and not (lo <= min(value) and max(value) <= hi):
                bad = next(entry for entry in value if not lo <= entry <= hi)
                raise WireFormatError(f"{path}[{value.index(bad)}]", f"{bad} is outside [{lo}, {hi}]")
            return tuple(value)
        return tuple(item(entry, f"{path}[{i}]", depth + 1) for i, entry in enumerate(value))

    return decode


def _flat_rules(cls: type) -> list[tuple[Any, ...]] | None:
    """The rules of a flat dataclass for ``_fastpath.FlatDecoder`` (every field an int, bool, bytes, str, tuple of
    ints or tuple of tuples of ints, each optionally None: the params and every control message); None for any
    other. Each rule carries what the generic decoders below would check: the bounds and limits of its metadata."""
    hints = _hints(cls)
    rules = []
    for spec in dataclasses.fields(cls):
        hint, meta = hints[spec.name], spec.metadata
        optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
        if optional:  # as _decoder: the first type that is not None; None is accepted
            hint = [arg for arg in typing.get_args(hint) if arg is not type(None)][0]
        limit, inner_limit = 0, 0
        if hint is int or hint is bool:
            kind = "int" if hint is int else "bool"
        elif hint is bytes:
            kind, limit = "bytes", meta.get("max_bytes", _DEFAULT_MAX_BYTES)
        elif hint is str:
            kind, limit = "str", meta.get("max_len", _DEFAULT_MAX_STR)
        elif typing.get_origin(hint) is tuple and typing.get_args(hint)[0] is int:
            kind, limit = "ints", meta.get("max_items", _DEFAULT_MAX_ITEMS)
        elif (
            typing.get_origin(hint) is tuple
            and typing.get_origin(inner := typing.get_args(hint)[0]) is tuple
            and typing.get_args(inner)[0] is int
        ):
            kind, limit = "ints2", meta.get("max_outer", _DEFAULT_MAX_ITEMS)
            inner_limit = meta.get("max_items", _DEFAULT_MAX_ITEMS)
        else:
            return None
        has_default = spec.default is not dataclasses.MISSING or spec.default_factory is not dataclasses.MISSING
        lo, hi = meta.get("lo", 0), meta.get("hi", _U64_MAX)
        rules.append((spec.name, _fastpath.KINDS[kind], optional, has_default, lo, hi, limit, inner_limit))
    return rules


def _dataclass_decoder(cls: type) -> Decoder:
    """A flat dataclass is decoded by compiled code (``_fastpath.FlatDecoder``, the same checks and messages as
    below); the others, which nest dataclasses or enums, by the closures below."""
    flat = _flat_rules(cls)
    return _fastpath.FlatDecoder(cls, flat, _show) if flat is not None else _generic_dataclass_decoder(cls)


def _generic_dataclass_decoder(cls: type) -> Decoder:
    """The decoder of any dataclass of the data model, from the closures above (the tests also hold the compiled
    decoder of each flat dataclass to it)."""
    hints = _hints(cls)
    rules = []
    for spec in dataclasses.fields(cls):
        has_default = spec.default is not dataclasses.MISSING or spec.default_factory is not dataclasses.MISSING
        meta_items = tuple(sorted(spec.metadata.items()))
        hint = hints[spec.name]
        lo, hi = spec.metadata.get("lo", 0), spec.metadata.get("hi", _U64_MAX)
        rules.append((spec.name, hint is int, lo, hi, has_default, _LazyDecoder(hint, meta_items)))
    names = frozenset(rule[0] for rule in rules)
    checks = hasattr(cls, "problems")

    def decode(value: Any, path: str, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise WireFormatError(path, "nested too deeply")
        if not isinstance(value, dict):
            raise WireFormatError(path, f"expected a map, got {_show(value)}")
        if not names.issuperset(value):
            unknown = next(key for key in value if key not in names)
            raise WireFormatError(f"{path}.{str(unknown)[:64]}", "unknown field")
        kwargs = {}
        for name, plain_int, lo, hi, has_default, field_decoder in rules:
            if name not in value:
                if has_default:
                    continue
                raise WireFormatError(f"{path}.{name}", "missing")
            item = value[name]
            if plain_int and type(item) is int and lo <= item <= hi:
                kwargs[name] = item
                continue
            kwargs[name] = field_decoder(item, f"{path}.{name}", depth + 1)
        obj = cls(**kwargs)
        problems = obj.problems() if checks else []
        if problems:
            raise WireFormatError(path, "; ".join(problems))
        return obj

    return decode


class _LazyDecoder:
    """A field's decoder, looked up at first use (a class may refer to itself, or to one defined later)."""

    __slots__ = ("_args", "_decode")

    def __init__(self, hint: Any, meta_items: tuple[tuple[str, Any], ...]) -> None:
        self._args = (hint, meta_items)
        self._decode: Decoder | None = None

    def __call__(self, value: Any, path: str, depth: int) -> Any:
        if self._decode is None:
            self._decode = _decoder(*self._args)
        return self._decode(value, path, depth)


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:48]}{'...' if len(text) > 48 else ''}"
