"""One side of tests/test_gpu_vllm_layouts.py: vLLM's KV cache tensors, built as vLLM 0.32 allocates them (one
backing buffer, a ``[blocks, heads, tokens, content]`` view per layer in a ``KVCacheLayout`` order; a hybrid's
Mamba pages sharing that buffer), described by the connector's own layout code (``nixl_kv.vllm.kv_layout``, no vLLM
needed) and moved by a ``CacheTransceiver`` with real NIXL.

    python -m tests.vllm_layout_peer ctx LAYOUT BLOCK_SIZE DEVICE   # prints "OFFER <json>", serves until stdin ends
    python -m tests.vllm_layout_peer gen LAYOUT BLOCK_SIZE DEVICE   # reads that line, pulls, prints "RESULT <json>"

Every element is its global (layer, token, head, index) hashed, so the reader checks each byte it received; a raw
NIXL READ of the same bytes, between the same two processes, is timed beside the requests.
"""

from __future__ import annotations

import base64
import json
import os
import select
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from nixl_kv.comm import SingleProcessComm
from nixl_kv.config import CacheTransceiverConfig
from nixl_kv.requests import RequestState, TransferRequest
from nixl_kv.transceiver import CacheTransceiver
from nixl_kv.vllm.blocks import VllmBlocks
from nixl_kv.vllm.kv_layout import (
    AttentionShape,
    MambaModel,
    MambaShape,
    cache_state,
    describe,
    describe_mamba,
    mamba_config,
)

SMALL = os.environ.get("NIXL_KV_LAYOUT_SMALL") == "1"  # a quick run on a CPU
LAYERS, HEADS, HEAD_DIM, LATENT, NUM_BLOCKS = 4, 8, 128, 576, 512 if SMALL else 4096
TOKENS = (1024, 300, 33) if SMALL else (4096, 1000, 300)  # one request each, then TIMED requests of the first length
TIMED = 2 if SMALL else 8
DIMS = "LBHNC"


@dataclass(frozen=True)
class Spec:
    order: str  # vLLM's KVCacheLayout: the physical order of the logical [L, B, H, N, C]
    mla: bool = False
    mamba: bool = False


LAYOUTS = {
    "flash_attn": Spec("LBNHC"),  # FlashAttention: [blocks, tokens, heads, K|V]
    "flashinfer": Spec("LBHNC"),  # FlashInfer HND: [blocks, heads, tokens, K|V]
    "cross_layer": Spec("BLHNC"),  # block-outermost: a block of every layer together
    "mla": Spec("LBHNC", mla=True),  # [blocks, 1, tokens, latent]
    "mamba": Spec("LBHNC", mamba=True),  # FlashInfer attention + Mamba2 state pages in the same buffer
}
MAMBA = MambaShape((4 * 32 + 2 * 2 * 16, 3), (4, 32, 16), torch.float32, torch.float32)  # 4 heads, 2 groups
MAMBA_MODEL = MambaModel(num_heads=4, n_groups=2, hidden_size=128)


def build(spec: Spec, block_size: int, device: str) -> tuple[list[torch.Tensor], list[torch.Tensor], AttentionShape]:
    """The layer views vLLM makes over one buffer (bfloat16 KV), and a hybrid's Mamba page views over the same."""
    heads, content = (1, LATENT) if spec.mla else (HEADS, 2 * HEAD_DIM)
    shape = (LAYERS, NUM_BLOCKS, heads, block_size, content)
    page = heads * block_size * content
    strides, stride = [0] * 5, 1
    for dim in reversed(spec.order):
        axis = DIMS.index(dim)
        strides[axis], stride = stride, stride * shape[axis]
    buffer = torch.zeros(LAYERS * NUM_BLOCKS * page, dtype=torch.bfloat16, device=device)
    views = [torch.as_strided(buffer, shape[1:], strides[1:], layer * strides[0]) for layer in range(LAYERS)]
    mamba = []
    if spec.mamba:  # layer i's pages are layer i's attention pages, as vLLM's groups share their tensors
        raw, size = buffer.view(torch.int8), buffer.element_size()
        content = MAMBA.conv_bytes + MAMBA.ssm_bytes
        if content > page * size:
            raise ValueError(f"a Mamba page of {content} bytes does not fit an attention page of {page * size}")
        layout = (NUM_BLOCKS, 1, 1, content), (page * size, content, content, 1)
        mamba = [torch.as_strided(raw, *layout, size * layer * strides[0]) for layer in range(LAYERS)]
    attention = AttentionShape(heads, LATENT if spec.mla else HEAD_DIM, block_size, mla=spec.mla)
    return views, mamba, attention


def hashed(shape: tuple[int, ...], salt: int, device: str) -> torch.Tensor:
    """Deterministic int16 values from every element's coordinates (bfloat16's bits)."""
    index = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int64, device=device).reshape(shape)
    return ((index * 2654435761 + salt * 40503) >> 7).to(torch.int16)


def kv_content(views: list[torch.Tensor], blocks: list[int], tokens: int) -> torch.Tensor:
    """The request's KV as ``[layer, token, head, content]`` int16, read through the views at its blocks."""
    index = torch.tensor(blocks, device=views[0].device)
    per_layer = [v[index].permute(0, 2, 1, 3).reshape(-1, v.shape[1], v.shape[3])[:tokens] for v in views]
    return torch.stack(per_layer).view(torch.int16)


def write_kv(views: list[torch.Tensor], blocks: list[int], values: torch.Tensor) -> None:
    layers, tokens, heads, content = values.shape
    block_size = views[0].shape[2]
    for layer, view in enumerate(views):
        for i, block in enumerate(blocks):
            part = values[layer, i * block_size : (i + 1) * block_size].view(torch.bfloat16)
            view[block, :, : len(part)] = part.permute(1, 0, 2)


def state_bytes(pages: list[torch.Tensor], slot: int) -> torch.Tensor:
    return torch.stack([p[slot].reshape(-1) for p in pages])


def serve(name: str, block_size: int, device: str) -> None:
    spec = LAYOUTS[name]
    views, pages, attention = build(spec, block_size, device)
    transceiver, blocks_of = start(spec, views, pages, attention)
    lines = []
    free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist()  # scattered, distinct
    for request_id, tokens in enumerate(TOKENS + (TOKENS[0],) * TIMED, start=1):
        needed = -(-tokens // block_size)
        blocks, free = free[:needed], free[needed:]
        slot = free.pop() if pages else None
        write_kv(views, blocks, hashed((LAYERS, tokens, *views[0].shape[1:2], views[0].shape[3]), request_id, device))
        if pages:
            pages_bytes = hashed((LAYERS, pages[0][0].numel()), 1000 + request_id, device).to(torch.int8)
            for layer, page in enumerate(pages):
                page[slot].view(-1).copy_(pages_bytes[layer])
        if device == "cuda":
            torch.cuda.synchronize()
        blocks_of.register(request_id, tuple(blocks), slot)
        request = TransferRequest(request_id, num_tokens=tokens)
        transceiver.respond_and_send_async(request)
        lines.append(base64.b64encode(request.context_phase_params).decode())
    raw = torch.ones(moved_bytes(views, pages, TOKENS[0]), dtype=torch.int8, device=device)
    raw_agent, raw_meta = raw_agent_for("raw-ctx", raw)
    offer = {"params": lines, "raw": {"meta": raw_meta, "address": raw.data_ptr(), "nbytes": raw.numel()}}
    print("OFFER", json.dumps(offer))
    sys.stdout.flush()
    while not select.select([sys.stdin], [], [], 0.005)[0]:  # until the test closes it: the reader is done
        raw_agent.get_new_notifs()  # progresses the raw agent: its first READ needs the target's wire-up
    transceiver.close()


def pull(name: str, block_size: int, device: str) -> None:
    offer = json.loads(next(line for line in sys.stdin if line.startswith("OFFER "))[len("OFFER ") :])
    spec = LAYOUTS[name]
    views, pages, attention = build(spec, block_size, device)
    transceiver, blocks_of = start(spec, views, pages, attention)
    verified = mismatched = 0
    seconds = []
    for request_id, encoded in enumerate(offer["params"], start=1):
        tokens = (TOKENS + (TOKENS[0],) * TIMED)[request_id - 1]
        blocks = [(NUM_BLOCKS - 1 - 5 * request_id - 2 * i) % NUM_BLOCKS for i in range(-(-tokens // block_size))]
        slot = request_id if pages else None
        blocks_of.register(request_id, tuple(blocks), slot)
        request = TransferRequest(request_id, context_phase_params=base64.b64decode(encoded))
        started = time.perf_counter()
        transceiver.request_and_receive_async(request)
        deadline = time.monotonic() + 30
        while not request.state.terminal:
            transceiver.check_gen_transfer_status(0)
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {request_id} did not end in 30 s")
        seconds.append(time.perf_counter() - started)
        if request.state is not RequestState.GENERATION_TRANS_COMPLETE:
            raise RuntimeError(f"request {request_id} failed: {request.error}")
        got = kv_content(views, blocks, tokens)
        want = hashed((LAYERS, tokens, *views[0].shape[1:2], views[0].shape[3]), request_id, device)
        bad = int((got != want).sum())
        if pages:
            want_state = hashed((LAYERS, pages[0][0].numel()), 1000 + request_id, device).to(torch.int8)
            bad += int((state_bytes(pages, slot) != want_state).sum())
        mismatched += bad
        verified += bad == 0
        blocks_of.forget(request_id)
    raw_p50 = raw_read(offer["raw"], device)
    timed = seconds[len(TOKENS) :]
    nbytes = moved_bytes(views, pages, TOKENS[0])
    print("RESULT", json.dumps({
        "layout": name, "kind": blocks_of.layout.kind.value, "requests": len(offer["params"]), "verified": verified,
        "mismatched_elements": mismatched, "bytes": nbytes, "p50_ms": 1e3 * statistics.median(timed),
        "raw_p50_ms": 1e3 * raw_p50,
    }))  # fmt: skip
    transceiver.close()


def start(spec: Spec, views: list, pages: list, attention: AttentionShape) -> tuple[CacheTransceiver, VllmBlocks]:
    layout, dtype = describe(views, attention)
    rnn_layout = describe_mamba(pages, MAMBA) if pages else None
    rnn = mamba_config(MAMBA, MAMBA_MODEL, 1, LAYERS) if pages else None
    blocks = VllmBlocks(layout, rnn_layout)
    state = cache_state(attention.num_heads, layout, dtype, 1, rnn, mla=spec.mla)
    config = CacheTransceiverConfig(kv_transfer_timeout_ms=20_000, lease_ms=60_000)
    return CacheTransceiver(blocks, state, config, SingleProcessComm()), blocks


def moved_bytes(views: list[torch.Tensor], pages: list[torch.Tensor], tokens: int) -> int:
    _, heads, _, content = views[0].shape
    state = len(pages) * (MAMBA.conv_bytes + MAMBA.ssm_bytes) if pages else 0
    return LAYERS * tokens * heads * content * views[0].element_size() + state


def raw_agent_for(name: str, buffer: torch.Tensor):  # noqa: ANN201 (nixl's agent)
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    memory = "VRAM" if buffer.is_cuda else "DRAM"
    agent.register_memory([(buffer.data_ptr(), buffer.numel(), buffer.device.index or 0, "")], memory)
    return agent, base64.b64encode(agent.get_agent_metadata()).decode()


def raw_read(offer: dict, device: str, repeats: int = TIMED) -> float:
    """The median of a raw NIXL READ of the timed requests' bytes, as one descriptor, from the ctx process."""
    local = torch.zeros(offer["nbytes"], dtype=torch.int8, device=device)
    agent, _ = raw_agent_for("raw-gen", local)
    peer = agent.add_remote_agent(base64.b64decode(offer["meta"]))
    agent.make_connection(peer)  # before the first READ (posted on a connection still being made, it can fail)
    memory = "VRAM" if local.is_cuda else "DRAM"
    index = local.device.index or 0
    local_descs = agent.get_xfer_descs([(local.data_ptr(), local.numel(), index)], memory)
    remote_descs = agent.get_xfer_descs([(offer["address"], offer["nbytes"], index)], memory)
    seconds = []
    for _ in range(repeats + 1):
        handle = agent.initialize_xfer("READ", local_descs, remote_descs, peer)
        started = time.perf_counter()
        state = agent.transfer(handle)
        deadline = time.monotonic() + 30
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(handle)
            if time.monotonic() > deadline:
                raise TimeoutError("the raw READ did not end in 30 s")
        if state == "ERR":
            raise RuntimeError("the raw READ failed")
        seconds.append(time.perf_counter() - started)
        agent.release_xfer_handle(handle)
    return statistics.median(seconds[1:])


if __name__ == "__main__":
    role, layout_name, block, where = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    (serve if role == "ctx" else pull)(layout_name, block, where)
