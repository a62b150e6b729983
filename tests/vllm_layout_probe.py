"""Run in vLLM's venv (tests/test_vllm.py): vLLM's own CPU kernel writes K and V into a KV cache tensor, and
nixl_kv's view of that tensor (``describe`` + ``gather``) must read back exactly what was written, token by token.
Prints the number of mismatched elements per block size."""

from __future__ import annotations

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from nixl_kv.views import gather, pool_views
from nixl_kv.vllm.kv_layout import AttentionShape, describe

H, D, NB = 2, 64, 3
for T in (32, 64):
    tensor = torch.zeros(NB, H, T, 2 * D)
    keys, values = torch.randn(NB * T, H, D), torch.randn(NB * T, H, D)
    k_cache, v_cache = tensor.view(NB, H, 2 * T, D).chunk(2, dim=2)  # as vLLM's CPU attention does
    isa = _get_attn_isa(torch.float32, T, D)
    slots = torch.arange(NB * T, dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(
        keys, values, k_cache, v_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )
    layout, _ = describe([tensor], AttentionShape(H, D, T, cpu=True))
    got = gather(layout, pool_views(layout), np.arange(NB), range(1), range(H))  # [layer, kv, head, token, dim]
    want = np.stack([keys.numpy(), values.numpy()]).transpose(0, 2, 1, 3)[None].view(np.uint32)
    print(f"block {T} isa {isa}: {int((got != want).sum())} mismatched of {want.size}")
