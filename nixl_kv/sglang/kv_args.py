"""SGLang's ``KVArgs`` described as one ``KVLayout``, and the ``CacheState`` both instances compare.

SGLang hands its transfer backend the KV pool as flat lists: one buffer per layer for K, then one per layer for V
(MHA: ``[pages * page size, kv heads, head dim]`` each, token-major, so a page is ``[page size, heads, dim]``), or
one buffer per layer (MLA: the latent cache, a single "head"). ``kv_item_lens`` is one page of one buffer. That is
``LayoutKind.PER_LAYER_NHD``: one pool per (layer, K/V), registered as it is (zero copy).

Only numbers are read (pointers, lengths, heads, page size, the dtype's name), so this imports without SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nixl_kv.dtypes import DataType
from nixl_kv.errors import NotSupportedError
from nixl_kv.layout import KVLayout, LayoutKind, MemoryKind, MemoryRegion
from nixl_kv.state import AttentionType, CacheState, ModelConfig, ParallelConfig

# SGLang's kv_cache_dtype_str values ("auto" resolves to the model's dtype before it reaches us)
DTYPES = {
    "bfloat16": DataType.BFLOAT16,
    "float16": DataType.FLOAT16,
    "half": DataType.FLOAT16,
    "float32": DataType.FLOAT32,
    "float": DataType.FLOAT32,
    "fp8_e4m3": DataType.FLOAT8,
    "fp8_e5m2": DataType.FLOAT8,
}


@dataclass(frozen=True)
class SglangKV:
    """One rank's KV as nixl_kv sees it."""

    layout: KVLayout
    dtype: DataType
    total_kv_heads: int
    mla: bool


def dtype_of(name: str) -> DataType:
    key = name.removeprefix("torch.").lower()
    if key not in DTYPES:
        raise NotSupportedError(f"SGLang KV cache dtype {name!r} is not supported (known: {sorted(DTYPES)})")
    return DTYPES[key]


def resolve_dtype(*names: str | None) -> DataType:
    """The first of ``names`` that names a dtype: SGLang's ``kv_cache_dtype_str``, then its ``--dtype``, then the
    checkpoint's own; each may be "auto" (the next one decides)."""
    for name in names:
        if name and name != "auto":
            return dtype_of(name)
    raise NotSupportedError("the KV cache dtype is 'auto' everywhere: give SGLang --dtype or --kv-cache-dtype")


def describe(kv_args: Any, mla: bool, dtype: DataType, total_kv_heads: int, tp: int = 1,
             memory: MemoryKind = MemoryKind.DRAM) -> SglangKV:  # fmt: skip
    """The layout of SGLang's KV buffers (target model only: draft entries are refused). The decode's KVArgs carry
    no head counts: the model's (``total_kv_heads``, over ``tp`` ranks, at least one each) say them."""
    if getattr(kv_args, "num_draft_entries", 0):
        raise NotSupportedError("nixl_kv.sglang: speculative decoding's draft KV is not supported")
    ptrs, lens, items = list(kv_args.kv_data_ptrs), list(kv_args.kv_data_lens), list(kv_args.kv_item_lens)
    if not ptrs or len(ptrs) != len(lens) or len(ptrs) != len(items):
        raise NotSupportedError(f"KVArgs lists disagree: {len(ptrs)} pointers, {len(lens)} lengths, {len(items)} items")
    if len(set(items)) != 1 or len(set(lens)) != 1:
        raise NotSupportedError("every KV buffer must have the same page and buffer size")
    page, item = int(kv_args.page_size), items[0]
    kv_factor = 1 if mla else 2
    if len(ptrs) % kv_factor:
        raise NotSupportedError(f"{len(ptrs)} KV buffers do not split into K and V")
    layers = len(ptrs) // kv_factor
    heads = 1 if mla else max(1, total_kv_heads // tp)
    total = 1 if mla else total_kv_heads
    per_token_head = page * heads * dtype.itemsize
    if item % per_token_head:
        raise NotSupportedError(f"a page of {item} bytes is not {page} tokens x {heads} heads of {dtype.value}")
    # K of every layer, then V of every layer -> our (layer, kv) order
    order = [ptrs[kv * layers + layer] for layer in range(layers) for kv in range(kv_factor)]
    layout = KVLayout(
        kind=LayoutKind.PER_LAYER_NHD,
        num_blocks=lens[0] // item,
        num_layers=layers,
        kv_factor=kv_factor,
        num_heads=heads,
        tokens_per_block=page,
        head_dim=item // per_token_head,
        itemsize=dtype.itemsize,
        pools=tuple(MemoryRegion(int(p), int(lens[0]), int(getattr(kv_args, "gpu_id", 0) or 0), memory) for p in order),
    )
    problems = layout.problems()
    if problems:
        raise NotSupportedError(f"SGLang's KV cache does not describe as a layout: {'; '.join(problems)}")
    return SglangKV(layout, dtype, total, mla)


def cache_state(kv: SglangKV, tp: int) -> CacheState:
    """The instance's cache as nixl_kv compares it with a peer's: heads over TP (MLA replicated), one PP stage."""
    layout = kv.layout
    return CacheState(
        ModelConfig((kv.total_kv_heads,) * layout.num_layers, layout.head_dim, layout.tokens_per_block),
        ParallelConfig(tp=tp, attention_layers_per_pp_rank=(layout.num_layers,)),
        kv.dtype,
        attention_type=AttentionType.MLA if kv.mla else AttentionType.DEFAULT,
        kv_factor=1 if kv.mla else 2,
    )
