"""The data model both instances agree on (DESIGN §3): what a cache looks like and how to reach it.

Field bounds live in each field's metadata (``bounds(lo, hi)``, ``max_items``) and cross-field rules in
``problems()``; the wire decoder enforces both, so a decoded object is always internally consistent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from nixl_kv.dtypes import DataType
from nixl_kv.layout import KVLayout, MemoryRegion, RnnLayout

MAX_LAYERS = 4096
MAX_HEADS = 4096
MAX_RANKS = 4096
MAX_TOKENS = 1 << 24
MAX_BLOCKS = 1 << 24


def bounds(lo: int, hi: int, **extra: Any) -> dict[str, Any]:
    """Metadata for an integer field (or the items of an integer tuple)."""
    return {"lo": lo, "hi": hi, **extra}


def small(hi: int) -> Any:
    return field(metadata=bounds(1, hi))


class AttentionType(str, Enum):
    DEFAULT = "default"
    MLA = "mla"


class ConvSectionLayout(str, Enum):
    """How a Mamba conv state's channels are split into sections (each resharded on its own)."""

    NONE = "none"
    XBC = "xbc"
    QKV = "qkv"


@dataclass(frozen=True)
class ModelConfig:
    num_kv_heads_per_layer: tuple[int, ...] = field(metadata=bounds(1, MAX_HEADS, max_items=MAX_LAYERS))
    head_dim: int = small(1 << 16)
    tokens_per_block: int = small(1 << 16)
    attention_window: int = field(default=0, metadata=bounds(0, MAX_TOKENS))  # tokens; 0: full attention

    @property
    def num_layers(self) -> int:
        return len(self.num_kv_heads_per_layer)

    def problems(self) -> list[str]:
        return [] if self.num_kv_heads_per_layer else ["a model needs at least one layer"]


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = field(default=1, metadata=bounds(1, MAX_RANKS))
    pp: int = field(default=1, metadata=bounds(1, MAX_RANKS))
    cp: int = field(default=1, metadata=bounds(1, MAX_RANKS))
    enable_attention_dp: bool = False
    dp_rank: int = field(default=0, metadata=bounds(0, MAX_RANKS))
    dp_size: int = field(default=1, metadata=bounds(1, MAX_RANKS))
    attention_layers_per_pp_rank: tuple[int, ...] = field(
        default=(), metadata=bounds(0, MAX_LAYERS, max_items=MAX_RANKS)
    )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp

    def problems(self) -> list[str]:
        found = []
        if self.world_size > MAX_RANKS:
            found.append(f"tp*pp*cp = {self.world_size} exceeds {MAX_RANKS}")
        if len(self.attention_layers_per_pp_rank) != self.pp:
            found.append(
                f"attention_layers_per_pp_rank has {len(self.attention_layers_per_pp_rank)} entries, pp is {self.pp}"
            )
        if self.dp_rank >= self.dp_size:
            found.append(f"dp_rank {self.dp_rank} is not below dp_size {self.dp_size}")
        if not self.enable_attention_dp and self.dp_size != 1:
            found.append("dp_size must be 1 without attention DP")
        return found


@dataclass(frozen=True)
class RnnConfig:
    num_heads: int = small(MAX_HEADS)
    head_dim: int = small(1 << 16)
    d_state: int = small(1 << 16)
    d_conv: int = small(1 << 10)
    n_groups: int = small(MAX_HEADS)
    hidden_size: int = small(1 << 20)
    conv_section_layout: ConvSectionLayout = ConvSectionLayout.NONE
    conv_dtype: DataType = DataType.FLOAT32
    ssm_dtype: DataType = DataType.FLOAT32
    layers_per_pp_rank: tuple[int, ...] = field(default=(), metadata=bounds(0, MAX_LAYERS, max_items=MAX_RANKS))

    @property
    def num_layers(self) -> int:
        return sum(self.layers_per_pp_rank)

    def problems(self) -> list[str]:
        found = [] if self.d_conv >= 2 else [f"d_conv must be at least 2, got {self.d_conv}"]
        if not self.num_layers:
            found.append("an RNN config needs at least one Mamba layer")
        return found


@dataclass(frozen=True)
class CacheState:
    """What a cache holds and how it is split over the instance's ranks."""

    model: ModelConfig
    parallel: ParallelConfig
    dtype: DataType
    attention_type: AttentionType = AttentionType.DEFAULT
    kv_factor: int = field(default=2, metadata=bounds(1, 2))
    enable_block_reuse: bool = False
    enable_partial_reuse: bool = False
    has_indexer_k_cache: bool = False
    indexer_dim: int = field(default=0, metadata=bounds(0, 1 << 16))
    indexer_k_quant_block_size: int = field(default=128, metadata=bounds(1, 1 << 16))
    rnn: RnnConfig | None = None

    def problems(self) -> list[str]:
        found = []
        if sum(self.parallel.attention_layers_per_pp_rank) != self.model.num_layers:
            found.append(
                f"attention layers per PP rank sum to {sum(self.parallel.attention_layers_per_pp_rank)}, "
                f"the model has {self.model.num_layers}"
            )
        if self.attention_type is AttentionType.MLA and self.kv_factor != 1:
            found.append("MLA caches have kv_factor 1")
        if self.has_indexer_k_cache and self.indexer_dim == 0:
            found.append("an indexer-K cache needs indexer_dim > 0")
        if self.rnn is not None and len(self.rnn.layers_per_pp_rank) != self.parallel.pp:
            found.append(
                f"rnn layers_per_pp_rank has {len(self.rnn.layers_per_pp_rank)} entries, pp is {self.parallel.pp}"
            )
        return found

    @property
    def indexer_bytes_per_token(self) -> int:
        """The DSA indexer-K cache per token and layer: the quantized key plus one 4-byte scale per quant block."""
        if not self.has_indexer_k_cache:
            return 0
        return self.indexer_dim + self.indexer_dim // self.indexer_k_quant_block_size * 4


@dataclass(frozen=True)
class RankCommInfo:
    """How a peer reaches one rank: its agent, the agent's metadata (inline), and the KV it may read."""

    agent_name: str
    agent_metadata: bytes
    layout: KVLayout
    listener: str = ""
    staging: MemoryRegion | None = None  # the rank's staging slots, one registered buffer
    slot_bytes: int = 0
    indexer: KVLayout | None = None  # the DSA indexer-K cache (MLA), same blocks as the KV cache
    rnn: RnnLayout | None = None  # Mamba conv and SSM state (hybrid models)
    board: MemoryRegion | None = None  # the rank's hold board (nixl_kv.holds): readers check their READs on it
    clock_domain: str = field(default="", metadata={"max_len": 128})  # ranks sharing one CLOCK_MONOTONIC: same value
    # the rank's VRAM pools as CUDA IPC handles (``nixl_kv.ipc_path.export_blob``; b"": none)
    ipc_pools: bytes = field(default=b"", metadata={"max_bytes": 1 << 17})


@dataclass(frozen=True)
class CommState:
    ranks: tuple[RankCommInfo, ...] = field(metadata={"max_items": MAX_RANKS})

    def problems(self) -> list[str]:
        names = [rank.agent_name for rank in self.ranks]
        return [] if len(set(names)) == len(names) else ["agent names must be unique across ranks"]


@dataclass(frozen=True)
class DataTransceiverState:
    """Everything a peer instance needs: who we are, what our cache is, and how to read it."""

    instance_id: str
    cache: CacheState
    comm: CommState
    hold_key: bytes = field(default=b"", metadata={"max_bytes": 64})  # keys the hold tokens (nixl_kv.holds)

    def problems(self) -> list[str]:
        world = self.cache.parallel.world_size
        if len(self.comm.ranks) != world:
            return [f"comm state lists {len(self.comm.ranks)} ranks, the parallel config has {world}"]
        return []


@dataclass(frozen=True)
class ContextPhaseParams:
    """What the ctx instance hands the router for one request; the gen instance needs nothing else."""

    request_id: int = field(metadata=bounds(0, (1 << 64) - 1))
    ctx_state: bytes = field(metadata={"max_bytes": 8 << 20})
    block_ids: tuple[tuple[int, ...], ...] = field(
        metadata=bounds(0, MAX_BLOCKS, max_items=MAX_BLOCKS, max_outer=MAX_RANKS)
    )
    num_tokens: int = field(metadata=bounds(1, MAX_TOKENS))
    lease_ms: int = field(metadata=bounds(1, 1 << 40))
    ctx_dp_rank: int = field(default=0, metadata=bounds(0, MAX_RANKS))
    first_gen_tokens: tuple[int, ...] = field(default=(), metadata=bounds(0, (1 << 32) - 1, max_items=1 << 16))
    draft_tokens: tuple[int, ...] | None = field(default=None, metadata=bounds(0, (1 << 32) - 1, max_items=1 << 16))
    layerwise: bool = False  # the ctx side announces per-layer readiness; read each layer when it is ready
    rnn_slot: int | None = field(default=None, metadata=bounds(0, (1 << 31) - 1))  # the request's Mamba state slot
    # The rank that made these params, and its hold promise: the CLOCK_MONOTONIC time until which it keeps the
    # request's blocks whatever happens, masked as on its board (so params whose ids or request were altered
    # carry no promise). A reader on that rank's clock whose READ from it was seen finished before then needs no
    # other proof that the blocks it read were the request's (docs/design_notes.md). 0: no promise.
    ctx_rank: int = field(default=0, metadata=bounds(0, MAX_RANKS))
    masked_promise: int = 0
    # The request's secret (nixl_kv.auth): every control message about the request carries it as its proof.
    secret: bytes = field(default=b"", metadata={"max_bytes": 64})
    # A digest of the prompt's token ids (nixl_kv.params_seal.prompt_digest), b"" when the ctx side gave none: a
    # server binds the params to the prompt they were made for, so a reader can refuse another prompt before a READ.
    prompt_digest: bytes = field(default=b"", metadata={"max_bytes": 64})
    # Must stay the last field: the seal over the encoded params (nixl_kv.params_seal), 0 before sealing.
    checksum: int = 0

    def problems(self) -> list[str]:
        return [] if self.block_ids else ["block_ids needs one list per ctx CP rank"]
