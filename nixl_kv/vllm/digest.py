"""A digest of one request's KV as it lies in vLLM's cache, token by token: the prefill's after its forward, the
decode's once the pull landed (before vLLM computes anything on it), so the two can be compared byte for byte.

``kv_connector_extra_config {"kv_digest_file": PATH}`` appends one JSON line per request to PATH on each side:
``{"side": "ctx"|"gen", "ctx_request": N, "rank": R, "tokens": T, "digest": HEX}``, keyed by the prefill's request
id (the decode reads it from the params). The digest is over the prompt's tokens only, in token order, whatever the
block size or the block's interior order (vLLM's CPU HKND keeps K dim-major), so instances of different block sizes
compare. Off by default: it copies the request's KV once.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nixl_kv.vllm.kv_layout import AttentionShape


def token_rows(tensor: torch.Tensor, block_ids: Sequence[int], shape: AttentionShape) -> torch.Tensor:
    """One layer's KV of these blocks as ``[tokens, everything of a token]``, in token order."""
    ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=tensor.device)
    H, D, T = shape.num_heads, shape.head_dim, shape.block_size
    if tensor.dim() == 3:  # [blocks, tokens, latent]
        return tensor.index_select(0, ids).reshape(-1, tensor.shape[-1])
    if tensor.dim() == 5:  # [2, blocks, tokens, heads, dim]: K and V halves
        return tensor.index_select(1, ids).permute(1, 2, 0, 3, 4).reshape(len(ids) * T, -1)
    blocks = tensor.index_select(0, ids)  # [blocks, heads, tokens, content]
    if shape.cpu and not shape.mla:  # HKND: per (block, head) K as [dim, token], then V as [token, dim]
        flat = blocks.reshape(len(ids), H, 2 * T * D)
        k = flat[..., : T * D].reshape(len(ids), H, D, T).transpose(2, 3)
        v = flat[..., T * D :].reshape(len(ids), H, T, D)
        blocks = torch.cat((k, v), dim=-1)
    return blocks.permute(0, 2, 1, 3).reshape(len(ids) * T, -1)


def kv_digest(layers: Sequence[torch.Tensor], block_ids: Sequence[int], num_tokens: int, shape: AttentionShape) -> str:
    """blake2b over every layer's first ``num_tokens`` token rows, in layer order."""
    digest = hashlib.blake2b(digest_size=16)
    for tensor in layers:
        rows = token_rows(tensor, block_ids, shape)[:num_tokens].contiguous().cpu()
        digest.update(rows.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class DigestLog:
    """Where one worker appends its requests' digests (one line each, written whole)."""

    path: str
    rank: int

    def write(self, side: str, ctx_request: int, tokens: int, digest: str) -> None:
        line = json.dumps(
            {"side": side, "ctx_request": ctx_request, "rank": self.rank, "tokens": tokens, "digest": digest}
        )
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
