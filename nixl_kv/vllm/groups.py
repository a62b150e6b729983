"""vLLM's KV cache groups as nixl_kv moves them: one attention group (its blocks are the request's paged KV) and, for
a hybrid model, one Mamba group (a request's one block there is its state slot). An MLA model's one group holds the
latent cache (one head, replicated over TP). A model whose every attention layer has one sliding window has one
sliding-window group: vLLM gives a decode instance the null block for each block wholly before the window of the
prompt's last token (``leading_nulls``), and nothing moves into those.

vLLM's hybrid KV cache manager (``SupportsHMA``) gives each request block ids per group. Group structures that
nixl_kv cannot describe as one ``KVLayout`` beside one ``RnnLayout`` (several attention groups, such as full and
sliding-window layers side by side, several Mamba groups) are refused here, by name, when the connector starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nixl_kv.errors import NotSupportedError
from nixl_kv.vllm.kv_layout import MambaShape

BACKOFF = 1  # prompt tokens a hybrid's or sliding window's prefill leaves to the decode (``CacheGroups.backoff``)
NULL_BLOCK = 0  # vLLM's null block: its block pool's first, in a request's block ids where nothing is kept


@dataclass(frozen=True)
class CacheGroups:
    attention: int = 0  # the attention group's index in a request's block ids
    attention_layers: tuple[str, ...] | None = None  # None: every layer vLLM registers
    block_size: int = 16
    mamba: int | None = None  # the Mamba group's index, for hybrid models
    mamba_layers: tuple[str, ...] = ()
    mamba_shape: MambaShape | None = None
    mla: bool = False  # the attention group is MLA's latent cache
    sliding_window: int | None = None  # the attention group's window (tokens), for sliding-window models

    @property
    def backoff(self) -> int:
        """Prompt tokens the prefill does not compute and the decode computes itself: vLLM always recomputes a
        loaded prompt's last token, which a Mamba state that already holds it would take twice; and it gives the
        decode null blocks for the tokens before the window of the token after the loaded ones, one of which that
        recomputed token attends to where the window's start falls at a block's end (prompts of window - 1 + a
        multiple of the block size)."""
        return BACKOFF if self.mamba is not None or self.sliding_window is not None else 0

    @property
    def single(self) -> bool:
        return self.mamba is None

    def kv_blocks(self, block_ids: tuple[list[int], ...] | list[list[int]]) -> list[int]:
        return list(block_ids[self.attention])

    def leading_nulls(self, kv_blocks: list[int]) -> int:
        """How many of a request's first blocks are vLLM's null block (before a sliding window): none move."""
        if self.sliding_window is None:
            return 0
        count = 0
        while count < len(kv_blocks) and kv_blocks[count] == NULL_BLOCK:
            count += 1
        return count

    def slot(self, block_ids: tuple[list[int], ...] | list[list[int]]) -> int | None:
        """The request's Mamba state slot (None without Mamba); ValueError when the group does not give one block."""
        if self.mamba is None:
            return None
        blocks = list(block_ids[self.mamba])
        if len(blocks) != 1:
            raise ValueError(f"the Mamba group gives the request {len(blocks)} blocks, not one state slot")
        return blocks[0]


def cache_groups(kv_cache_config: Any, block_size: int) -> CacheGroups:
    """The groups of vLLM's ``KVCacheConfig`` (None: one attention group of ``block_size``)."""
    if kv_cache_config is None:
        return CacheGroups(block_size=block_size)
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    attention, mamba = [], []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            mamba.append((index, group, spec))
        elif isinstance(spec, FullAttentionSpec | SlidingWindowSpec):  # MLAAttentionSpec is a FullAttentionSpec
            attention.append((index, group, spec))
        else:
            raise NotSupportedError(f"nixl_kv.vllm: a {type(spec).__name__} KV cache group is not supported")
    if len(attention) != 1:
        kinds = sorted({type(spec).__name__ for _, _, spec in attention})
        raise NotSupportedError(
            f"nixl_kv.vllm: {len(attention)} attention KV cache groups ({', '.join(kinds)}), one is supported"
        )
    if len(mamba) > 1:
        raise NotSupportedError(f"nixl_kv.vllm: {len(mamba)} Mamba KV cache groups, one is supported")
    index, group, spec = attention[0]
    mla = isinstance(spec, MLAAttentionSpec)
    window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
    groups = CacheGroups(index, tuple(group.layer_names), spec.block_size)
    if not mamba:  # the one group: every layer vLLM registers
        return CacheGroups(block_size=spec.block_size, mla=mla, sliding_window=window)
    if mla or window is not None:
        raise NotSupportedError(f"nixl_kv.vllm: {type(spec).__name__} beside Mamba state is not supported")
    m_index, m_group, m_spec = mamba[0]
    if len(m_spec.shapes) != 2 or len(m_spec.shapes[0]) != 2 or len(m_spec.shapes[1]) != 3:
        raise NotSupportedError(f"nixl_kv.vllm: Mamba state of shapes {m_spec.shapes} (Mamba2 conv and SSM only)")
    if m_spec.mamba_cache_mode != "none" or m_spec.num_speculative_blocks:
        raise NotSupportedError(
            f"nixl_kv.vllm: Mamba cache mode {m_spec.mamba_cache_mode!r} with {m_spec.num_speculative_blocks} "
            "speculative blocks (one state slot per request is moved: run with prefix caching off)"
        )
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    if not is_conv_state_dim_first():
        raise NotSupportedError(
            "nixl_kv.vllm: vLLM keeps the Mamba conv state as (state, dim) here: set VLLM_SSM_CONV_STATE_LAYOUT=DS"
        )
    (conv, ssm), (conv_dtype, ssm_dtype) = m_spec.shapes, m_spec.dtypes
    shape = MambaShape(tuple(conv), tuple(ssm), conv_dtype, ssm_dtype)
    return CacheGroups(index, groups.attention_layers, spec.block_size, m_index, tuple(m_group.layer_names), shape)
