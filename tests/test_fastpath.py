"""The compiled steps (``nixl_kv._fastpath``): the library calls them, and they are what they replace, byte for byte.

The seal is held to ``hashlib.blake2b``, which the pure-Python seal of earlier builds called (params sealed by one
build verify on the other). Each flat dataclass's compiled decoder is held to the generic decoder of ``wire`` on
valid and mutated bodies: the same object, or a WireFormatError naming the same field with the same problem.
"""

from __future__ import annotations

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
    with pytest.raises(TypeError):
        params_seal.is_sealed("not bytes")  # type: ignore[arg-type]


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
