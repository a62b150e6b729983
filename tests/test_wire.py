"""The wire format: round trips of every message, and rejection of every malformed input with WireFormatError."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nixl_kv import wire
from nixl_kv.dtypes import DataType
from nixl_kv.errors import WireFormatError
from nixl_kv.layout import KVLayout, LayoutKind, MemoryKind, MemoryRegion, RnnLayout
from nixl_kv.protocol import ReadDone, ReadVerdict
from nixl_kv.state import (
    MAX_BLOCKS,
    MAX_RANKS,
    MAX_TOKENS,
    AttentionType,
    CacheState,
    CommState,
    ContextPhaseParams,
    ConvSectionLayout,
    DataTransceiverState,
    ModelConfig,
    ParallelConfig,
    RankCommInfo,
    RnnConfig,
)

ALL_CLASSES: tuple[type, ...] = (DataTransceiverState, ContextPhaseParams, ReadDone, ReadVerdict)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

Path = tuple[str | int, ...]
Mutation = Callable[[dict[str, Any]], None]


# --- builders --------------------------------------------------------------------------------------------------
def make_layout(kind: LayoutKind, rank: int, num_layers: int, kv_factor: int = 2) -> KVLayout:
    num_heads, tokens_per_block, head_dim, itemsize, num_blocks = 4, 16, 64, 2, 32
    shape = KVLayout(kind, num_blocks, num_layers, kv_factor, num_heads, tokens_per_block, head_dim, itemsize, ())
    base = 0x7F00_0000_0000 + (rank << 32)
    memory = MemoryKind.VRAM if rank % 2 else MemoryKind.DRAM
    size = shape.pool_bytes
    return dataclasses.replace(
        shape, pools=tuple(MemoryRegion(base + i * size, size, rank, memory) for i in range(shape.num_pools))
    )


def make_rnn(pp: int) -> RnnConfig:
    return RnnConfig(
        num_heads=8,
        head_dim=64,
        d_state=128,
        d_conv=4,
        n_groups=2,
        hidden_size=4096,
        conv_section_layout=ConvSectionLayout.XBC,
        conv_dtype=DataType.BFLOAT16,
        ssm_dtype=DataType.FLOAT32,
        layers_per_pp_rank=(3,) * pp,
    )


def make_rnn_layout(rank: int, pp: int) -> RnnLayout:
    """The Mamba pools of one rank of ``make_rnn(pp)`` at TP 1: 3 layers, 4 slots, TensorRT-LLM's layout."""
    layers, slots, channels, width, heads = 3, 4, 8 * 64 + 2 * 2 * 128, 3, 8
    conv_bytes, ssm_bytes = layers * slots * channels * width * 2, layers * slots * heads * 64 * 128 * 4
    base = 0x7E00_0000_0000 + (rank << 36)
    return RnnLayout(
        num_layers=layers, num_slots=slots, conv_channels=channels, conv_width=width, conv_itemsize=2,
        num_heads=heads, head_dim=64, d_state=128, ssm_itemsize=4,
        conv_pools=(MemoryRegion(base, conv_bytes, 0, MemoryKind.DRAM),),
        ssm_pools=(MemoryRegion(base + conv_bytes, ssm_bytes, 0, MemoryKind.DRAM),),
    )  # fmt: skip


def make_state(
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    kind: LayoutKind = LayoutKind.BLOCK_MAJOR,
    rnn: bool = False,
    mla: bool = False,
) -> DataTransceiverState:
    layers_per_rank = 2
    kv_factor = 1 if mla else 2
    model = ModelConfig(num_kv_heads_per_layer=(8,) * (layers_per_rank * pp), head_dim=64, tokens_per_block=16)
    parallel = ParallelConfig(tp=tp, pp=pp, cp=cp, attention_layers_per_pp_rank=(layers_per_rank,) * pp)
    cache = CacheState(
        model=model,
        parallel=parallel,
        dtype=DataType.FLOAT16,
        attention_type=AttentionType.MLA if mla else AttentionType.DEFAULT,
        kv_factor=kv_factor,
        enable_block_reuse=True,
        has_indexer_k_cache=mla,
        indexer_dim=128 if mla else 0,
        rnn=make_rnn(pp) if rnn else None,
    )
    ranks = tuple(
        RankCommInfo(
            agent_name=f"ctx-agent-{r}",
            agent_metadata=bytes(range(256)) * 3 + bytes([r]),
            layout=make_layout(kind, r, layers_per_rank, kv_factor),
            listener=f"tcp://10.0.0.{r + 1}:5555" if r % 2 == 0 else "",
            indexer=dataclasses.replace(make_layout(kind, r, layers_per_rank, 1), num_heads=1, head_dim=132, itemsize=1)
            if mla
            else None,
            rnn=make_rnn_layout(r, pp) if rnn else None,
        )
        for r in range(tp * pp * cp)
    )
    return DataTransceiverState(instance_id="ctx-instance-0", cache=cache, comm=CommState(ranks=ranks))


def make_params(draft: tuple[int, ...] | None = (11, 12, (1 << 32) - 1)) -> ContextPhaseParams:
    return ContextPhaseParams(
        request_id=123456789,
        ctx_state=wire.encode(make_state()),
        block_ids=((0, 1, 2, 7), (9, 10)),
        num_tokens=100,
        lease_ms=30_000,
        ctx_dp_rank=1,
        first_gen_tokens=(42,),
        draft_tokens=draft,
        rnn_slot=3,
    )


def make_read_done() -> ReadDone:
    return ReadDone(
        ctx_instance_id="ctx-instance-0",
        request_id=77,
        transfer_id=5,
        reader_metadata=b"\x00\x01meta\xff",
        expected_readers=4,
        failed=True,
        reason="READ failed: remote disconnected",
    )


def make_read_verdict() -> ReadVerdict:
    return ReadVerdict(ctx_instance_id="ctx-instance-0", request_id=77, transfer_id=5, ok=False, reason="unpinned")


def plain(obj: Any) -> dict[str, Any]:
    """The msgpack envelope of ``obj`` as Python objects, ready to be tampered with."""
    return msgpack.unpackb(wire.encode(obj), raw=False)


def pack(envelope: Any) -> bytes:
    return msgpack.packb(envelope, use_bin_type=True)


def put(path: Path, value: Any) -> Mutation:
    def mutate(envelope: dict[str, Any]) -> None:
        target: Any = envelope
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def drop(path: Path) -> Mutation:
    def mutate(envelope: dict[str, Any]) -> None:
        target: Any = envelope
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return mutate


def assert_valid_object(result: Any, cls: type) -> None:
    """A successful decode is a consistent object that survives another round trip unchanged."""
    assert type(result) is cls
    if hasattr(result, "problems"):
        assert result.problems() == []
    assert wire.decode(wire.encode(result), cls) == result


# --- round trips -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(LayoutKind))
@pytest.mark.parametrize("tp,pp,cp", [(1, 1, 1), (3, 1, 1), (1, 3, 1), (1, 1, 3)])
@pytest.mark.parametrize("rnn", [False, True])
def test_transceiver_state_round_trip(kind: LayoutKind, tp: int, pp: int, cp: int, rnn: bool) -> None:
    state = make_state(tp, pp, cp, kind, rnn)
    assert len(state.comm.ranks) == tp * pp * cp
    expected_pools = {LayoutKind.BLOCK_MAJOR: 1, LayoutKind.PER_LAYER_HKND: 2}.get(kind, 4)  # 2 layers per rank
    assert all(len(rank.layout.pools) == expected_pools for rank in state.comm.ranks)
    assert all(rank.layout.problems() == [] for rank in state.comm.ranks)

    decoded = wire.decode(wire.encode(state), DataTransceiverState)

    assert decoded == state
    assert wire.encode(decoded) == wire.encode(state)
    assert decoded.cache.dtype is DataType.FLOAT16
    assert decoded.comm.ranks[0].layout.kind is kind
    assert decoded.comm.ranks[-1].layout.pools[0].memory is state.comm.ranks[-1].layout.pools[0].memory
    assert isinstance(decoded.comm.ranks, tuple)
    if rnn:
        assert decoded.cache.rnn is not None
        assert decoded.cache.rnn.conv_section_layout is ConvSectionLayout.XBC
        assert decoded.cache.rnn.conv_dtype is DataType.BFLOAT16
        assert decoded.cache.rnn.layers_per_pp_rank == (3,) * pp
    else:
        assert decoded.cache.rnn is None


def test_transceiver_state_round_trip_mla_with_indexer() -> None:
    state = make_state(tp=1, pp=3, kind=LayoutKind.PER_LAYER_HND, mla=True)
    decoded = wire.decode(wire.encode(state), DataTransceiverState)
    assert decoded == state
    assert decoded.cache.attention_type is AttentionType.MLA
    assert decoded.cache.kv_factor == 1
    assert decoded.cache.indexer_dim == 128
    assert len(decoded.comm.ranks[0].layout.pools) == 2


@pytest.mark.parametrize("draft", [None, (), (11, 12, (1 << 32) - 1)], ids=["no-draft", "empty-draft", "draft"])
def test_context_phase_params_round_trip(draft: tuple[int, ...] | None) -> None:
    params = make_params(draft)
    decoded = wire.decode(wire.encode(params), ContextPhaseParams)
    assert decoded == params
    assert decoded.draft_tokens == draft  # None and () stay distinct
    assert wire.decode(decoded.ctx_state, DataTransceiverState) == make_state()


def test_context_phase_params_round_trip_at_the_bounds() -> None:
    params = ContextPhaseParams(
        request_id=(1 << 64) - 1,
        ctx_state=b"",
        block_ids=((), (0, MAX_BLOCKS)),
        num_tokens=MAX_TOKENS,
        lease_ms=1 << 40,
        ctx_dp_rank=MAX_RANKS,
        first_gen_tokens=(0, (1 << 32) - 1),
        draft_tokens=((1 << 32) - 1,),
    )
    assert wire.decode(wire.encode(params), ContextPhaseParams) == params


def test_context_phase_params_defaults_may_be_left_out() -> None:
    envelope = plain(make_params())
    for name in ("ctx_dp_rank", "first_gen_tokens", "draft_tokens", "rnn_slot"):
        del envelope["body"][name]
    decoded = wire.decode(pack(envelope), ContextPhaseParams)
    assert decoded == ContextPhaseParams(
        request_id=123456789,
        ctx_state=make_params().ctx_state,
        block_ids=((0, 1, 2, 7), (9, 10)),
        num_tokens=100,
        lease_ms=30_000,
    )


@pytest.mark.parametrize("message", [make_read_done(), make_read_verdict()], ids=["ReadDone", "ReadVerdict"])
def test_control_message_round_trip(message: Any) -> None:
    data = wire.encode(message)
    assert wire.decode(data, type(message)) == message
    assert wire.decode_one_of(data, (ReadDone, ReadVerdict)) == message


def test_read_done_defaults_round_trip() -> None:
    done = ReadDone(ctx_instance_id="c", request_id=0, transfer_id=0, reader_metadata=b"", expected_readers=1)
    decoded = wire.decode(wire.encode(done), ReadDone)
    assert decoded == done
    assert decoded.failed is False
    assert decoded.reason == ""


def test_decode_accepts_bytearray_and_memoryview() -> None:
    data = wire.encode(make_read_verdict())
    assert wire.decode(bytearray(data), ReadVerdict) == make_read_verdict()
    assert wire.decode(memoryview(data), ReadVerdict) == make_read_verdict()


# --- rejections naming the field -------------------------------------------------------------------------------
STATE3 = make_state(tp=1, pp=3)  # three ranks, 6 layers, 2 per PP rank
STATE_NHD = make_state(tp=1, pp=1, kind=LayoutKind.PER_LAYER_NHD)
STATE_HYBRID = make_state(tp=1, pp=2, rnn=True)
PARAMS = make_params()
DONE = make_read_done()
VERDICT = make_read_verdict()
DROP = object()  # as a value: remove the entry instead of replacing it
RNN_BODY = plain(make_state(rnn=True))["body"]["cache"]["rnn"]


def body_path(path: str) -> Path:
    """``"comm.ranks[2].agent_name"`` -> ``("body", "comm", "ranks", 2, "agent_name")``."""
    keys = re.findall(r"\[(\d+)\]|([^.\[\]]+)", path)
    return ("body",) + tuple(int(index) if index else name for index, name in keys)


def case(base: Any, path: str, value: Any, problem: str, id: str, at: str | None = None) -> Any:
    """Set (or DROP) the value at ``path`` of ``base``'s body; the error must name ``at`` (default: path).

    ``at`` is relative to the message, "" naming the message itself.
    """
    where = path if at is None else at
    field = type(base).__name__ + (f".{where}" if where else "")
    return pytest.param(base, path, value, field, problem, id=id)


REJECTIONS = [
    # wrong type
    case(PARAMS, "num_tokens", "100", "expected an integer, got str '100'", "str-for-int"),
    case(PARAMS, "num_tokens", 100.0, "expected an integer, got float 100.0", "float-for-int"),
    case(PARAMS, "num_tokens", None, "expected an integer, got NoneType None", "nil-for-int"),
    case(PARAMS, "ctx_state", "abc", "expected bytes, got str 'abc'", "str-for-bytes"),
    case(PARAMS, "block_ids", {"a": 1}, "expected an array", "map-for-array"),
    case(PARAMS, "block_ids[0]", 5, "expected an array, got int 5", "int-for-inner-array"),
    case(PARAMS, "block_ids[1][0]", "9", "expected an integer", "str-in-array"),
    case(PARAMS, "draft_tokens", b"\x01", "expected an array", "bytes-for-optional-array"),
    case(STATE3, "cache.model.head_dim", 1.5, "expected an integer, got float 1.5", "float-head-dim"),
    case(STATE3, "cache.model", [64], "expected a map, got list [64]", "array-for-map"),
    case(STATE3, "instance_id", 7, "expected a string, got int 7", "int-for-str"),
    case(STATE3, "comm.ranks[0].agent_metadata", "meta", "expected bytes", "str-for-metadata"),
    case(STATE3, "cache.dtype", "float64", "str 'float64' is not one of float32, float16", "bad-enum"),
    case(STATE3, "cache.dtype", [1], "list [1] is not one of", "array-for-enum"),
    case(STATE3, "comm.ranks[2].layout.kind", "nhd", "is not one of block_major", "bad-kind"),
    case(STATE3, "comm.ranks[1].layout.pools[0].memory", "HBM", "is not one of DRAM, VRAM", "bad-memory"),
    case(STATE3, "cache.rnn", 5, "expected a map, got int 5", "int-for-optional-map"),
    case(VERDICT, "ok", 1, "expected a bool, got int 1", "int-for-bool"),
    case(DONE, "failed", None, "expected a bool", "nil-for-bool"),
    # a bool where an integer is expected
    case(PARAMS, "num_tokens", True, "expected an integer, got bool True", "bool-num-tokens"),
    case(PARAMS, "block_ids[0][1]", True, "expected an integer, got bool True", "bool-in-array"),
    case(PARAMS, "draft_tokens[1]", False, "expected an integer, got bool False", "bool-in-optional"),
    case(STATE3, "cache.model.head_dim", False, "expected an integer, got bool False", "bool-head-dim"),
    case(STATE3, "cache.kv_factor", True, "expected an integer", "bool-kv-factor"),
    case(STATE3, "cache.parallel.attention_layers_per_pp_rank[0]", True, "got bool True", "bool-layers"),
    case(DONE, "request_id", True, "expected an integer", "bool-request-id"),
    # out of range
    case(PARAMS, "num_tokens", MAX_TOKENS + 1, f"{MAX_TOKENS + 1} is outside [1, {MAX_TOKENS}]", "too-many-tokens"),
    case(PARAMS, "num_tokens", 0, f"0 is outside [1, {MAX_TOKENS}]", "zero-tokens"),
    case(PARAMS, "lease_ms", 0, "0 is outside [1, 1099511627776]", "zero-lease"),
    case(PARAMS, "lease_ms", (1 << 40) + 1, "1099511627777 is outside [1, 1099511627776]", "long-lease"),
    case(PARAMS, "block_ids[0][2]", MAX_BLOCKS + 1, f"{MAX_BLOCKS + 1} is outside [0, {MAX_BLOCKS}]", "block-id"),
    case(PARAMS, "first_gen_tokens[0]", 1 << 32, "4294967296 is outside [0, 4294967295]", "token-id"),
    case(PARAMS, "ctx_dp_rank", MAX_RANKS + 1, "4097 is outside [0, 4096]", "dp-rank"),
    case(STATE3, "cache.model.head_dim", (1 << 16) + 1, "65537 is outside [1, 65536]", "head-dim"),
    case(STATE3, "cache.model.head_dim", 0, "0 is outside [1, 65536]", "zero-head-dim"),
    case(STATE3, "cache.kv_factor", 3, "3 is outside [1, 2]", "kv-factor"),
    case(STATE3, "cache.parallel.tp", 0, "0 is outside [1, 4096]", "zero-tp"),
    case(STATE3, "cache.model.num_kv_heads_per_layer[5]", 4097, "4097 is outside [1, 4096]", "heads"),
    case(
        STATE3, "cache.rnn", {**RNN_BODY, "d_conv": 1025}, "1025 is outside [1, 1024]", "rnn-d-conv", "cache.rnn.d_conv"
    ),
    case(DONE, "expected_readers", 0, "0 is outside [1, 4096]", "zero-readers"),
    # negative
    case(PARAMS, "num_tokens", -1, f"-1 is outside [1, {MAX_TOKENS}]", "negative-tokens"),
    case(PARAMS, "request_id", -(1 << 63), "-9223372036854775808 is outside [0, 18446744073709551615]", "negative-id"),
    case(PARAMS, "block_ids[1][1]", -3, f"-3 is outside [0, {MAX_BLOCKS}]", "negative-block"),
    case(PARAMS, "draft_tokens[2]", -1, "-1 is outside [0, 4294967295]", "negative-draft"),
    case(STATE3, "cache.parallel.dp_rank", -1, "-1 is outside [0, 4096]", "negative-dp-rank"),
    case(STATE3, "comm.ranks[0].layout.pools[0].address", -4096, "-4096 is outside", "negative-address"),
    case(VERDICT, "transfer_id", -5, "-5 is outside [0, 18446744073709551615]", "negative-transfer"),
    # unknown field
    case(PARAMS, "priority", 1, "unknown field", "unknown-top"),
    case(STATE3, "cache.model.rope_theta", 1, "unknown field", "unknown-nested"),
    case(STATE3, "comm.ranks[1].layout.pools[0].iova", 1, "unknown field", "unknown-deep"),
    case(DONE, "num_tokens", 1, "unknown field", "unknown-control"),
    # missing field
    case(PARAMS, "num_tokens", DROP, "missing", "missing-top"),
    case(PARAMS, "block_ids", DROP, "missing", "missing-block-ids"),
    case(STATE3, "cache.model.head_dim", DROP, "missing", "missing-nested"),
    case(STATE3, "comm.ranks[2].agent_name", DROP, "missing", "missing-agent"),
    case(STATE3, "comm.ranks[0].layout.pools[0].nbytes", DROP, "missing", "missing-deep"),
    case(VERDICT, "ok", DROP, "missing", "missing-control"),
    # too long
    case(STATE3, "instance_id", "x" * 1025, "string of 1025 characters is too long", "long-str"),
    case(STATE3, "comm.ranks[1].agent_name", "é" * 1025, "string of 1025 characters is too long", "long-agent"),
    case(STATE3, "comm.ranks[0].agent_metadata", bytes(65537), "65537 bytes is too long", "long-bytes"),
    case(PARAMS, "ctx_state", bytes((8 << 20) + 1), f"{(8 << 20) + 1} bytes is too long", "long-ctx-state"),
    case(DONE, "reason", "r" * 1025, "string of 1025 characters is too long", "long-reason"),
    case(PARAMS, "draft_tokens", [1] * 65537, "65537 items exceeds the limit of 65536", "long-draft"),
    case(PARAMS, "block_ids", [[0]] * 4097, "4097 items exceeds the limit of 4096", "long-outer"),
    case(
        STATE3, "cache.model.num_kv_heads_per_layer", [1] * 4097, "4097 items exceeds the limit of 4096", "long-heads"
    ),
    # cross-field rules: the error names the object that holds the inconsistent fields
    case(
        STATE3,
        "cache.parallel.attention_layers_per_pp_rank",
        [2, 2, 1],
        "attention layers per PP rank sum to 5, the model has 6",
        "layers-sum",
        "cache",
    ),
    case(
        STATE3,
        "cache.model.num_kv_heads_per_layer",
        [8] * 7,
        "attention layers per PP rank sum to 6, the model has 7",
        "model-layers",
        "cache",
    ),
    case(
        STATE3,
        "cache.parallel.attention_layers_per_pp_rank",
        [3, 3],
        "attention_layers_per_pp_rank has 2 entries, pp is 3",
        "layers-per-pp",
        "cache.parallel",
    ),
    case(
        STATE3, "cache.model.num_kv_heads_per_layer", [], "a model needs at least one layer", "no-layers", "cache.model"
    ),
    case(STATE3, "cache.parallel.dp_rank", 1, "dp_rank 1 is not below dp_size 1", "dp-rank-size", "cache.parallel"),
    case(
        STATE3,
        "cache.parallel.dp_size",
        2,
        "dp_size must be 1 without attention DP",
        "dp-without-adp",
        "cache.parallel",
    ),
    case(STATE3, "cache.parallel.tp", 4096, "tp*pp*cp = 12288 exceeds 4096", "world-too-big", "cache.parallel"),
    case(STATE3, "cache.attention_type", "mla", "MLA caches have kv_factor 1", "mla-kv-factor", "cache"),
    case(STATE3, "cache.has_indexer_k_cache", True, "an indexer-K cache needs indexer_dim > 0", "indexer", "cache"),
    case(STATE3, "comm.ranks[2]", DROP, "comm state lists 2 ranks, the parallel config has 3", "too-few-ranks", ""),
    case(STATE3, "cache.parallel.cp", 2, "comm state lists 3 ranks, the parallel config has 6", "world-mismatch", ""),
    case(
        STATE3,
        "comm.ranks[2].agent_name",
        "ctx-agent-0",
        "agent names must be unique across ranks",
        "duplicate-agent",
        "comm",
    ),
    case(
        STATE3,
        "comm.ranks[1].layout.pools[0]",
        DROP,
        "block_major needs 1 pools, got 0",
        "no-pool",
        "comm.ranks[1].layout",
    ),
    case(
        STATE_NHD,
        "comm.ranks[0].layout.pools[3]",
        DROP,
        "per_layer_nhd needs 4 pools, got 3",
        "nhd-pools",
        "comm.ranks[0].layout",
    ),
    case(
        STATE_NHD,
        "comm.ranks[0].layout.kind",
        "block_major",
        "block_major needs 1 pools, got 4",
        "kind-pools",
        "comm.ranks[0].layout",
    ),
    case(
        STATE3,
        "comm.ranks[0].layout.pools[0].nbytes",
        100,
        "pool 0 holds 100 bytes, the layout needs 1048576",
        "small-pool",
        "comm.ranks[0].layout",
    ),
    case(
        STATE3,
        "comm.ranks[0].layout.num_heads",
        0,
        "every dimension must be at least 1",
        "zero-dim",
        "comm.ranks[0].layout",
    ),
    case(PARAMS, "block_ids", [], "block_ids needs one list per ctx CP rank", "no-cp-lists", ""),
    case(PARAMS, "rnn_slot", -1, "-1 is outside [0, 2147483647]", "negative-rnn-slot"),
    case(
        STATE_HYBRID,
        "comm.ranks[1].rnn.conv_pools[0].nbytes",
        100,
        "conv pool 0 holds 100 bytes, needs",
        "small-conv-pool",
        "comm.ranks[1].rnn",
    ),
    case(
        STATE_HYBRID,
        "comm.ranks[0].rnn.ssm_pools",
        [],
        "ssm state needs 1 or 3 pools, got 0",
        "no-ssm-pools",
        "comm.ranks[0].rnn",
    ),
    case(
        STATE_HYBRID, "comm.ranks[0].rnn.d_state", 0, "every RNN state dimension", "zero-rnn-dim", "comm.ranks[0].rnn"
    ),
    case(STATE_HYBRID, "cache.rnn.d_conv", 1, "d_conv must be at least 2, got 1", "d-conv-1", "cache.rnn"),
    case(
        STATE_HYBRID,
        "cache.rnn.layers_per_pp_rank",
        [3],
        "rnn layers_per_pp_rank has 1 entries, pp is 2",
        "rnn-pp-split",
        "cache",
    ),
]


@pytest.mark.parametrize("base,path,value,field,problem", REJECTIONS)
def test_rejection_names_the_field(base: Any, path: str, value: Any, field: str, problem: str) -> None:
    envelope = plain(base)
    keys = body_path(path)
    (drop(keys) if value is DROP else put(keys, value))(envelope)
    with pytest.raises(WireFormatError) as info:
        wire.decode(pack(envelope), type(base))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert problem in info.value.problem


@pytest.mark.parametrize(
    "key,value,problem",
    [
        ("nixl_kv", 1, "unsupported wire version 1, this build speaks 2"),  # proofs were the secret itself
        ("nixl_kv", 3, "unsupported wire version 3, this build speaks 2"),
        ("nixl_kv", 0, "unsupported wire version 0, this build speaks 2"),
        ("nixl_kv", True, "unsupported wire version True, this build speaks 2"),
        ("nixl_kv", "2", "unsupported wire version '2', this build speaks 2"),
        ("nixl_kv", 2.0, "unsupported wire version 2.0, this build speaks 2"),
        ("nixl_kv", None, "unsupported wire version None, this build speaks 2"),
        ("type", "ReadDone", "expected one of ContextPhaseParams, got str 'ReadDone'"),
        ("type", "contextphaseparams", "expected one of ContextPhaseParams, got str 'contextphaseparams'"),
        ("type", 3, "expected one of ContextPhaseParams, got int 3"),
        ("type", ["ContextPhaseParams"], "expected one of ContextPhaseParams, got list ['ContextPhaseParams']"),
        ("type", b"ContextPhaseParams", "expected one of ContextPhaseParams, got bytes b'ContextPhaseParams'"),
    ],
)
def test_version_and_type_tag_rejections(key: str, value: Any, problem: str) -> None:
    envelope = plain(PARAMS)
    envelope[key] = value
    with pytest.raises(WireFormatError) as info:
        wire.decode(pack(envelope), ContextPhaseParams)
    assert info.value.field == key
    assert info.value.problem == problem


def test_wrong_class_is_a_type_tag_error() -> None:
    with pytest.raises(WireFormatError) as info:
        wire.decode(wire.encode(make_read_done()), ReadVerdict)
    assert info.value.field == "type"
    assert info.value.problem == "expected one of ReadVerdict, got str 'ReadDone'"


@pytest.mark.parametrize(
    "data,problem",
    [
        (pack([1, "ContextPhaseParams", {}]), "not a nixl_kv envelope"),
        (pack({"nixl_kv": wire.WIRE_VERSION, "type": "ContextPhaseParams"}), "not a nixl_kv envelope"),
        (
            pack({"nixl_kv": wire.WIRE_VERSION, "type": "ContextPhaseParams", "body": {}, "x": 0}),
            "not a nixl_kv envelope",
        ),
        (pack({b"nixl_kv": wire.WIRE_VERSION, b"type": "ContextPhaseParams", b"body": {}}), "not a nixl_kv envelope"),
        (pack({1: 1}), "not valid msgpack"),  # only str keys are allowed
        (b"", "not valid msgpack"),
        (b"\xc1", "not valid msgpack"),
        (wire.encode(PARAMS) + b"\x00", "not valid msgpack"),  # trailing data
        (b"\xd4\x01\x00", "not valid msgpack"),  # ext types are refused
    ],
    ids=["array", "no-body", "extra-key", "bin-keys", "int-key", "empty", "reserved-byte", "trailing", "ext"],
)
def test_envelope_rejections(data: bytes, problem: str) -> None:
    with pytest.raises(WireFormatError) as info:
        wire.decode(data, ContextPhaseParams)
    assert info.value.field == "<message>"
    assert problem in info.value.problem


def test_rejects_non_bytes_and_oversized_messages() -> None:
    with pytest.raises(WireFormatError) as info:
        wire.decode("not bytes", ContextPhaseParams)  # type: ignore[arg-type]
    assert str(info.value) == "<message>: expected bytes, got str"
    with pytest.raises(WireFormatError) as info:
        wire.decode(bytes(wire.MAX_MESSAGE_BYTES + 1), ContextPhaseParams)
    assert info.value.field == "<message>"
    assert info.value.problem == f"{wire.MAX_MESSAGE_BYTES + 1} bytes exceeds the {wire.MAX_MESSAGE_BYTES}-byte limit"


def test_nested_ctx_state_errors_name_their_own_path() -> None:
    """ctx_state travels as bytes; decoding it names the path inside the inner message."""
    inner = plain(make_state())
    inner["body"]["cache"]["model"]["head_dim"] = -1
    params = ContextPhaseParams(request_id=1, ctx_state=pack(inner), block_ids=((0,),), num_tokens=1, lease_ms=1)
    decoded = wire.decode(wire.encode(params), ContextPhaseParams)
    with pytest.raises(WireFormatError) as info:
        wire.decode(decoded.ctx_state, DataTransceiverState)
    assert info.value.field == "DataTransceiverState.cache.model.head_dim"


# --- fuzzing ---------------------------------------------------------------------------------------------------
def decode_or_wire_error(data: bytes, classes: tuple[type, ...]) -> Any:
    """Decode; a WireFormatError is an acceptable answer (returned as None), any other exception fails the test."""
    try:
        return wire.decode_one_of(data, classes)
    except WireFormatError as exc:
        assert isinstance(exc.field, str) and exc.field
        return None


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(data: bytes) -> None:
    result = decode_or_wire_error(data, ALL_CLASSES)
    if result is not None:
        assert_valid_object(result, type(result))


ENVELOPE_PREFIXES = [pack({"nixl_kv": wire.WIRE_VERSION, "type": cls.__name__, "body": {}})[:-1] for cls in ALL_CLASSES]


@FUZZ
@given(st.sampled_from(ENVELOPE_PREFIXES), st.binary(max_size=256))
def test_fuzz_random_body_bytes(prefix: bytes, body: bytes) -> None:
    result = decode_or_wire_error(prefix + body, ALL_CLASSES)
    if result is not None:
        assert_valid_object(result, type(result))


VALID_PAYLOADS = {
    "params-draft": (wire.encode(make_params()), ContextPhaseParams),
    "params-no-draft": (wire.encode(make_params(None)), ContextPhaseParams),
    "state": (wire.encode(make_state(tp=1, pp=3, rnn=True)), DataTransceiverState),
    "read-done": (wire.encode(make_read_done()), ReadDone),
}


@pytest.mark.parametrize("name", list(VALID_PAYLOADS))
def test_every_truncation_is_rejected(name: str) -> None:
    data, cls = VALID_PAYLOADS[name]
    for length in range(len(data)):
        with pytest.raises(WireFormatError) as info:
            wire.decode(data[:length], cls)
        assert info.value.field == "<message>"


SMALL_PARAMS = wire.encode(
    ContextPhaseParams(
        request_id=7, ctx_state=b"state", block_ids=((1, 2), (3,)), num_tokens=40, lease_ms=500, draft_tokens=(9, 8)
    )
)


@st.composite
def byte_mutations(draw: st.DrawFn, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "set"]))
        if op == "insert":
            out.insert(draw(st.integers(0, len(out))), draw(st.integers(0, 255)))
        elif out:
            at = draw(st.integers(0, len(out) - 1))
            if op == "flip":
                out[at] ^= draw(st.integers(1, 255))
            elif op == "delete":
                del out[at]
            else:
                out[at] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC0, 0xC2, 0xC3, 0xCF, 0xD3, 0xDD, 0xDF, 0xFF]))
    return bytes(out)


@FUZZ
@given(st.data())
def test_fuzz_mutated_context_phase_params(data: st.DataObject) -> None:
    base = data.draw(st.sampled_from([SMALL_PARAMS, VALID_PAYLOADS["params-draft"][0]]))
    mutated = data.draw(byte_mutations(base))
    result = decode_or_wire_error(mutated, (ContextPhaseParams,))
    if result is not None:  # e.g. a flipped bit inside an integer can still be a valid message
        assert_valid_object(result, ContextPhaseParams)


MSGPACK_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.sampled_from([0, 1, -1, 2, (1 << 16) + 1, (1 << 24) + 1, (1 << 31), (1 << 32), (1 << 63), (1 << 64) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=24),
    st.sampled_from(["float32", "mla", "block_major", "VRAM", "xbc", "ContextPhaseParams", "", "x" * 1100]),
    st.binary(max_size=24),
)
MSGPACK_VALUES = st.recursive(
    MSGPACK_SCALARS,
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(
            st.sampled_from(["head_dim", "kind", "pools", "ranks", "model", "num_tokens", "x"]) | st.text(max_size=6),
            children,
            max_size=5,
        )
    ),
    max_leaves=12,
)


def value_paths(value: Any, prefix: Path = ()) -> list[Path]:
    """Every position below ``value`` (map values and array items), depth first."""
    paths: list[Path] = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        paths.append(prefix + (key,))
        paths.extend(value_paths(child, prefix + (key,)))
    return paths


STRUCTURAL_BASES = [
    (plain(make_params()), ContextPhaseParams),
    (plain(make_state(tp=1, pp=3, rnn=True)), DataTransceiverState),
    (plain(make_state(kind=LayoutKind.PER_LAYER_HND, mla=True)), DataTransceiverState),
    (plain(make_read_done()), ReadDone),
    (plain(make_read_verdict()), ReadVerdict),
]


@FUZZ
@given(st.data())
def test_fuzz_structural_mutation(data: st.DataObject) -> None:
    base, cls = data.draw(st.sampled_from(STRUCTURAL_BASES))
    envelope = msgpack.unpackb(pack(base), raw=False)  # a fresh copy
    path = data.draw(st.sampled_from(value_paths(envelope)))
    if data.draw(st.booleans()):
        put(path, data.draw(MSGPACK_VALUES))(envelope)
    else:
        drop(path)(envelope)
    result = decode_or_wire_error(pack(envelope), (cls,))
    if result is not None:
        assert_valid_object(result, cls)


@FUZZ
@given(st.sampled_from(ALL_CLASSES), MSGPACK_VALUES)
def test_fuzz_arbitrary_body(cls: type, body: Any) -> None:
    result = decode_or_wire_error(pack({"nixl_kv": wire.WIRE_VERSION, "type": cls.__name__, "body": body}), (cls,))
    if result is not None:
        assert_valid_object(result, cls)


# --- hostile headers -------------------------------------------------------------------------------------------
HUGE = b"\xff\xff\xff\xff"
BODY_PREFIX = pack({"nixl_kv": wire.WIRE_VERSION, "type": "ContextPhaseParams", "body": {}})[:-1]


@pytest.mark.parametrize(
    "data",
    [
        b"\xdd" + HUGE,  # array32 of 2**32-1 elements
        b"\xdf" + HUGE,  # map32 of 2**32-1 pairs
        b"\xdd" + HUGE + b"\x00\x01\x02",
        b"\xdf" + HUGE + b"\xa1a\x00",
        BODY_PREFIX + b"\xdf" + HUGE,
        BODY_PREFIX + b"\xdd" + HUGE,
        BODY_PREFIX + b"\x81\xa9block_ids\xdd" + HUGE + b"\x90",
        BODY_PREFIX + b"\x81\xa9block_ids\x91\xdd" + HUGE + b"\x01",
        BODY_PREFIX + b"\x81\xa9ctx_state\xc6" + HUGE + b"ab",  # bin32
        BODY_PREFIX + b"\x81\xaarequest_id\xdb" + HUGE + b"ab",  # str32
        b"\x91" * 100_000 + b"\x00",  # absurdly deep nesting
    ],
    ids=[
        "array",
        "map",
        "array-short-body",
        "map-short-body",
        "body-map",
        "body-array",
        "field-array",
        "inner-array",
        "bin",
        "str",
        "deep",
    ],
)
def test_hostile_headers_fail_fast(data: bytes) -> None:
    start = time.perf_counter()
    with pytest.raises(WireFormatError) as info:
        wire.decode(data, ContextPhaseParams)
    elapsed = time.perf_counter() - start
    assert info.value.field == "<message>"
    assert elapsed < 0.25  # well under a second: no allocation or loop sized by the claimed length


def test_size_limit_counts_bytes_of_a_multidimensional_memoryview() -> None:
    data = np.zeros((1, wire.MAX_MESSAGE_BYTES + 1), dtype=np.uint8)
    with pytest.raises(WireFormatError) as info:
        wire.decode(memoryview(data), ContextPhaseParams)
    assert info.value.problem == f"{wire.MAX_MESSAGE_BYTES + 1} bytes exceeds the {wire.MAX_MESSAGE_BYTES}-byte limit"


def test_fields_at_their_default_are_left_out() -> None:
    """A peer built before the indexer-K cache, RNN state or layer-wise transfer existed rejects unknown fields;
    messages that do not use them must not carry them."""
    body = msgpack.unpackb(wire.encode(dataclasses.replace(make_params(), rnn_slot=None)), raw=False)["body"]
    assert not {"rnn_slot", "layerwise"} & set(body) and body["ctx_dp_rank"] == 1
    state = msgpack.unpackb(wire.encode(make_state()), raw=False)["body"]
    assert not {"indexer", "rnn", "staging", "slot_bytes"} & set(state["comm"]["ranks"][0])
    assert not {"rnn", "has_indexer_k_cache", "indexer_dim"} & set(state["cache"])
    assert wire.decode(wire.encode(make_state()), DataTransceiverState) == make_state()
