"""One instance of ``nixl-kv pair``: a ctx or a gen process, driven by the router over stdin/stdout.

The router sends one JSON command per line and reads one JSON reply per line. The two instances share
nothing but the ContextPhaseParams bytes the router forwards, and NIXL.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from nixl_kv.cache import PagedKVCache
from nixl_kv.config import CacheTransceiverConfig
from nixl_kv.dtypes import DataType
from nixl_kv.fill import Slice, count_mismatches, expected
from nixl_kv.layout import LayoutKind, MemoryKind
from nixl_kv.requests import RequestState, TransferRequest
from nixl_kv.state import AttentionType, CacheState, ModelConfig, ParallelConfig
from nixl_kv.transceiver import CacheTransceiver


@dataclass(frozen=True)
class InstanceSpec:
    """What one side of a pair runs: the model, its share of it, and where its pools live."""

    layers: int
    kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str
    num_blocks: int
    layout: str = LayoutKind.BLOCK_MAJOR.value
    device: str = "cpu"
    lease_ms: int = 60_000
    timeout_ms: int | None = None

    @property
    def data_type(self) -> DataType:
        return DataType(self.dtype)

    def cache_state(self) -> CacheState:
        return CacheState(
            model=ModelConfig((self.kv_heads,) * self.layers, self.head_dim, self.tokens_per_block),
            parallel=ParallelConfig(attention_layers_per_pp_rank=(self.layers,)),
            dtype=self.data_type,
            attention_type=AttentionType.DEFAULT,
        )

    def build_cache(self) -> PagedKVCache:
        return PagedKVCache(
            num_blocks=self.num_blocks,
            num_layers=self.layers,
            num_heads=self.kv_heads,
            tokens_per_block=self.tokens_per_block,
            head_dim=self.head_dim,
            dtype=self.data_type,
            kind=LayoutKind(self.layout),
            memory=MemoryKind.VRAM if self.device == "cuda" else MemoryKind.DRAM,
        )

    def full_slice(self, num_tokens: int) -> Slice:
        return Slice(0, self.layers, 0, self.kv_heads, 2, self.head_dim, 0, num_tokens)


def emit(**reply: Any) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


class ContextInstance:
    def __init__(self, spec: InstanceSpec) -> None:
        self.spec = spec
        self.cache = spec.build_cache()
        self.transceiver = CacheTransceiver(
            self.cache, spec.cache_state(), CacheTransceiverConfig(lease_ms=spec.lease_ms)
        )
        self.requests: list[TransferRequest] = []

    def send(self, requests: list[list[int]]) -> None:
        for request_id, num_tokens in requests:
            self.cache.allocate(request_id, num_tokens)
            values = expected(request_id, self.spec.full_slice(num_tokens), self.spec.data_type.itemsize)
            self.cache.write_tokens(request_id, values)
            request = TransferRequest(request_id, num_tokens=num_tokens)
            self.transceiver.respond_and_send_async(request)
            self.requests.append(request)
            emit(op="params", request_id=request_id, params=base64.b64encode(request.context_phase_params).decode())
        emit(op="sent")

    def settle(self) -> None:
        self.transceiver.check_context_transfer_status(None, mark_complete=True)
        errors = {r.request_id: r.error for r in self.requests if r.state is not RequestState.CONTEXT_COMPLETE}
        for request in self.requests:
            self.cache.free(request.request_id)
        self.requests.clear()
        emit(op="settled", errors=errors)

    def close(self) -> None:
        self.transceiver.close()


class GenerationInstance:
    def __init__(self, spec: InstanceSpec) -> None:
        self.spec = spec
        self.cache = spec.build_cache()
        config = CacheTransceiverConfig(lease_ms=spec.lease_ms, kv_transfer_timeout_ms=spec.timeout_ms)
        self.transceiver = CacheTransceiver(self.cache, spec.cache_state(), config)

    def receive(self, items: list[list[Any]]) -> None:
        """Items are (gen request id, ctx request id, tokens, params); all are pulled at once, then verified."""
        requests = []
        for gen_id, _, num_tokens, params in items:
            self.cache.allocate(gen_id, num_tokens)
            requests.append(TransferRequest(gen_id, context_phase_params=base64.b64decode(params)))
        start = time.perf_counter()
        for request in requests:
            self.transceiver.request_and_receive_async(request)
        self.transceiver.check_gen_transfer_status(None)
        seconds = time.perf_counter() - start
        results = []
        for request, (gen_id, ctx_id, num_tokens, _) in zip(requests, items, strict=True):
            ok = request.state is RequestState.GENERATION_TRANS_COMPLETE
            mismatched = (
                count_mismatches(self.cache.read_tokens(gen_id, num_tokens), ctx_id, self.spec.full_slice(num_tokens))
                if ok
                else 0
            )
            results.append(
                {
                    "request_id": ctx_id,
                    "tokens": num_tokens,
                    "bytes": request.transfer_bytes,
                    "seconds": request.transfer_end - request.transfer_start,
                    "verified": ok and mismatched == 0,
                    "mismatched": mismatched,
                    "error": request.error,
                }
            )
            self.cache.free(gen_id)
        emit(op="received", seconds=seconds, results=results)

    def close(self) -> None:
        self.transceiver.close()


class RawReadBaseline:
    """A plain NIXL READ of one descriptor between the two processes: the ceiling ours is compared with."""

    def __init__(self, role: str, nbytes: int) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(
            f"pair-baseline-{role}-{time.time_ns()}", nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        self.buffer = np.ones(nbytes, dtype=np.uint8)
        self.row = (self.buffer.ctypes.data, nbytes, 0)
        self.registration = self.agent.register_memory([(*self.row, "")], "DRAM")

    def describe(self) -> None:
        emit(op="baseline_source", metadata=base64.b64encode(self.agent.get_agent_metadata()).decode(), row=self.row)

    def serve(self, repeats: int, timeout_s: float = 120.0) -> None:
        """Make progress as the READ target (transports without hardware offload need it) until all reads end."""
        seen, deadline = 0, time.monotonic() + timeout_s
        while seen < repeats and time.monotonic() < deadline:
            seen += sum(len(messages) for messages in self.agent.get_new_notifs().values())
        emit(op="baseline_served", reads=seen)

    def read(self, metadata: str, row: list[int], repeats: int) -> None:
        peer = self.agent.add_remote_agent(base64.b64decode(metadata))
        remote = self.agent.prep_xfer_dlist(peer, np.array([row], dtype=np.uint64), "DRAM")
        local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([self.row], dtype=np.uint64), "DRAM")
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            handle = self.agent.make_prepped_xfer("READ", local, [0], remote, [0], b"baseline")
            state = self.agent.transfer(handle)
            deadline = start + 60
            while state == "PROC" and time.perf_counter() < deadline:
                state = self.agent.check_xfer_state(handle)
            seconds.append(time.perf_counter() - start)
            handle.release()
            if state != "DONE":
                raise RuntimeError(f"baseline READ ended in {state}")
        remote.release()
        local.release()
        self.agent.remove_remote_agent(peer)
        emit(op="baseline_result", seconds=statistics.median(seconds), nbytes=self.row[1])

    def close(self) -> None:
        self.agent.deregister_memory(self.registration)


def serve(role: str, spec: InstanceSpec) -> None:
    instance = ContextInstance(spec) if role == "ctx" else GenerationInstance(spec)
    baseline: RawReadBaseline | None = None
    emit(op="ready")
    try:
        for line in sys.stdin:
            command = json.loads(line)
            op = command["op"]
            if op == "send":
                instance.send(command["requests"])
            elif op == "settle":
                instance.settle()
            elif op == "receive":
                instance.receive(command["items"])
            elif op == "baseline_source":
                baseline = RawReadBaseline(role, command["nbytes"])
                baseline.describe()
            elif op == "baseline_serve" and baseline is not None:
                baseline.serve(command["repeats"])
            elif op == "baseline_read":
                baseline = RawReadBaseline(role, command["row"][1])
                baseline.read(command["metadata"], command["row"], command["repeats"])
            elif op == "quit":
                break
    finally:
        if baseline is not None:
            baseline.close()
        instance.close()
    emit(op="bye")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("role", choices=["ctx", "gen"])
    parser.add_argument("spec", help="InstanceSpec as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format=f"[{args.role}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("nixl").setLevel(logging.WARNING)
    serve(args.role, InstanceSpec(**json.loads(args.spec)))


def spec_json(spec: InstanceSpec) -> str:
    return json.dumps(asdict(spec))


if __name__ == "__main__":
    main()
