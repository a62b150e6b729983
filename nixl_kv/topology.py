"""Who holds what: the share of a request's KV each rank holds, and which ranks a reader talks to.

Ranks are ordered TP fastest, then CP, then PP (``rank = (pp * cp + cp_rank) * tp + tp_rank``). A rank holds
the layers of its PP stage (uneven splits allowed), the kv heads of its TP rank (all heads under attention
DP; one duplicated head when there are fewer kv heads than TP ranks) and a contiguous part of the request's
blocks under CP (the remainder goes to the lowest CP ranks). Under attention DP only the ranks whose TP rank
is the request's DP rank hold it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from nixl_kv.errors import NotSupportedError
from nixl_kv.state import ParallelConfig


@dataclass(frozen=True)
class Position:
    tp_rank: int
    cp_rank: int
    pp_rank: int


@dataclass(frozen=True)
class Share:
    """The global layers, kv heads and block positions (indices into the request's block list) a rank holds."""

    layers: range
    heads: range
    blocks: range


@dataclass(frozen=True)
class BlockGrid:
    """A request's tokens in blocks of the smaller of the gen and ctx block sizes (each is a whole multiple of it).

    Planning counts blocks of this grid, so both sides' shares and slices are ranges of one kind of block: grid
    block g holds tokens ``[g * tokens, (g + 1) * tokens)`` and is token run ``g % split`` of block ``g // split`` of
    a side whose blocks hold ``split`` of them (the other side's ``split`` is 1). Equal sizes: the sides' blocks.
    """

    tokens: int
    gen_split: int = 1
    ctx_split: int = 1

    @classmethod
    def of(cls, gen_tokens_per_block: int, ctx_tokens_per_block: int) -> BlockGrid:
        tokens = min(gen_tokens_per_block, ctx_tokens_per_block)
        if max(gen_tokens_per_block, ctx_tokens_per_block) % tokens:
            raise NotSupportedError(
                f"tokens_per_block: gen {gen_tokens_per_block}, ctx {ctx_tokens_per_block}: one must be a whole "
                "multiple of the other"
            )
        return cls(tokens, gen_tokens_per_block // tokens, ctx_tokens_per_block // tokens)

    @property
    def uniform(self) -> bool:
        """Both sides' blocks hold the same tokens (grid blocks are their blocks)."""
        return self.gen_split == self.ctx_split == 1

    def blocks(self, num_tokens: int) -> int:
        """Grid blocks of a request of ``num_tokens`` tokens (the last one may be partly filled)."""
        return -(-num_tokens // self.tokens)


def position(parallel: ParallelConfig, rank: int) -> Position:
    return Position(rank % parallel.tp, (rank // parallel.tp) % parallel.cp, rank // (parallel.tp * parallel.cp))


def rank_of(parallel: ParallelConfig, where: Position) -> int:
    return (where.pp_rank * parallel.cp + where.cp_rank) * parallel.tp + where.tp_rank


def layer_range(parallel: ParallelConfig, pp_rank: int) -> range:
    counts = parallel.attention_layers_per_pp_rank
    start = sum(counts[:pp_rank])
    return range(start, start + counts[pp_rank])


def head_duplication(parallel: ParallelConfig, num_heads: int) -> int:
    """How many TP ranks hold each kv head (1 unless there are fewer heads than attention TP ranks)."""
    attention_tp = 1 if parallel.enable_attention_dp else parallel.tp
    if num_heads >= attention_tp:
        if num_heads % attention_tp:
            raise NotSupportedError(f"{num_heads} kv heads do not split evenly over TP {attention_tp}")
        return 1
    if attention_tp % num_heads:
        raise NotSupportedError(f"TP {attention_tp} is not a multiple of {num_heads} kv heads")
    return attention_tp // num_heads


def head_range(parallel: ParallelConfig, num_heads: int, tp_rank: int) -> range:
    if parallel.enable_attention_dp:
        return range(num_heads)
    duplication = head_duplication(parallel, num_heads)
    if duplication > 1:
        head = tp_rank // duplication
        return range(head, head + 1)
    per_rank = num_heads // parallel.tp
    return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)


def cp_block_range(num_blocks: int, cp: int, cp_rank: int) -> range:
    base, extra = divmod(num_blocks, cp)
    start = cp_rank * base + min(cp_rank, extra)
    return range(start, start + base + (1 if cp_rank < extra else 0))


def share(parallel: ParallelConfig, rank: int, num_heads: int, num_blocks: int) -> Share:
    where = position(parallel, rank)
    return Share(
        layer_range(parallel, where.pp_rank),
        head_range(parallel, num_heads, where.tp_rank),
        cp_block_range(num_blocks, parallel.cp, where.cp_rank),
    )


def holds_request(parallel: ParallelConfig, rank: int, dp_rank: int) -> bool:
    """Under attention DP a request lives on the ranks whose TP rank is its DP rank."""
    return not parallel.enable_attention_dp or position(parallel, rank).tp_rank == dp_rank


def overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


@dataclass(frozen=True)
class PeerSlice:
    """What a reader takes from one peer rank: the overlap of the two shares."""

    peer_rank: int
    layers: range
    heads: range
    blocks: range


@lru_cache(maxsize=4096)
def peer_slices(
    reader: ParallelConfig,
    reader_rank: int,
    holder: ParallelConfig,
    num_heads: int,
    num_blocks: int,
    holder_dp_rank: int,
    first_block: int = 0,
) -> tuple[PeerSlice, ...]:
    """The holder ranks a reader reads from, with what it takes from each (the reference's targetIRanks).

    Each needed (layer, head, block) comes from exactly one holder rank: where heads are duplicated over
    holder TP ranks, the reader's TP rank picks the duplicate, which spreads readers over them. Ordered TP
    fastest, then CP, then PP. Blocks before ``first_block`` are not needed (prefix reuse, sliding window).
    """
    mine = share(reader, reader_rank, num_heads, num_blocks)
    mine = Share(mine.layers, mine.heads, overlap(mine.blocks, range(first_block, num_blocks)))
    reader_tp = position(reader, reader_rank).tp_rank
    duplication = 1 if holder.enable_attention_dp else head_duplication(holder, num_heads)
    found = []
    for rank in range(holder.world_size):
        if not holds_request(holder, rank, holder_dp_rank):
            continue
        where = position(holder, rank)
        if duplication > 1 and where.tp_rank % duplication != reader_tp % duplication:
            continue
        theirs = share(holder, rank, num_heads, num_blocks)
        piece = PeerSlice(
            rank,
            overlap(mine.layers, theirs.layers),
            overlap(mine.heads, theirs.heads),
            overlap(mine.blocks, theirs.blocks),
        )
        if len(piece.layers) and len(piece.heads) and len(piece.blocks):
            found.append((where.tp_rank, where.cp_rank, where.pp_rank, piece))
    return tuple(piece for *_, piece in sorted(found, key=lambda item: item[:3]))


@lru_cache(maxsize=4096)
def reader_ranks(
    holder: ParallelConfig,
    holder_rank: int,
    reader: ParallelConfig,
    num_heads: int,
    num_blocks: int,
    holder_dp_rank: int,
    reader_dp_rank: int,
    first_block: int = 0,
) -> tuple[int, ...]:
    """The reader ranks that read from one holder rank, ordered TP fastest, then CP, then PP."""
    found = []
    for rank in range(reader.world_size):
        if not holds_request(reader, rank, reader_dp_rank):
            continue
        slices = peer_slices(reader, rank, holder, num_heads, num_blocks, holder_dp_rank, first_block)
        if any(piece.peer_rank == holder_rank for piece in slices):
            where = position(reader, rank)
            found.append((where.tp_rank, where.cp_rank, where.pp_rank, rank))
    return tuple(rank for *_, rank in sorted(found))
