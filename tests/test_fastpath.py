"""The compiled steps (``nixl_kv._fastpath``): the library calls them, and they are what they replace, byte for byte.

The seal is held to ``hashlib.blake2b``, which the pure-Python seal of earlier builds called (params sealed by one
build verify on the other). Each flat dataclass's compiled decoder is held to the generic decoder of ``wire`` on
valid and mutated bodies: the same object, or a WireFormatError naming the same field with the same problem.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nixl_kv import _fastpath, params_seal, wire
from nixl_kv.errors import WireFormatError
from nixl_kv.protocol import LayersReady, LayerWatch, NoReaders, ReadDone, ReadVerdict, StageClaim, StageGrant
from nixl_kv.state import (
    MAX_BLOCKS,
    CacheState,
    CommState,
    ContextPhaseParams,
    DataTransceiverState,
    ModelConfig,
    ParallelConfig,
    RankCommInfo,
)

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PARAMS = ContextPhaseParams(
    request_id=(1 << 64) - 2,
    ctx_state=bytes(range(256)) * 5,
    block_ids=((0, 1, 2, 7), (9, MAX_BLOCKS)),
    num_tokens=100,
    lease_ms=30_000,
    ctx_dp_rank=1,
    first_gen_tokens=(5, (1 << 32) - 1),
    draft_tokens=(11, 12),
    layerwise=True,
    rnn_slot=3,
    ctx_rank=2,
    masked_promise=(1 << 64) - 1,
    secret=b"s" * 32,
    prompt_digest=b"d" * 16,
)
FLAT = {
    ContextPhaseParams: PARAMS,
    ReadDone: ReadDone("ctx", 7, 8, b"meta", 2, final=False, failed=True, reason="r", checks_hold=True, hold_token=9),
    ReadVerdict: ReadVerdict("ctx", 7, 8, False, "no", b"p" * 16),
    StageClaim: StageClaim("ctx", 7, 8, b"meta", 4, (0, 2), (1, 3), (0, 4), b"p"),
    StageGrant: StageGrant("ctx", 7, 8, True, 1 << 40, 4096, False, "", b"p"),
    NoReaders: NoReaders("ctx", 7, b"meta"),
    LayerWatch: LayerWatch("ctx", 7, b"meta", b"p"),
    LayersReady: LayersReady("ctx", 7, 3),
    ModelConfig: ModelConfig((2, 2, 4), 64, 32),
    ParallelConfig: ParallelConfig(tp=2, enable_attention_dp=True, dp_size=2, attention_layers_per_pp_rank=(3,)),
}


def _expected_seal(body: bytes) -> int:
    """The seal as the pure-Python builds computed it."""
    return int.from_bytes(hashlib.blake2b(body, digest_size=8, person=b"nixl_kv-params").digest(), "big") | 1 << 63


# --- the seal ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 1, 55, 127, 128, 129, 255, 256, 257, 1000, 4096, 100_003])
@pytest.mark.parametrize(("digest_size", "person"), [(8, b"nixl_kv-params"), (64, b""), (32, b"x" * 16), (1, b"a")])
def test_blake2b_is_hashlibs(size: int, digest_size: int, person: bytes) -> None:
    data = bytes((i * 131 + size) % 256 for i in range(size))
    assert (
        _fastpath.blake2b_digest(data, person, digest_size)
        == hashlib.blake2b(data, digest_size=digest_size, person=person).digest()
    )


def test_the_library_calls_the_compiled_seal() -> None:
    assert params_seal.is_sealed is _fastpath.is_sealed and params_seal.seal is _fastpath.seal
    assert params_seal._digest is _fastpath.params_digest


@given(st.binary(min_size=0, max_size=700))
@settings(max_examples=200, deadline=None)
def test_the_seal_is_the_one_earlier_builds_made(body: bytes) -> None:
    assert _fastpath.params_digest(body) == _expected_seal(body)
    placeholder = body + b"\xcf" + bytes(8)
    sealed = params_seal.seal(placeholder)
    assert sealed == body + b"\xcf" + _expected_seal(body + b"\xcf").to_bytes(8, "big")
    assert params_seal.is_sealed(sealed) and not params_seal.is_sealed(placeholder)


def test_every_damaged_byte_breaks_the_seal_and_every_buffer_kind_is_read() -> None:
    sealed = params_seal.encode_params(PARAMS)
    assert params_seal.is_sealed(sealed)
    assert params_seal.is_sealed(bytearray(sealed)) and params_seal.is_sealed(memoryview(sealed))
    assert params_seal.seal(bytearray(sealed)) == sealed
    for at in range(len(sealed)):
        damaged = bytearray(sealed)
        damaged[at] ^= 0x01
        assert not params_seal.is_sealed(bytes(damaged)), at
    for short in (b"", b"\xcf" + bytes(7), sealed[:8]):
        assert not params_seal.is_sealed(short)
    with pytest.raises(ValueError, match="do not end in their checksum field"):
        params_seal.seal(sealed[:-1])
    for value in (
        "not bytes",
        None,
        7,
        [1, 2],
        memoryview(sealed)[::2],
        memoryview(sealed[: len(sealed) // 4 * 4]).cast("I"),
    ):
        assert not params_seal.is_sealed(value)  # (refused, never a TypeError: issue 29)
    assert params_seal.is_sealed(memoryview(sealed).cast("c")) and params_seal.is_sealed(memoryview(sealed)[:])
    too_long = bytes(params_seal.MAX_PARAMS_BYTES - len(sealed) + 1) + sealed
    assert params_seal.params_problem(too_long) == (
        f"are {len(too_long)} bytes, over the limit of {params_seal.MAX_PARAMS_BYTES} bytes"
    )


# --- flat dataclasses ---------------------------------------------------------------------------------------------
def test_flat_dataclasses_decode_in_compiled_code_and_the_others_do_not() -> None:
    for cls in FLAT:
        decoder = wire._decoder(cls, ())
        assert isinstance(decoder, _fastpath.FlatDecoder) and decoder.cls is cls, cls
    for cls in (DataTransceiverState, CacheState, CommState, RankCommInfo):
        assert not isinstance(wire._decoder(cls, ()), _fastpath.FlatDecoder), cls


def _outcome(decoder: Any, body: Any, path: str, depth: int = 0) -> Any:
    """What a decoder makes of a body: the object with its attributes in order, or the refusal."""
    try:
        obj = decoder(body, path, depth)
    except WireFormatError as exc:
        return ("refused", exc.field, exc.problem)
    return ("ok", obj, list(vars(obj).items()))


def _assert_same(cls: type, body: Any) -> None:
    compiled = _outcome(wire._decoder(cls, ()), body, cls.__name__)
    generic = _outcome(wire._generic_dataclass_decoder(cls), body, cls.__name__)
    assert compiled == generic, (body, compiled, generic)


def _body(cls: type) -> dict[str, Any]:
    return msgpack.unpackb(wire.encode(FLAT[cls]), raw=False)["body"]


@pytest.mark.parametrize("cls", list(FLAT), ids=lambda cls: cls.__name__)
def test_a_valid_flat_message_decodes_to_itself(cls: type) -> None:
    assert wire.decode(wire.encode(FLAT[cls]), cls) == FLAT[cls]
    _assert_same(cls, _body(cls))


VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.sampled_from([0, 1, -1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 40, (1 << 63) - 1, 1 << 63, MAX_BLOCKS]),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=70),
    st.lists(st.integers(min_value=-2, max_value=(1 << 64) - 1) | st.booleans() | st.none(), max_size=4),
    st.lists(st.lists(st.integers(min_value=-2, max_value=MAX_BLOCKS + 1), max_size=3) | st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


@FUZZ
@given(st.sampled_from(list(FLAT)), st.data())
def test_mutated_flat_bodies_meet_the_same_fate_as_in_the_generic_decoder(cls: type, data: st.DataObject) -> None:
    body = _body(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for _ in range(data.draw(st.integers(1, 3))):
        op = data.draw(st.sampled_from(["set", "drop", "add", "inner"]))
        name = data.draw(st.sampled_from(names))
        if op == "set":
            body[name] = data.draw(VALUES)
        elif op == "drop":
            body.pop(name, None)
        elif op == "add":
            body[data.draw(st.sampled_from(["x", "", "request_idx", *names]))] = data.draw(VALUES)
        elif isinstance(body.get(name), list) and body[name]:  # one item of an array, or of an inner array
            at = data.draw(st.integers(0, len(body[name]) - 1))
            if isinstance(body[name][at], list) and body[name][at] and data.draw(st.booleans()):
                body[name][at][data.draw(st.integers(0, len(body[name][at]) - 1))] = data.draw(VALUES)
            else:
                body[name][at] = data.draw(VALUES)
    _assert_same(cls, body)


@pytest.mark.parametrize(
    "body",
    [
        [],
        "body",
        {b"request_id": 1},
        {"block_ids": [[0]] * 65},
        {"block_ids": [list(range(MAX_BLOCKS + 1))]},
        {"first_gen_tokens": list(range((1 << 16) + 1))},
        {"block_ids": [[True]]},
        {"block_ids": []},
        {"ctx_state": b"x" * ((8 << 20) + 1)},
        {"secret": b"x" * 65},
        {"request_id": 1 << 64},
        {"request_id": -(1 << 63)},
        {"rnn_slot": 1 << 31},
        {"draft_tokens": None, "rnn_slot": None},
        {"layerwise": 1},
    ],
)
def test_edge_bodies_meet_the_same_fate(body: Any) -> None:
    if isinstance(body, dict):
        body = {**_body(ContextPhaseParams), **body}
    _assert_same(ContextPhaseParams, body)


def test_depth_is_checked_as_the_generic_decoder_does() -> None:
    body = _body(ContextPhaseParams)
    for depth in (14, 15, 16, 17):
        compiled = _outcome(wire._decoder(ContextPhaseParams, ()), body, "P", depth)
        assert compiled == _outcome(wire._generic_dataclass_decoder(ContextPhaseParams), body, "P", depth), depth


def test_a_dataclass_with_a_post_init_is_built_by_its_class() -> None:
    @dataclasses.dataclass(frozen=True)
    class Checked:
        count: int = 0
        seen: list = dataclasses.field(default_factory=list, metadata={})

        def __post_init__(self) -> None:
            self.seen.append(self.count)

    @dataclasses.dataclass(frozen=True)
    class Plain:
        count: int = 0
        name: str = "x"

    assert wire._flat_rules(Checked) is None  # a list field is not flat: a flat twin shows the rule below
    checked = _fastpath.FlatDecoder(Checked, [("count", _fastpath.KINDS["int"], False, True, 0, 9, 0, 0)], wire._show)
    assert not checked.direct and checked({"count": 3}, "C", 0).seen == [3]  # its __post_init__ ran
    plain = wire._decoder(Plain, ())
    assert plain.direct and plain({"count": 3}, "P", 0) == Plain(3)
    assert list(vars(plain({}, "P", 0))) == ["count", "name"]  # every field, in field order, as its __init__ sets


# --- encoding ------------------------------------------------------------------------------------------------------
# Made by the pure-Python encoder and seal of the build before the compiled ones (e151325): params and the bytes a MAC
# covers must stay the same across builds.
GOLDEN_PARAMS = ContextPhaseParams(
    request_id=7, ctx_state=b"state", block_ids=((1, 2), (3,)), num_tokens=40, lease_ms=500, draft_tokens=(9, 8),
    rnn_slot=2, masked_promise=1 << 63, secret=b"s" * 8,
)  # fmt: skip
GOLDEN_SEALED = bytes.fromhex(
    "83a76e69786c5f6b7602a474797065b2436f6e746578745068617365506172616d73a4626f64798aaa726571756573745f696407a963"
    "74785f7374617465c4057374617465a9626c6f636b5f696473929201029103aa6e756d5f746f6b656e7328a86c656173655f6d73cd01"
    "f4ac64726166745f746f6b656e73920908a8726e6e5f736c6f7402ae6d61736b65645f70726f6d697365cf8000000000000000a67365"
    "63726574c4087373737373737373a8636865636b73756dcfcfdaa3d517f3299c"
)
GOLDEN_READ_DONE = bytes.fromhex(
    "83a76e69786c5f6b7602a474797065a852656164446f6e65a4626f647987af6374785f696e7374616e63655f6964a3637478aa726571"
    "756573745f696407ab7472616e736665725f696408af7265616465725f6d65746164617461c4046d657461b065787065637465645f72"
    "65616465727302ab636865636b735f686f6c64c3aa686f6c645f746f6b656e09"
)


def test_encodings_are_those_of_the_build_before() -> None:
    assert params_seal.encode_params(GOLDEN_PARAMS) == GOLDEN_SEALED
    done = ReadDone("ctx", 7, 8, b"meta", 2, checks_hold=True, hold_token=9, proof=b"p")
    assert wire.encode(done, omit="proof") == GOLDEN_READ_DONE
    assert wire.decode(GOLDEN_SEALED, ContextPhaseParams) == dataclasses.replace(
        GOLDEN_PARAMS, checksum=int.from_bytes(GOLDEN_SEALED[-8:], "big")
    )


def test_flat_dataclasses_encode_in_compiled_code_and_the_others_do_not() -> None:
    for cls in FLAT:
        assert isinstance(wire._flat_encoder(cls), _fastpath.FlatEncoder), cls
    for cls in (DataTransceiverState, CacheState, CommState, RankCommInfo):
        assert wire._flat_encoder(cls) is None, cls


def _flat_values(cls: type) -> st.SearchStrategy:
    """Instances of ``cls`` whose fields take their default, the example's value, or another value of their type."""
    example = FLAT[cls]
    fields = dataclasses.fields(cls)

    def choices(spec: dataclasses.Field) -> st.SearchStrategy:
        options = [st.just(getattr(example, spec.name))]
        if spec.default is not dataclasses.MISSING:
            options.append(st.just(spec.default))
        value = getattr(example, spec.name)
        if type(value) is int:
            options.append(st.integers(0, 1 << 20))
        elif type(value) is tuple and all(type(v) is int for v in value):
            options.append(st.lists(st.integers(0, 1000), max_size=3).map(tuple))
        elif type(value) is tuple:
            options.append(st.lists(st.lists(st.integers(0, 1000), max_size=3).map(tuple), max_size=3).map(tuple))
        return st.one_of(options)

    return st.fixed_dictionaries({spec.name: choices(spec) for spec in fields}).map(lambda kw: cls(**kw))


@FUZZ
@given(st.sampled_from(list(FLAT)).flatmap(_flat_values))
def test_flat_bodies_are_the_generic_encoders(obj: Any) -> None:
    compiled = wire._to_plain(obj)
    generic = wire._generic_dataclass_plain(obj)
    assert compiled == generic and list(compiled) == list(generic)  # the same keys in the same order: the same bytes
    with contextlib.suppress(WireFormatError):  # a value drawn outside its field's bounds is refused when decoded
        assert wire.decode(wire.encode(obj), type(obj)) == obj


def test_encode_with_last_is_encode_of_a_replaced_copy() -> None:
    for checksum in (0, 5, 1 << 63):
        params = dataclasses.replace(PARAMS, checksum=checksum)
        for value in (0, 1, params_seal.PLACEHOLDER):
            assert wire.encode_with_last(params, value) == wire.encode(dataclasses.replace(params, checksum=value))
