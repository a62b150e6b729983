"""Mamba/RNN state: where a rank keeps it and which part of the model's state each rank holds.

Per Mamba layer a request has one *slot* holding a conv state ``[channels, d_conv - 1]`` and an SSM state
``[heads, head_dim, d_state]``. The conv channels come in *sections*, in memory order: XBC is x (``heads *
head_dim``), B and C (``n_groups * d_state`` each); QKV is q and k (``n_groups * d_state`` each) and v (``heads *
head_dim``); NONE is one section of all channels. A rank holds, section by section, the x/v channels of its heads
and the B/C (q/k) channels of its groups: ``n_groups / tp`` groups each, or where there are fewer groups than TP
ranks the one group its heads belong to (replicated over ``tp / n_groups`` ranks, as servers keep it). NONE splits
all channels contiguously. SSM heads split evenly over TP; Mamba layers over PP by ``layers_per_pp_rank``. Under
attention DP a rank holds the whole state of the requests it serves. CP is not supported for RNN state.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from nixl_kv.errors import NotSupportedError
from nixl_kv.state import ConvSectionLayout, ParallelConfig, RnnConfig
from nixl_kv.topology import holds_request, overlap


@dataclass(frozen=True)
class RnnShare:
    """The global Mamba layers, conv channels (one range per section, in section coordinates) and SSM heads
    one rank holds."""

    layers: range
    channels: tuple[range, ...]
    heads: range

    @property
    def num_channels(self) -> int:
        return sum(len(section) for section in self.channels)

    def channel_offset(self, section: int) -> int:
        """Where the section's channels start in the rank's local conv state."""
        return sum(len(previous) for previous in self.channels[:section])


def conv_sections(rnn: RnnConfig) -> tuple[int, ...]:
    """Channel counts of the conv state's sections, in memory order."""
    inner, groups = rnn.num_heads * rnn.head_dim, rnn.n_groups * rnn.d_state
    if rnn.conv_section_layout is ConvSectionLayout.XBC:
        return (inner, groups, groups)
    if rnn.conv_section_layout is ConvSectionLayout.QKV:
        return (groups, groups, inner)
    return (inner + 2 * groups,)


def state_tp(parallel: ParallelConfig) -> int:
    """How many ranks split one request's state (1 under attention DP: a rank serves its requests whole)."""
    return 1 if parallel.enable_attention_dp else parallel.tp


def check_split(rnn: RnnConfig, parallel: ParallelConfig) -> None:
    """NotSupportedError unless the state splits over this layout as servers split it (see the module text)."""
    tp = state_tp(parallel)
    if parallel.cp != 1:
        raise NotSupportedError(f"RNN state with CP is not supported (cp={parallel.cp})")
    if 0 in rnn.layers_per_pp_rank:
        raise NotSupportedError(f"every PP stage needs a Mamba layer (layers per PP rank: {rnn.layers_per_pp_rank})")
    if rnn.num_heads % tp:
        raise NotSupportedError(f"{rnn.num_heads} Mamba heads do not split evenly over TP {tp}")
    if rnn.conv_section_layout is ConvSectionLayout.NONE:
        if conv_sections(rnn)[0] % tp:
            raise NotSupportedError(f"{conv_sections(rnn)[0]} conv channels (layout none) do not split over TP {tp}")
    elif rnn.num_heads % rnn.n_groups:
        raise NotSupportedError(f"{rnn.num_heads} Mamba heads do not form {rnn.n_groups} equal groups")
    elif rnn.n_groups % tp and tp % rnn.n_groups:
        raise NotSupportedError(f"{rnn.n_groups} groups neither split over nor replicate evenly on TP {tp}")


def group_range(n_groups: int, tp: int, tp_rank: int) -> range:
    """The groups a TP rank holds: an even share, or the one group of its heads when groups are fewer than ranks."""
    if n_groups >= tp:
        per_rank = n_groups // tp
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    group = tp_rank // (tp // n_groups)
    return range(group, group + 1)


def rnn_layer_range(rnn: RnnConfig, pp_rank: int) -> range:
    start = sum(rnn.layers_per_pp_rank[:pp_rank])
    return range(start, start + rnn.layers_per_pp_rank[pp_rank])


def rnn_share(rnn: RnnConfig, parallel: ParallelConfig, rank: int) -> RnnShare:
    tp = state_tp(parallel)
    tp_rank = 0 if parallel.enable_attention_dp else rank % parallel.tp
    pp_rank = rank // (parallel.tp * parallel.cp)
    per_rank = rnn.num_heads // tp
    heads = range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    if rnn.conv_section_layout is ConvSectionLayout.NONE:
        size = conv_sections(rnn)[0] // tp
        channels: tuple[range, ...] = (range(tp_rank * size, (tp_rank + 1) * size),)
    else:
        inner = range(heads.start * rnn.head_dim, heads.stop * rnn.head_dim)
        groups = group_range(rnn.n_groups, tp, tp_rank)
        grouped = range(groups.start * rnn.d_state, groups.stop * rnn.d_state)
        xbc = rnn.conv_section_layout is ConvSectionLayout.XBC
        channels = (inner, grouped, grouped) if xbc else (grouped, grouped, inner)
    return RnnShare(rnn_layer_range(rnn, pp_rank), channels, heads)


@dataclass(frozen=True)
class RnnPiece:
    """What a reader takes from one holder rank: common layers, and per section the channels it reads there (empty
    where another holder of a replicated group serves them), and the common SSM heads."""

    layers: range
    channels: tuple[range, ...]
    heads: range


@lru_cache(maxsize=4096)
def rnn_pieces(
    reader_config: RnnConfig,
    reader: ParallelConfig,
    reader_rank: int,
    holder_config: RnnConfig,
    holder: ParallelConfig,
    holder_dp_rank: int,
) -> tuple[tuple[int, RnnPiece], ...]:
    """The holder ranks a reader reads state from, with what it reads from each. Every channel comes from one holder:
    a replicated group from the first of its holders (in TP order) that also holds some of the reader's heads."""
    mine = rnn_share(reader_config, reader, reader_rank)
    holders = [rank for rank in range(holder.world_size) if holds_request(holder, rank, holder_dp_rank)]
    shares = {rank: rnn_share(holder_config, holder, rank) for rank in holders}
    order = sorted(holders, key=lambda rank: (not len(overlap(mine.heads, shares[rank].heads)), rank % holder.tp, rank))
    covered: dict[tuple[range, int], list[range]] = {}
    found = {}
    for rank in order:
        theirs = shares[rank]
        layers = overlap(mine.layers, theirs.layers)
        if not len(layers):
            continue
        channels = []
        for section, (ours, peers) in enumerate(zip(mine.channels, theirs.channels, strict=True)):
            common = overlap(ours, peers)
            done = covered.setdefault((theirs.layers, section), [])
            if any(c.start <= common.start and common.stop <= c.stop for c in done):
                common = range(0)
            elif len(common):
                done.append(common)
            channels.append(common)
        piece = RnnPiece(layers, tuple(channels), overlap(mine.heads, theirs.heads))
        if len(piece.heads) or any(len(c) for c in piece.channels):
            found[rank] = piece
    return tuple(sorted(found.items()))


@lru_cache(maxsize=4096)
def rnn_readers(
    reader_config: RnnConfig,
    reader: ParallelConfig,
    reader_dp_rank: int,
    holder_config: RnnConfig,
    holder: ParallelConfig,
    holder_dp_rank: int,
    holder_rank: int,
) -> frozenset[int]:
    """The reader ranks (of the request's DP rank) that read state from ``holder_rank``."""
    return frozenset(
        rank
        for rank in range(reader.world_size)
        if holds_request(reader, rank, reader_dp_rank)
        and any(
            peer == holder_rank
            for peer, _ in rnn_pieces(reader_config, reader, rank, holder_config, holder, holder_dp_rank)
        )
    )
