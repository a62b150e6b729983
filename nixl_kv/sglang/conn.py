"""nixl_kv as an SGLang transfer backend: manager, sender, receiver and bootstrap server.

SGLang's control plane is kept as it is (``sglang.srt.disaggregation.common``): the bootstrap server's registry,
the decode's discovery of the prefill's ranks, heartbeats, rooms and their ``KVPoll`` states. The data plane is
nixl_kv's: SGLang's prefill WRITEs into the decode, here the decode READs. The verbs map so:

- decode ``send_metadata``: the receiver keeps its pages and tells the prefill rank where to send the params;
- prefill ``send`` (last chunk): the request's pages are pinned (``respond_and_send_async``) and its
  ``ContextPhaseParams``, with the request's aux row (first token, logprobs), go to that decode rank;
- decode: the params start the pull into its pages (``request_and_receive_async``); the room is ``Success`` once
  the pull completed and the aux row is written, ``Failed`` once it failed and no READ can still land;
- prefill: the room is ``Success`` once its readers are done (SGLang frees the pages then, never earlier); a room
  that fails or is aborted cancels its response, so a late reader fails instead of reading reused pages.

Every transceiver call is made under one lock: the scheduler thread and the control thread both reach it.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

from nixl_kv.comm import SingleProcessComm
from nixl_kv.config import CacheTransceiverConfig
from nixl_kv.errors import NotSupportedError
from nixl_kv.requests import RequestState, TransferRequest
from nixl_kv.sglang.kv_args import cache_state, describe, resolve_dtype
from nixl_kv.transceiver import CacheTransceiver
from nixl_kv.vllm.blocks import VllmBlocks

log = logging.getLogger(__name__)

GUARD = b"NIXL_KV"  # decode -> prefill: registration and metadata
PARAMS = b"NIXL_KV_PARAMS"  # prefill -> decode: a room's params and aux row
STATUS = b"NIXL_KV_STATUS"  # prefill -> decode: a room's failure
DEFAULT_TIMEOUT_MS = 10_000
DEFAULT_LEASE_MS = 30_000
PUMP_S = 0.0005  # at most one status check per this many seconds from the scheduler's polls
LOG_TRANSFERS = os.environ.get("NIXL_KV_SGLANG_LOG_TRANSFERS", "") not in ("", "0")


def transfer_config() -> CacheTransceiverConfig:
    """A pull's deadline and the prefill's lease; ``NIXL_KV_<FIELD>`` overrides as everywhere."""
    config = CacheTransceiverConfig(
        kv_transfer_timeout_ms=int(os.environ.get("NIXL_KV_SGLANG_TIMEOUT_MS", DEFAULT_TIMEOUT_MS)),
        lease_ms=DEFAULT_LEASE_MS,
        enable_inflight_cancel=True,
    )
    return CacheTransceiverConfig.from_env(config)


def _model_of(server_args: Any) -> Any:
    """SGLang's view of the checkpoint: its kv heads and the dtype "auto" means."""
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig.from_server_args(server_args)


@dataclass(frozen=True)
class _Peer:
    """A decode rank waiting for a room's params (the shape ``CommonKVManager._room_notify_targets`` reads)."""

    endpoint: str
    dst_port: int
    is_dummy: bool = False


@dataclass
class _Pull:
    room: int
    request: TransferRequest
    aux_index: int | None
    aux: list[bytes] = field(default_factory=list)
    ended: bool = False


class NixlKvManager(CommonKVManager):
    kv_status_msg_tag = STATUS
    kv_status_msg_carries_reason = True
    # SGLang holds a failed or aborted room's pages until ``is_abort_release_safe``: here, until no READ can land
    supports_deferred_decode_kv_release = True

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any, is_mla_backend: bool | None = False):
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if self.attn_tp_size != 1 or self.pp_size != 1 or self.attn_cp_size != 1:
            raise NotSupportedError("nixl_kv.sglang: one rank per instance (TP, PP and CP 1) for now")
        if any(len(ptrs) for ptrs in getattr(args, "state_data_ptrs", []) or []):
            raise NotSupportedError("nixl_kv.sglang: state buffers (Mamba, SWA, DSA) are not supported yet")
        model = _model_of(server_args)
        dtype = resolve_dtype(args.kv_cache_dtype_str, server_args.dtype, str(model.dtype))
        kv = describe(args, bool(is_mla_backend), dtype, model.get_total_num_kv_heads(), self.attn_tp_size)
        self._blocks = VllmBlocks(kv.layout)
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._last_pump = 0.0
        self._stopped = False
        self.transceiver = CacheTransceiver(self._blocks, cache_state(kv, 1), transfer_config(), SingleProcessComm())
        log.info("nixl_kv: %d layers of %d pages registered (%s)", kv.layout.num_layers, kv.layout.num_blocks,
                 kv.dtype.value)  # fmt: skip
        self._responding: dict[int, int] = {}  # prefill: our id -> room
        self._room_ids: dict[int, int] = {}  # prefill: room -> our id
        self._pages: dict[int, list[np.ndarray]] = {}  # prefill: room -> the chunks sent so far
        self._expected: dict[int, tuple[np.ndarray, int | None]] = {}  # decode: room -> its pages, aux row
        self._pulls: dict[int, _Pull] = {}  # decode: our id -> pull
        target = self._prefill_thread if disaggregation_mode == DisaggregationMode.PREFILL else self._decode_thread
        threading.Thread(target=target, name="nixl_kv-sglang-control", daemon=True).start()
        if disaggregation_mode == DisaggregationMode.DECODE:
            self._start_heartbeat_checker_thread()

    # --- messages ------------------------------------------------------------------------------------------------
    def build_receiver_registration_message(self) -> list[bytes]:
        return [GUARD, b"None"]  # the params carry everything a reader needs: nothing to register ahead

    def build_receiver_metadata_message(self, *, bootstrap_room: int, **_: Any) -> list[bytes]:
        return [GUARD, str(bootstrap_room).encode(), self.local_ip.encode(), str(self.rank_port).encode()]

    # --- prefill -------------------------------------------------------------------------------------------------
    def _prefill_thread(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while not self._stopped:
            try:
                msg = recv()
                if not msg or msg[0] != GUARD or len(msg) < 2 or msg[1] == b"None":
                    continue  # registrations, and SGLang's own BOOTSTRAP/ABORT frames (an abort fails the room)
                room, peer = int(msg[1]), _Peer(msg[2].decode(), int(msg[3]))
                with self._lock:
                    if self.request_status.get(room) not in (None, KVPoll.Bootstrapping):
                        continue
                    self.transfer_infos[room] = {peer.endpoint: peer}
                    self.update_status(room, KVPoll.WaitingForInput)
            except Exception:
                log.exception("nixl_kv: the prefill control thread failed a message")

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: npt.NDArray[np.int32],
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        state_indices: Any = None,
        num_kv_tokens: int | None = None,
        **_: Any,
    ) -> None:
        with self._lock:
            if self.request_status.get(bootstrap_room) in (None, KVPoll.Failed) or not self.transfer_infos.get(
                bootstrap_room
            ):
                return
            self._pages.setdefault(bootstrap_room, []).append(np.asarray(kv_indices, dtype=np.int64))
            if not is_last_chunk:
                return
            pages = np.concatenate(self._pages.pop(bootstrap_room))
            try:
                params = self._respond(bootstrap_room, pages, num_kv_tokens)
            except Exception as exc:
                self.conclude_failure(bootstrap_room=bootstrap_room, failure_reason=f"nixl_kv: {exc}")
                return
            aux = self._read_aux(aux_index)
            self.update_status(bootstrap_room, KVPoll.Transferring)
        for endpoint, port in self._room_notify_targets(bootstrap_room):
            self._send_multipart_locked(
                f"tcp://{endpoint}:{port}", [PARAMS, str(bootstrap_room).encode(), params, *aux]
            )

    def _respond(self, room: int, pages: np.ndarray, num_tokens: int | None) -> bytes:
        ours = next(self._ids)
        self._blocks.register(ours, tuple(int(p) for p in pages))
        request = TransferRequest(ours, num_tokens=num_tokens or len(pages) * self._blocks.layout.tokens_per_block)
        try:
            self.transceiver.respond_and_send_async(request)
        except Exception:
            self._blocks.forget(ours)
            raise
        self._responding[ours] = room
        self._room_ids[room] = ours
        return request.context_phase_params

    def _read_aux(self, aux_index: int | None) -> list[bytes]:
        if aux_index is None:
            return []
        args = self.kv_args
        return [
            ctypes.string_at(p + aux_index * n, n) for p, n in zip(args.aux_data_ptrs, args.aux_item_lens, strict=True)
        ]

    def update_status(self, bootstrap_room: int, status: Any) -> None:
        with self._lock:
            super().update_status(bootstrap_room, status)
            ours = self._room_ids.get(bootstrap_room)
            if status == KVPoll.Failed and ours is not None:  # SGLang frees the pages next: no reader may get them
                self.transceiver.cancel_request(TransferRequest(ours))

    def _pump_prefill(self) -> None:
        statuses = self.transceiver.check_context_transfer_status(0, mark_complete=True)
        for ours in statuses.completed_request_ids | statuses.error_request_ids:
            room = self._responding.pop(ours, None)
            if room is None:
                continue
            self._room_ids.pop(room, None)
            self._blocks.forget(ours)
            if ours in statuses.completed_request_ids:
                self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)
            else:
                self.conclude_failure(bootstrap_room=room, failure_reason="nixl_kv: the decode did not read the KV")

    # --- decode --------------------------------------------------------------------------------------------------
    def expect(self, room: int, kv_indices: npt.NDArray[np.int32], aux_index: int | None) -> None:
        with self._lock:
            self._expected[room] = (np.asarray(kv_indices, dtype=np.int64), aux_index)

    def forget_room(self, room: int) -> None:
        """The receiver is cleared: a pull still in flight is cancelled (its blocks stay registered until no READ
        can land, ``_pump_decode``)."""
        with self._lock:
            self._expected.pop(room, None)
            for pull in self._pulls.values():
                if pull.room == room and not pull.ended:
                    self.transceiver.cancel_request(pull.request)

    def _decode_thread(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while not self._stopped:
            try:
                msg = recv()
                if not msg:
                    continue
                if msg[0] == PARAMS and len(msg) >= 3:
                    self._start_pull(int(msg[1]), msg[2], list(msg[3:]))
                    continue
                parsed = self.parse_kv_status_message(msg)
                if parsed is not None and parsed[1] == KVPoll.Failed:  # Success is ours to decide, by the pull
                    room, status, rank, reason = parsed
                    with self._lock:
                        self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=rank,
                                                  failure_reason=reason)  # fmt: skip
            except Exception:
                log.exception("nixl_kv: the decode control thread failed a message")

    def _start_pull(self, room: int, params: bytes, aux: list[bytes]) -> None:
        with self._lock:
            expected = self._expected.pop(room, None)
            if expected is None or self.request_status.get(room) in (None, KVPoll.Failed):
                return  # the room ended meanwhile: its prefill's lease ends it there
            pages, aux_index = expected
            ours = next(self._ids)
            self._blocks.register(ours, tuple(int(p) for p in pages))
            pull = self._pulls[ours] = _Pull(room, TransferRequest(ours, context_phase_params=params), aux_index, aux)
            self.update_status(room, KVPoll.Transferring)
            try:
                self.transceiver.request_and_receive_async(pull.request)
            except Exception as exc:  # refused before any READ (undecodable params, incompatible pair)
                pull.request.fail(f"{type(exc).__name__}: {exc}")
                pull.ended = True

    def _pump_decode(self) -> None:
        statuses = self.transceiver.check_gen_transfer_status(0)
        for ours in statuses.completed_request_ids | statuses.error_request_ids:
            if ours in self._pulls:
                self._pulls[ours].ended = True
        for ours, pull in list(self._pulls.items()):
            if pull.ended and not self._blocks.pinned(ours):  # a READ that may still land keeps the pages
                del self._pulls[ours]
                self._blocks.forget(ours)
                self._finish(pull)

    def _finish(self, pull: _Pull) -> None:
        if pull.room not in self.request_status:
            return  # the room was cleared (aborted, failed): nothing waits for it, and nothing may be left for it
        if pull.request.state is not RequestState.GENERATION_TRANS_COMPLETE:
            self.record_failure(pull.room, f"nixl_kv: {pull.request.error}")
            self.update_status(pull.room, KVPoll.Failed)
            return
        if LOG_TRANSFERS:  # each pull's own time, for scripts/bench_sglang.sh
            request = pull.request
            log.info("nixl_kv transfer: room %d, %d bytes in %.3f ms", pull.room, request.transfer_bytes,
                     (request.transfer_end - request.transfer_start) * 1e3)  # fmt: skip
        args = self.kv_args
        if pull.aux_index is not None:
            for ptr, n, data in zip(args.aux_data_ptrs, args.aux_item_lens, pull.aux, strict=True):
                ctypes.memmove(ptr + pull.aux_index * n, data, min(n, len(data)))
        self.update_status(pull.room, KVPoll.Success)

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """SGLang's deferred release of a failed or aborted room's pages: safe once no pull of the room can still
        land in them (the prefill writes nothing here, so its acks, ``required_acks``, say nothing)."""
        self._pump()
        with self._lock:
            return bootstrap_room not in self._expected and all(p.room != bootstrap_room for p in self._pulls.values())

    # --- both ----------------------------------------------------------------------------------------------------
    def _pump(self) -> None:
        """Collect ended transfers, at most once per ``PUMP_S`` (the scheduler polls every room every step)."""
        now = time.monotonic()
        if now - self._last_pump < PUMP_S:
            return
        self._last_pump = now
        with self._lock:
            if self.disaggregation_mode == DisaggregationMode.PREFILL:
                if self._responding:
                    self._pump_prefill()
            elif self._pulls:
                self._pump_decode()

    def check_status(self, bootstrap_room: int) -> Any:
        self._pump()
        return self.request_status[bootstrap_room]


class NixlKvSender(CommonKVSender):
    pass


class NixlKvReceiver(CommonKVReceiver):
    def send_metadata(
        self,
        kv_indices: npt.NDArray[np.int32],
        aux_index: int | None = None,
        state_indices: Any = None,
        decode_prefix_len: int | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if decode_prefix_len:
            self.kv_mgr.record_failure(self.bootstrap_room, "nixl_kv: decode-side prefix reuse is not supported")
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            return
        self.kv_mgr.expect(self.bootstrap_room, kv_indices, aux_index)
        super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, *args, **kwargs)

    def _clear(self) -> None:
        self.kv_mgr.forget_room(self.bootstrap_room)
        super()._clear()


class NixlKvBootstrapServer(CommonKVBootstrapServer):
    """SGLang's own registry of the prefill ranks and their control sockets, less the page size: SGLang's decode
    refuses a prefill of another page size, nixl_kv reads pages of any size into its own (the pair's compatibility
    is checked, before any byte moves, from the params)."""

    @property
    def page_size(self) -> None:
        return None

    @page_size.setter
    def page_size(self, value: int | None) -> None:
        pass
