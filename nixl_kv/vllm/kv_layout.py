"""vLLM's KV cache tensors described as one ``KVLayout``, and the ``CacheState`` both instances compare.

vLLM hands ``register_kv_caches`` one tensor per attention layer. Two physical forms are known:

- the CPU backend's ``[blocks, kv heads, block size, 2 * head dim]``: per block and head, K dim-major then V
  token-major (its "vec" kernels; ``LayoutKind.PER_LAYER_HKND``, one pool per layer);
- the GPU backends' ``[2, blocks, block size, kv heads, head dim]`` (K and V halves), laid out NHD or, by stride
  order, HND (``PER_LAYER_NHD`` / ``PER_LAYER_HND``, one pool per layer and K/V).

Only ``data_ptr()``, shapes, strides and the tensor's device are read, so CPU and CUDA tensors take the same path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nixl_kv.dtypes import DataType
from nixl_kv.errors import NotSupportedError
from nixl_kv.layout import KVLayout, LayoutKind, MemoryKind, MemoryRegion
from nixl_kv.state import CacheState, ModelConfig, ParallelConfig

TORCH_DTYPES = {torch.float32: DataType.FLOAT32, torch.bfloat16: DataType.BFLOAT16, torch.float16: DataType.FLOAT16}


@dataclass(frozen=True)
class AttentionShape:
    """What one rank's attention layers hold: its kv heads, head dim and block size."""

    num_heads: int
    head_dim: int
    block_size: int


def ordered_layers(kv_caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in model order (both instances name layers alike), each a layer of its own."""
    from vllm.model_executor.models.utils import extract_layer_index

    names = sorted(kv_caches, key=extract_layer_index)
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
    if first.dim() == 4 and tuple(first.shape[1:]) == (H, T, 2 * D) and first.is_contiguous():
        _check_cpu_kernels(first.dtype, T, D)
        kind, halves = LayoutKind.PER_LAYER_HKND, [[t] for t in tensors]
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


def _region(part: torch.Tensor) -> MemoryRegion:
    device = part.device
    memory = MemoryKind.VRAM if device.type == "cuda" else MemoryKind.DRAM
    return MemoryRegion(part.data_ptr(), part.numel() * part.element_size(), device.index or 0, memory)


def cache_state(total_kv_heads: int, layout: KVLayout, dtype: DataType, tp: int) -> CacheState:
    """The instance's cache as nixl_kv compares it with a peer's: heads over TP, every layer on one PP stage."""
    return CacheState(
        ModelConfig((total_kv_heads,) * layout.num_layers, layout.head_dim, layout.tokens_per_block),
        ParallelConfig(tp=tp, attention_layers_per_pp_rank=(layout.num_layers,)),
        dtype,
    )
