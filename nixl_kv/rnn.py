"""Mamba/RNN state: where a rank keeps it and which part of the model's state each rank holds.

Per Mamba layer a request has one *slot* holding a conv state ``[channels, d_conv - 1]`` and an SSM state
``[heads, head_dim, d_state]``. The conv channels come in *sections* (XBC: x, B, C; QKV: q, k, v; NONE: one
section), each split evenly over the TP ranks, so a rank's channels are its part of every section in section
order; SSM heads split evenly over TP. Mamba layers split over PP by ``RnnConfig.layers_per_pp_rank``. Under
attention DP a rank holds the whole state of the requests it serves. CP is not supported for RNN state.
"""

from __future__ import annotations

from dataclasses import dataclass

from nixl_kv.errors import NotSupportedError
from nixl_kv.state import ConvSectionLayout, ParallelConfig, RnnConfig


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
    """NotSupportedError unless heads and every conv section split evenly over TP and CP is 1."""
    tp = state_tp(parallel)
    if parallel.cp != 1:
        raise NotSupportedError(f"RNN state with CP is not supported (cp={parallel.cp})")
    if rnn.num_heads % tp:
        raise NotSupportedError(f"{rnn.num_heads} Mamba heads do not split evenly over TP {tp}")
    uneven = [size for size in conv_sections(rnn) if size % tp]
    if uneven:
        raise NotSupportedError(
            f"conv sections {conv_sections(rnn)} ({rnn.conv_section_layout.value}) do not split evenly over TP {tp}"
        )


def rnn_layer_range(rnn: RnnConfig, pp_rank: int) -> range:
    start = sum(rnn.layers_per_pp_rank[:pp_rank])
    return range(start, start + rnn.layers_per_pp_rank[pp_rank])


def rnn_share(rnn: RnnConfig, parallel: ParallelConfig, rank: int) -> RnnShare:
    tp = state_tp(parallel)
    tp_rank = 0 if parallel.enable_attention_dp else rank % parallel.tp
    pp_rank = rank // (parallel.tp * parallel.cp)
    channels = tuple(range(tp_rank * (size // tp), (tp_rank + 1) * (size // tp)) for size in conv_sections(rnn))
    per_rank = rnn.num_heads // tp
    return RnnShare(rnn_layer_range(rnn, pp_rank), channels, range(tp_rank * per_rank, (tp_rank + 1) * per_rank))


def overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


def shares_state(mine: RnnShare, theirs: RnnShare) -> bool:
    """True when the two shares have state in common (some layer, and some channel or head)."""
    if not len(overlap(mine.layers, theirs.layers)):
        return False
    common = [overlap(a, b) for a, b in zip(mine.channels, theirs.channels, strict=True)]
    return bool(len(overlap(mine.heads, theirs.heads)) or any(len(c) for c in common))
