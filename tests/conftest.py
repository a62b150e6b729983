"""Shared fixtures: real NIXL agents on loopback (DRAM), never a mock of the transfer engine."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from nixl_kv.cache import PagedKVCache
from nixl_kv.config import CacheTransceiverConfig
from nixl_kv.dtypes import DataType
from nixl_kv.harness.fill import Slice, count_mismatches, expected
from nixl_kv.layout import LayoutKind
from nixl_kv.requests import TransferRequest
from nixl_kv.state import CacheState, ModelConfig, ParallelConfig
from nixl_kv.transceiver import CacheTransceiver

logging.getLogger("nixl").setLevel(logging.WARNING)


@dataclass(frozen=True)
class Shape:
    layers: int = 4
    heads: int = 2
    tokens_per_block: int = 16
    head_dim: int = 8
    dtype: DataType = DataType.FLOAT16
    num_blocks: int = 64
    attention_window: int = 0

    def state(self) -> CacheState:
        return CacheState(
            ModelConfig(
                (self.heads,) * self.layers,
                self.head_dim,
                self.tokens_per_block,
                attention_window=self.attention_window,
            ),
            ParallelConfig(attention_layers_per_pp_rank=(self.layers,)),
            self.dtype,
        )

    def cache(self, kind: LayoutKind = LayoutKind.BLOCK_MAJOR) -> PagedKVCache:
        return PagedKVCache(
            num_blocks=self.num_blocks,
            num_layers=self.layers,
            num_heads=self.heads,
            tokens_per_block=self.tokens_per_block,
            head_dim=self.head_dim,
            dtype=self.dtype,
            kind=kind,
        )

    def where(self, num_tokens: int) -> Slice:
        return Slice(0, self.layers, 0, self.heads, 2, self.head_dim, 0, num_tokens)


@dataclass
class Side:
    cache: PagedKVCache
    transceiver: CacheTransceiver


@dataclass
class Pair:
    shape: Shape
    ctx: Side
    gen: Side

    def prefill(self, request_id: int, num_tokens: int, seed: int | None = None) -> TransferRequest:
        """Allocate, fill from global coordinates and respond on the ctx side."""
        self.ctx.cache.allocate(request_id, num_tokens)
        values = expected(request_id if seed is None else seed, self.shape.where(num_tokens), self.shape.dtype.itemsize)
        self.ctx.cache.write_tokens(request_id, values)
        request = TransferRequest(request_id, num_tokens=num_tokens)
        self.ctx.transceiver.respond_and_send_async(request)
        return request

    def meet(self) -> None:
        """The gen instance meets the ctx instance (``connect_to``): its first READ is then posted at once, instead
        of after the gen's peer directory loaded the ctx agent on its own thread."""
        self.gen.transceiver.connect_to(self.ctx.transceiver.get_serialized_data_transceiver_state())

    def gen_request(self, gen_id: int, ctx_request: TransferRequest) -> TransferRequest:
        self.gen.cache.allocate(gen_id, ctx_request.num_tokens)
        return TransferRequest(gen_id, context_phase_params=ctx_request.context_phase_params)

    def mismatches(self, gen_id: int, seed: int, num_tokens: int) -> int:
        return count_mismatches(self.gen.cache.read_tokens(gen_id, num_tokens), seed, self.shape.where(num_tokens))


def make_side(shape: Shape, kind: LayoutKind = LayoutKind.BLOCK_MAJOR, **config: object) -> Side:
    cache = shape.cache(kind)
    return Side(cache, CacheTransceiver(cache, shape.state(), CacheTransceiverConfig(**config)))


@pytest.fixture
def pair_factory() -> Iterator:
    """Build ctx/gen pairs; every transceiver is closed (and checked for leaks) at the end of the test."""
    made: list[Side] = []

    def build(
        shape: Shape = Shape(),
        ctx_kind: LayoutKind = LayoutKind.BLOCK_MAJOR,
        gen_kind: LayoutKind = LayoutKind.BLOCK_MAJOR,
        ctx_config: dict | None = None,
        gen_config: dict | None = None,
        gen_shape: Shape | None = None,  # the gen side's, where it differs (its tokens per block, say)
    ) -> Pair:
        ctx = make_side(shape, ctx_kind, **(ctx_config or {}))
        gen = make_side(gen_shape or shape, gen_kind, **(gen_config or {}))
        made.extend([ctx, gen])
        return Pair(shape, ctx, gen)

    yield build
    for side in made:
        side.transceiver.close()
        assert side.transceiver._agent.live_handles == {"transfers": 0, "prepared": 0, "remotes": 0, "registrations": 0}
