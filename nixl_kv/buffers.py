"""CacheTransBufferManager: registered staging slots with leases and poisoning (DESIGN §4).

A slot is FREE, LEASED to one transfer until a deadline, or POISONED: a remote agent may still touch it
(its lease ran out while granted, or its transfer was abandoned), so it is not handed out again until
``clear_poison`` says the transfer is proven finished, or, for a ctx slot whose request can no longer complete,
until the grace it was poisoned with has passed (``expire_leases``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from nixl_kv.errors import BufferExhaustedError
from nixl_kv.layout import MemoryKind, MemoryRegion
from nixl_kv.memory import allocate, region_of


class SlotState(str, Enum):
    FREE = "free"
    LEASED = "leased"
    POISONED = "poisoned"


@dataclass
class StagingSlot:
    index: int
    region: MemoryRegion
    array: Any
    state: SlotState = SlotState.FREE
    owner: Hashable | None = None
    lease_deadline: float = 0.0
    poison_reason: str = ""
    poisoned_until: float = float("inf")  # a slot poisoned by its lease's end comes back then (expire_leases)


class CacheTransBufferManager:
    """A fixed set of equally sized staging slots carved out of one registered buffer.

    ``max_tokens_in_buffer`` tokens of ``bytes_per_token`` each make one slot; ``num_slots`` slots in all.
    Thread-safe: slots change state under one lock (the caller's thread and the progress loop both lease them).
    """

    def __init__(
        self,
        max_tokens_in_buffer: int,
        bytes_per_token: int,
        num_slots: int,
        memory: MemoryKind = MemoryKind.DRAM,
        device_id: int = 0,
    ) -> None:
        if max_tokens_in_buffer < 1 or bytes_per_token < 1 or num_slots < 1:
            raise ValueError("max_tokens_in_buffer, bytes_per_token and num_slots must be positive")
        self._lock = threading.Lock()
        self.slot_bytes = max_tokens_in_buffer * bytes_per_token
        self._buffer = allocate((num_slots, self.slot_bytes), "uint8", memory, device_id)
        self.region = region_of(self._buffer, memory, device_id)
        self.slots = [
            StagingSlot(
                index=i,
                region=MemoryRegion(self.region.address + i * self.slot_bytes, self.slot_bytes, device_id, memory),
                array=self._buffer[i],
            )
            for i in range(num_slots)
        ]

    def acquire(self, owner: Hashable, lease_s: float, nbytes: int, now: float | None = None) -> StagingSlot:
        """Lease a free slot of at least ``nbytes`` to ``owner`` until ``now + lease_s``."""
        if nbytes > self.slot_bytes:
            raise BufferExhaustedError(f"{nbytes} bytes do not fit a {self.slot_bytes}-byte staging slot")
        now = time.monotonic() if now is None else now
        with self._lock:
            for slot in self.slots:
                if slot.state is SlotState.FREE:
                    slot.state, slot.owner, slot.lease_deadline = SlotState.LEASED, owner, now + lease_s
                    return slot
        raise BufferExhaustedError(
            f"all {len(self.slots)} staging slots are in use ({self.poisoned_slots} poisoned); "
            "raise max_tokens_in_buffer or the slot count, or wait for transfers to finish"
        )

    def release(self, slot: StagingSlot) -> None:
        """Return a leased slot whose transfer is proven finished."""
        with self._lock:
            if slot.state is not SlotState.LEASED:
                raise ValueError(f"slot {slot.index} is {slot.state.value}, not leased")
            slot.state, slot.owner = SlotState.FREE, None

    def poison(self, slot: StagingSlot, reason: str, until: float = float("inf")) -> None:
        """A remote may still touch this slot: never reuse it until ``clear_poison`` (or ``until``, see
        ``expire_leases``)."""
        with self._lock:
            slot.state, slot.poison_reason, slot.poisoned_until = SlotState.POISONED, reason, until

    def clear_poison(self, slot: StagingSlot) -> None:
        with self._lock:
            if slot.state is SlotState.POISONED:
                slot.state, slot.owner, slot.poison_reason = SlotState.FREE, None, ""
                slot.poisoned_until = float("inf")

    def expire_leases(self, now: float | None = None, grace_s: float = float("inf")) -> list[StagingSlot]:
        """Poison every leased slot whose lease ran out (its reader may still be at it); returns them. Each comes
        back ``grace_s`` later, unless cleared before.

        Why a grace and not forever: a ctx's slot is READ by the gen it was granted to. A READ from it after the
        lease belongs to a request that can no longer complete (the ctx refuses it, and the gen's own deadline is
        the lease), and the gen keeps the destination of such a READ poisoned until the READ has left NIXL. So
        reusing the slot later can put wrong bytes only where nothing will take them as a request's. A reader that
        vanished must not cost the slot for good (issue 11: all slots gone after their readers died)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for slot in self.slots:
                if slot.state is SlotState.POISONED and slot.poisoned_until <= now:
                    slot.state, slot.owner, slot.poison_reason = SlotState.FREE, None, ""
                    slot.poisoned_until = float("inf")
        expired = [s for s in self.slots if s.state is SlotState.LEASED and s.lease_deadline <= now]
        for slot in expired:
            self.poison(slot, f"lease of {slot.owner!r} expired while granted", now + grace_s)
        return expired

    @property
    def poisoned_slots(self) -> int:
        return sum(slot.state is SlotState.POISONED for slot in self.slots)

    def has_poisoned_buffer(self) -> bool:
        return self.poisoned_slots > 0

    @property
    def free_slots(self) -> int:
        return sum(slot.state is SlotState.FREE for slot in self.slots)
