"""vLLM's KV cache tensors described as one ``KVLayout``, and the ``CacheState`` both instances compare.

vLLM hands ``register_kv_caches`` one tensor per attention layer. The physical forms known:

- the CPU backend's ``[blocks, kv heads, block size, 2 * head dim]``: per block and head, K dim-major then V
  token-major (its "vec" kernels; ``LayoutKind.PER_LAYER_HKND``, one pool per layer);
- vLLM 0.32's GPU views ``[blocks, heads, tokens, content]`` of one backing allocation, ordered by its
  ``KVCacheLayout``: a token's K then V of one head in ``content`` (FlashAttention, FlashInfer; or the MLA latent,
  one head), each (block, head, token) unit moved as it is (``kv_factor`` 1). ``LBNHC`` is ``PER_LAYER_NHD``,
  ``LBHNC`` ``PER_LAYER_HND``, the block-outermost ``BLHNC`` (all layers of a block together, the cross-layer
  layout) ``BLOCK_MAJOR``; ``BLNHC`` is refused (``_describe_views``);
- older vLLM's ``[2, blocks, block size, kv heads, head dim]`` (K and V halves), NHD or by stride order HND.

A hybrid model's Mamba2 layers (vLLM's hybrid KV cache manager) get a ``[blocks, ...]`` view of pages that hold a
block's conv state (``[channels, d_conv - 1]``, vLLM's "DS" order) then its SSM state (``[heads, head_dim,
d_state]``); a request's state is one block of the Mamba group, its *slot* (``describe_mamba``: an ``RnnLayout`` of
strided slots).

Only ``data_ptr()``, shapes, strides and the tensor's device are read, so CPU and CUDA tensors take the same path,
and nothing here imports vLLM at import time (the GPU test runs where vLLM is not installed).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

from nixl_kv.dtypes import DataType
from nixl_kv.errors import NotSupportedError
from nixl_kv.layout import KVLayout, LayoutKind, MemoryKind, MemoryRegion, RnnLayout
from nixl_kv.state import AttentionType, CacheState, ConvSectionLayout, ModelConfig, ParallelConfig, RnnConfig

TORCH_DTYPES = {torch.float32: DataType.FLOAT32, torch.bfloat16: DataType.BFLOAT16, torch.float16: DataType.FLOAT16}


@dataclass(frozen=True)
class AttentionShape:
    """What one rank's attention layers hold: its kv heads, head dim and block size (MLA: one head, the latent)."""

    num_heads: int
    head_dim: int
    block_size: int
    mla: bool = False
    cpu: bool = False  # vLLM's CPU attention kernels order the blocks (HKND), not its GPU backends


@dataclass(frozen=True)
class MambaShape:
    """One rank's Mamba2 state of one layer and request, as vLLM's ``MambaSpec`` gives it (``shapes``, ``dtypes``):
    the conv state ``[channels, d_conv - 1]`` and the SSM state ``[heads, head_dim, d_state]``, in this order at the
    start of each block's page."""

    conv: tuple[int, int]
    ssm: tuple[int, int, int]
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype

    @property
    def conv_bytes(self) -> int:
        return prod(self.conv) * self.conv_dtype.itemsize

    @property
    def ssm_bytes(self) -> int:
        return prod(self.ssm) * self.ssm_dtype.itemsize


def ordered_layers(kv_caches: dict[str, torch.Tensor], names: tuple[str, ...] | None = None) -> list[torch.Tensor]:
    """The tensors in model order (both instances name layers alike), each a layer of its own; ``names``: only
    those layers (one KV cache group's)."""
    from vllm.model_executor.models.utils import extract_layer_index

    names = sorted(kv_caches if names is None else names, key=extract_layer_index)
    tensors = [kv_caches[name] for name in names]
    if len({t.data_ptr() for t in tensors}) != len(tensors):
        raise NotSupportedError("layers that share one KV cache tensor are not supported")
    return tensors


def describe(tensors: list[torch.Tensor], shape: AttentionShape) -> tuple[KVLayout, DataType]:
    """The layout of the rank's pools (registered as they are: zero copy) and their element type."""
    if not tensors:
        raise NotSupportedError("the model has no attention layer with a KV cache")
    first = tensors[0]
    dtype = TORCH_DTYPES.get(first.dtype)
    if dtype is None:
        raise NotSupportedError(f"KV cache dtype {first.dtype} is not supported")
    if any(t.shape != first.shape or t.dtype != first.dtype or t.device != first.device for t in tensors):
        raise NotSupportedError("every attention layer's KV cache must have the same shape, dtype and device")
    H, D, T = shape.num_heads, shape.head_dim, shape.block_size
    cpu_hknd = shape.cpu and not shape.mla and first.is_contiguous()
    if first.dim() == 4 and tuple(first.shape[1:]) == (H, T, 2 * D) and cpu_hknd:
        _check_cpu_kernels(first.dtype, T, D)
        kind, halves = LayoutKind.PER_LAYER_HKND, [[t] for t in tensors]
    elif first.dim() == 4:
        return _describe_views(tensors, shape), dtype
    elif first.dim() == 5 and first.shape[0] == 2 and tuple(first.shape[2:]) == (T, H, D):
        kind = _kv_half_kind(first[0])
        halves = [[t[0], t[1]] for t in tensors]
    else:
        raise NotSupportedError(
            f"unknown KV cache tensor shape {tuple(first.shape)} for {H} kv heads, head dim {D}, block size {T}"
        )
    pools = tuple(_region(part) for parts in halves for part in parts)
    layout = KVLayout(
        kind=kind,
        num_blocks=int(first.shape[0] if kind is LayoutKind.PER_LAYER_HKND else first.shape[1]),
        num_layers=len(tensors),
        kv_factor=2,
        num_heads=H,
        tokens_per_block=T,
        head_dim=D,
        itemsize=first.element_size(),
        pools=pools,
    )
    problems = layout.problems()
    if problems:
        raise NotSupportedError(f"vLLM's KV cache does not describe as a layout: {'; '.join(problems)}")
    return layout, dtype


def _describe_views(tensors: list[torch.Tensor], shape: AttentionShape) -> KVLayout:
    """vLLM 0.32's ``[blocks, heads, tokens, content]`` layer views (content: K then V of a head's token, or the MLA
    latent): their strides say the ``KVCacheLayout``; each (block, head, token) unit of ``content`` elements moves
    as it is, so both sides must hold the same content (``kv_factor`` 1, head dim ``content``)."""
    first = tensors[0]
    B, H, T, C = (int(n) for n in first.shape)
    want = shape.head_dim if shape.mla else 2 * shape.head_dim
    if (shape.num_heads, shape.block_size, want) != (H, T, C):
        raise NotSupportedError(
            f"KV cache view {tuple(first.shape)} is not [blocks, {shape.num_heads} heads, {shape.block_size} tokens, "
            f"{want}]"
        )
    block, head, token, elem = first.stride()
    if elem != 1 or any(t.stride() != first.stride() for t in tensors):
        raise NotSupportedError(f"KV cache strides {first.stride()}: content must be contiguous, every layer alike")
    page = H * T * C
    if token == C and (head == T * C or H == 1):
        kind = LayoutKind.PER_LAYER_HND  # LBHNC (FlashInfer's HND; MLA's one head)
    elif head == C and token == H * C:
        kind = LayoutKind.PER_LAYER_NHD  # LBNHC (FlashAttention's)
    else:
        raise NotSupportedError(f"KV cache strides {first.stride()} order a block neither [heads, tokens] nor back")
    itemsize, L = first.element_size(), len(tensors)
    if block == page:
        pools = tuple(MemoryRegion(t.data_ptr(), B * page * itemsize, *_device(t)) for t in tensors)
    elif (
        block == L * page
        and kind is LayoutKind.PER_LAYER_HND
        and all(t.data_ptr() == first.data_ptr() + i * page * itemsize for i, t in enumerate(tensors))
    ):
        kind = LayoutKind.BLOCK_MAJOR
        pools = (MemoryRegion(first.data_ptr(), B * L * page * itemsize, *_device(first)),)
    else:
        raise NotSupportedError(
            f"KV cache block stride {block} for {L} layers of {page}-element pages: only layer-major pages or the "
            "block-outermost [blocks, layers, heads, tokens] (BLHNC) are described"
        )
    layout = KVLayout(kind, B, L, 1, H, T, C, itemsize, pools)
    problems = layout.problems()
    if problems:
        raise NotSupportedError(f"vLLM's KV cache does not describe as a layout: {'; '.join(problems)}")
    return layout


def _device(tensor: torch.Tensor) -> tuple[int, MemoryKind]:
    return tensor.device.index or 0, MemoryKind.VRAM if tensor.device.type == "cuda" else MemoryKind.DRAM


def _check_cpu_kernels(dtype: torch.dtype, block_size: int, head_dim: int) -> None:
    """HKND is the block interior of vLLM's "vec" CPU kernels (K dim-major, V token-major); the others (AMX, NEON,
    vec16, ...) order a block differently, and moving their bytes as HKND would be silently wrong."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim)
    if isa != "vec":
        raise NotSupportedError(f"vLLM's CPU attention uses its {isa!r} kernels here: only 'vec' blocks are described")


def _kv_half_kind(half: torch.Tensor) -> LayoutKind:
    """NHD or HND from the strides of one ``[blocks, block size, heads, dim]`` half (vLLM permutes by stride)."""
    blocks, tokens, heads, dim = half.stride()
    T, H, D = half.shape[1:]
    if dim == 1 and heads == D and tokens == H * D and blocks == T * H * D:
        return LayoutKind.PER_LAYER_NHD
    if dim == 1 and tokens == D and heads == T * D and blocks == H * T * D:
        return LayoutKind.PER_LAYER_HND
    raise NotSupportedError(f"KV cache strides {half.stride()} are neither NHD nor HND")


def describe_mamba(tensors: list[torch.Tensor], shape: MambaShape) -> RnnLayout:
    """The Mamba layers' pages as strided state slots: block b of a layer holds slot b's conv state at the page's
    start and its SSM state right after (``AbstractMambaLayer.bind_kv_cache``); a block's page is the view's
    first stride, whatever padding or other layers lie between pages."""
    if not tensors:
        raise NotSupportedError("the Mamba KV cache group has no layer")
    first = tensors[0]
    if any(t.shape != first.shape or t.stride() != first.stride() or t.device != first.device for t in tensors):
        raise NotSupportedError("every Mamba layer's state pages must have the same shape, strides and device")
    num_blocks, page = int(first.shape[0]), first.stride(0) * first.element_size()
    content = first[0].numel() * first.element_size()
    if content < shape.conv_bytes + shape.ssm_bytes or page < content:
        raise NotSupportedError(
            f"a Mamba page of {content} bytes (stride {page}) cannot hold conv {shape.conv} and SSM {shape.ssm} state"
        )
    (channels, width), (heads, head_dim, d_state) = shape.conv, shape.ssm
    span = (num_blocks - 1) * page
    device, memory = _device(first)
    layout = RnnLayout(
        num_layers=len(tensors),
        num_slots=num_blocks,
        conv_channels=channels,
        conv_width=width,
        conv_itemsize=shape.conv_dtype.itemsize,
        num_heads=heads,
        head_dim=head_dim,
        d_state=d_state,
        ssm_itemsize=shape.ssm_dtype.itemsize,
        conv_pools=tuple(MemoryRegion(t.data_ptr(), span + shape.conv_bytes, device, memory) for t in tensors),
        ssm_pools=tuple(
            MemoryRegion(t.data_ptr() + shape.conv_bytes, span + shape.ssm_bytes, device, memory) for t in tensors
        ),
        conv_slot_stride=page,
        ssm_slot_stride=page,
    )
    problems = layout.problems()
    if problems:
        raise NotSupportedError(f"vLLM's Mamba state does not describe as slots: {'; '.join(problems)}")
    return layout


@dataclass(frozen=True)
class MambaModel:
    """What the model config says of its Mamba2 mixers (a rank's ``MambaShape`` holds its share of them)."""

    num_heads: int
    n_groups: int
    hidden_size: int


def mamba_config(shape: MambaShape, model: MambaModel, tp: int, num_layers: int) -> RnnConfig:
    """The model's Mamba2 state as nixl_kv splits it over TP: conv channels x (this rank's heads), then B and C
    (its groups), as vLLM's Mamba2 mixer shards them; refused when the rank's shape says otherwise."""
    (channels, width), (heads, head_dim, d_state) = shape.conv, shape.ssm
    total_heads, n_groups, hidden_size = model.num_heads, model.n_groups, model.hidden_size
    if heads * tp != total_heads:
        raise NotSupportedError(f"{heads} Mamba heads per rank over TP {tp} are not the model's {total_heads}")
    groups = n_groups // tp if n_groups >= tp else 1
    if channels != heads * head_dim + 2 * groups * d_state:
        raise NotSupportedError(
            f"a conv state of {channels} channels is not x, B, C of {heads} heads and {groups} groups (Mamba2)"
        )
    dtypes = TORCH_DTYPES
    if shape.conv_dtype not in dtypes or shape.ssm_dtype not in dtypes:
        raise NotSupportedError(f"Mamba state dtypes {shape.conv_dtype}, {shape.ssm_dtype} are not supported")
    return RnnConfig(
        num_heads=total_heads,
        head_dim=head_dim,
        d_state=d_state,
        d_conv=width + 1,
        n_groups=n_groups,
        hidden_size=hidden_size,
        conv_section_layout=ConvSectionLayout.XBC,
        conv_dtype=dtypes[shape.conv_dtype],
        ssm_dtype=dtypes[shape.ssm_dtype],
        layers_per_pp_rank=(num_layers,),
    )


def _region(part: torch.Tensor) -> MemoryRegion:
    return MemoryRegion(part.data_ptr(), part.numel() * part.element_size(), *_device(part))


def cache_state(
    total_kv_heads: int,
    layout: KVLayout,
    dtype: DataType,
    tp: int,
    rnn: RnnConfig | None = None,
    mla: bool = False,
) -> CacheState:
    """The instance's cache as nixl_kv compares it with a peer's: heads over TP (MLA: one latent head, replicated),
    every layer on one PP stage, and the Mamba state of a hybrid model beside it."""
    return CacheState(
        ModelConfig((1 if mla else total_kv_heads,) * layout.num_layers, layout.head_dim, layout.tokens_per_block),
        ParallelConfig(tp=tp, attention_layers_per_pp_rank=(layout.num_layers,)),
        dtype,
        attention_type=AttentionType.MLA if mla else AttentionType.DEFAULT,
        kv_factor=layout.kv_factor,
        rnn=rnn,
    )
