"""A transformers model's cache, as nixl_kv's pools hold it: geometry, per-rank pieces, and the way back.

The geometry is probed from the model itself (a one-token forward), so any transformers causal LM whose cache is
a ``DynamicCache`` fits: its attention layers' keys and values ``[batch, kv_heads, tokens, head_dim]`` go to the
paged KV pools, its Mamba layers' conv state ``[batch, channels, d_conv]`` and SSM state ``[batch, heads,
head_dim, d_state]`` to the RNN state pools. The conv state's oldest column is shifted out before the next decode
step convolves, so it is never read: the pools keep ``d_conv - 1`` columns (TensorRT-LLM's layout) and the
rebuilt cache has zeros there. Mamba2 conv channels are x, B, C in that order (``ConvSectionLayout.XBC``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nixl_kv.cache import PagedKVCache
from nixl_kv.dtypes import DataType
from nixl_kv.layout import LayoutKind
from nixl_kv.rnn import conv_sections, rnn_share
from nixl_kv.rnn_cache import RnnStatePools
from nixl_kv.state import CacheState, ConvSectionLayout, ModelConfig, ParallelConfig, RnnConfig
from nixl_kv.topology import share

TORCH_TO_DATA_TYPE = {
    torch.float32: DataType.FLOAT32,
    torch.bfloat16: DataType.BFLOAT16,
    torch.float16: DataType.FLOAT16,
}
SIGNED_OF_WIDTH = {2: (torch.int16, np.int16), 4: (torch.int32, np.int32)}


@dataclass(frozen=True)
class MambaGeometry:
    layers: tuple[int, ...]  # the model's Mamba layer indices
    num_heads: int
    head_dim: int
    d_state: int
    d_conv: int
    n_groups: int
    hidden_size: int
    conv_dtype: DataType
    ssm_dtype: DataType


@dataclass(frozen=True)
class CacheGeometry:
    """What one request's cache is made of, for the whole model (every head, every layer)."""

    attention_layers: tuple[int, ...]  # the model's attention layer indices, in pool order
    kv_heads: int
    head_dim: int
    dtype: DataType
    mamba: MambaGeometry | None

    def parallel(self, tp: int) -> ParallelConfig:
        return ParallelConfig(tp=tp, attention_layers_per_pp_rank=(len(self.attention_layers),))

    def cache_state(self, tp: int, tokens_per_block: int) -> CacheState:
        return CacheState(
            ModelConfig((self.kv_heads,) * len(self.attention_layers), self.head_dim, tokens_per_block),
            self.parallel(tp),
            self.dtype,
            rnn=None if self.mamba is None else self.rnn_config(),
        )

    def rnn_config(self) -> RnnConfig:
        m = self.mamba
        return RnnConfig(
            num_heads=m.num_heads,
            head_dim=m.head_dim,
            d_state=m.d_state,
            d_conv=m.d_conv,
            n_groups=m.n_groups,
            hidden_size=m.hidden_size,
            conv_section_layout=ConvSectionLayout.XBC,
            conv_dtype=m.conv_dtype,
            ssm_dtype=m.ssm_dtype,
            layers_per_pp_rank=(len(m.layers),),
        )


@dataclass
class CachePiece:
    """One request's cache as one rank holds it (or whole), as raw elements (unsigned ints of the dtype's width).

    ``kv`` is ``[attention layer, k/v, head, token, dim]``; ``conv`` ``[mamba layer, channel, d_conv - 1]`` and
    ``ssm`` ``[mamba layer, head, head_dim, d_state]``, or None for a model without Mamba layers.
    """

    kv: np.ndarray
    conv: np.ndarray | None = None
    ssm: np.ndarray | None = None


def probe_geometry(model: torch.nn.Module) -> CacheGeometry:
    """Run one token through the model and read what its cache holds."""
    with torch.no_grad():
        cache = model(torch.zeros((1, 1), dtype=torch.long), use_cache=True).past_key_values
    attention, mamba, keys, conv, ssm = [], [], None, None, None
    for index, layer in enumerate(cache.layers):
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            attention.append(index)
            keys = layer.keys
        states = getattr(layer, "conv_states", None)
        if states:
            mamba.append(index)
            conv, ssm = states[0], layer.recurrent_states[0]
    if keys is None:
        raise ValueError("the model's cache has no attention layer: nothing for the KV pools to hold")
    mamba_geometry = None
    if mamba:
        heads, head_dim, d_state = ssm.shape[1:]
        n_groups, rest = divmod(conv.shape[1] - heads * head_dim, 2 * d_state)
        if rest:
            raise ValueError(f"conv state of {conv.shape[1]} channels is not Mamba2's x, B, C sections")
        mamba_geometry = MambaGeometry(
            tuple(mamba),
            heads,
            head_dim,
            d_state,
            conv.shape[2],
            n_groups,
            model.config.hidden_size,
            TORCH_TO_DATA_TYPE[conv.dtype],
            TORCH_TO_DATA_TYPE[ssm.dtype],
        )
    return CacheGeometry(tuple(attention), keys.shape[1], keys.shape[3], TORCH_TO_DATA_TYPE[keys.dtype], mamba_geometry)


def build_pools(
    state: CacheState, rank: int, kind: LayoutKind, num_blocks: int, num_slots: int, geometry: CacheGeometry
) -> PagedKVCache:
    """This rank's paged KV pools (its kv heads only) and, for a hybrid model, its Mamba state pools."""
    held = share(state.parallel, rank, geometry.kv_heads, 1)
    rnn = None
    if state.rnn is not None:
        mine = rnn_share(state.rnn, state.parallel, rank)
        rnn = RnnStatePools(
            num_layers=len(mine.layers),
            num_slots=num_slots,
            conv_channels=mine.num_channels,
            d_conv=state.rnn.d_conv,
            conv_dtype=state.rnn.conv_dtype,
            num_heads=len(mine.heads),
            head_dim=state.rnn.head_dim,
            d_state=state.rnn.d_state,
            ssm_dtype=state.rnn.ssm_dtype,
            per_layer=kind is not LayoutKind.BLOCK_MAJOR,
        )
    return PagedKVCache(
        num_blocks=num_blocks,
        num_layers=len(held.layers),
        num_heads=len(held.heads),
        tokens_per_block=state.model.tokens_per_block,
        head_dim=geometry.head_dim,
        dtype=geometry.dtype,
        kind=kind,
        rnn=rnn,
    )


# --- the model's cache <-> whole pieces -------------------------------------------------------------------------
def to_elements(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's raw elements as unsigned integers of its width (bf16 has no numpy dtype)."""
    signed_torch, _ = SIGNED_OF_WIDTH[tensor.element_size()]
    data = tensor.detach().contiguous().view(signed_torch).numpy()
    return data.view(np.dtype(f"u{tensor.element_size()}"))


def from_elements(elements: np.ndarray, dtype: DataType) -> torch.Tensor:
    signed_torch, signed_numpy = SIGNED_OF_WIDTH[dtype.itemsize]
    torch_dtype = next(t for t, d in TORCH_TO_DATA_TYPE.items() if d is dtype)
    return torch.from_numpy(np.ascontiguousarray(elements).view(signed_numpy)).view(signed_torch).view(torch_dtype)


def whole_piece(cache: object, geometry: CacheGeometry) -> CachePiece:
    """The request's cache (batch of one) after prefill, every head and channel."""
    layers = cache.layers
    kv = np.stack(
        [
            np.stack([to_elements(layers[i].keys[0]), to_elements(layers[i].values[0])])
            for i in geometry.attention_layers
        ]
    )
    if geometry.mamba is None:
        return CachePiece(kv)
    conv = np.stack([to_elements(layers[i].conv_states[0][0, :, 1:]) for i in geometry.mamba.layers])
    ssm = np.stack([to_elements(layers[i].recurrent_states[0][0]) for i in geometry.mamba.layers])
    return CachePiece(kv, conv, ssm)


def model_cache(piece: CachePiece, geometry: CacheGeometry, config: object) -> object:
    """A fresh ``DynamicCache`` for the model holding a whole piece, ready for the next decode step."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for slot, layer in enumerate(geometry.attention_layers):
        keys, values = (from_elements(piece.kv[slot, kv], geometry.dtype)[None] for kv in (0, 1))
        cache.update(keys, values, layer)
    if geometry.mamba is not None:
        m = geometry.mamba
        for slot, layer in enumerate(m.layers):
            shifted = from_elements(piece.conv[slot], m.conv_dtype)
            conv = torch.cat([torch.zeros_like(shifted[:, :1]), shifted], dim=1)[None]
            cache.update_conv_state(conv, layer)
            cache.update_recurrent_state(from_elements(piece.ssm[slot], m.ssm_dtype)[None], layer)
    return cache


# --- whole pieces <-> rank pieces -------------------------------------------------------------------------------
def rank_piece(whole: CachePiece, state: CacheState, rank: int) -> CachePiece:
    """What ``rank`` of an instance of this state holds of a whole piece: its kv heads, its Mamba channels and heads."""
    heads = share(state.parallel, rank, whole.kv.shape[2], 1).heads
    kv = whole.kv[:, :, heads.start : heads.stop]
    if state.rnn is None:
        return CachePiece(np.ascontiguousarray(kv))
    channels, ssm_heads = _rnn_indices(state, rank)
    return CachePiece(
        np.ascontiguousarray(kv),
        np.ascontiguousarray(whole.conv[:, channels]),
        np.ascontiguousarray(whole.ssm[:, ssm_heads.start : ssm_heads.stop]),
    )


def join_pieces(pieces: list[CachePiece], state: CacheState, geometry: CacheGeometry) -> CachePiece:
    """The whole piece from every rank's piece (each rank's share put back where it belongs)."""
    first = pieces[0]
    kv = np.zeros((first.kv.shape[0], 2, geometry.kv_heads, *first.kv.shape[3:]), first.kv.dtype)
    conv = ssm = None
    if state.rnn is not None:
        m = geometry.mamba
        conv = np.zeros((len(m.layers), sum(conv_sections(state.rnn)), m.d_conv - 1), first.conv.dtype)
        ssm = np.zeros((len(m.layers), m.num_heads, m.head_dim, m.d_state), first.ssm.dtype)
    for rank, piece in enumerate(pieces):
        heads = share(state.parallel, rank, geometry.kv_heads, 1).heads
        kv[:, :, heads.start : heads.stop] = piece.kv
        if state.rnn is not None:
            channels, ssm_heads = _rnn_indices(state, rank)
            conv[:, channels] = piece.conv
            ssm[:, ssm_heads.start : ssm_heads.stop] = piece.ssm
    return CachePiece(kv, conv, ssm)


def _rnn_indices(state: CacheState, rank: int) -> tuple[np.ndarray, range]:
    """The global conv channels (section by section, in the rank's memory order) and SSM heads a rank holds."""
    mine = rnn_share(state.rnn, state.parallel, rank)
    starts = np.cumsum((0, *conv_sections(state.rnn)))[:-1]
    channels = [np.arange(start + r.start, start + r.stop) for start, r in zip(starts, mine.channels, strict=True)]
    return np.concatenate(channels), mine.heads


# --- a rank's pools <-> its piece -------------------------------------------------------------------------------
def write_piece(pools: PagedKVCache, request_id: int, piece: CachePiece) -> None:
    pools.write_tokens(request_id, piece.kv)
    if piece.conv is not None:
        pools.rnn.write(pools.rnn_slot(request_id), piece.conv, piece.ssm)


def read_piece(pools: PagedKVCache, request_id: int, num_tokens: int) -> CachePiece:
    kv = pools.read_tokens(request_id, num_tokens)
    if pools.rnn is None:
        return CachePiece(kv)
    conv, ssm = pools.rnn.read(pools.rnn_slot(request_id))
    return CachePiece(kv, conv, ssm)
