"""CacheTransBufferManager: leasing staging slots, exhaustion, poisoning and lease expiry."""

from __future__ import annotations

import numpy as np
import pytest

from nixl_kv.buffers import CacheTransBufferManager, SlotState
from nixl_kv.errors import BufferExhaustedError
from nixl_kv.layout import MemoryKind

SLOT_BYTES = 4 * 16


def make_manager(num_slots: int = 3) -> CacheTransBufferManager:
    return CacheTransBufferManager(max_tokens_in_buffer=4, bytes_per_token=16, num_slots=num_slots)


def test_slots_are_equal_consecutive_pieces_of_one_region() -> None:
    manager = make_manager()
    assert manager.slot_bytes == SLOT_BYTES
    assert manager.region.nbytes == 3 * SLOT_BYTES
    assert manager.region.memory is MemoryKind.DRAM
    assert manager.free_slots == 3
    for i, slot in enumerate(manager.slots):
        assert slot.index == i
        assert slot.state is SlotState.FREE
        assert slot.region.address == manager.region.address + i * SLOT_BYTES
        assert slot.region.nbytes == SLOT_BYTES
        assert slot.array.dtype == np.uint8
        assert slot.array.shape == (SLOT_BYTES,)
        assert slot.array.ctypes.data == slot.region.address


@pytest.mark.parametrize("args", [(0, 16, 3), (4, 0, 3), (4, 16, 0), (-1, 16, 3)])
def test_constructor_rejects_non_positive_sizes(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        CacheTransBufferManager(*args)


def test_acquire_and_release() -> None:
    manager = make_manager()
    a = manager.acquire("req-a", lease_s=5.0, nbytes=SLOT_BYTES, now=100.0)
    b = manager.acquire("req-b", lease_s=1.5, nbytes=1, now=200.0)
    assert (a.index, a.state, a.owner, a.lease_deadline) == (0, SlotState.LEASED, "req-a", 105.0)
    assert (b.index, b.state, b.owner, b.lease_deadline) == (1, SlotState.LEASED, "req-b", 201.5)
    assert manager.free_slots == 1

    manager.release(a)

    assert (a.state, a.owner) == (SlotState.FREE, None)
    assert manager.free_slots == 2
    again = manager.acquire("req-c", lease_s=1.0, nbytes=8, now=300.0)
    assert again is a
    assert again.owner == "req-c"


def test_release_of_a_slot_that_is_not_leased_is_refused() -> None:
    manager = make_manager()
    slot = manager.acquire("r", lease_s=1.0, nbytes=1, now=0.0)
    manager.release(slot)
    with pytest.raises(ValueError, match="slot 0 is free, not leased"):
        manager.release(slot)


def test_exhaustion() -> None:
    manager = make_manager()
    slots = [manager.acquire(i, lease_s=1.0, nbytes=SLOT_BYTES, now=0.0) for i in range(3)]
    assert [slot.index for slot in slots] == [0, 1, 2]
    assert manager.free_slots == 0
    with pytest.raises(BufferExhaustedError, match=r"^all 3 staging slots are in use \(0 poisoned\)"):
        manager.acquire("late", lease_s=1.0, nbytes=1, now=0.0)
    manager.release(slots[1])
    assert manager.acquire("late", lease_s=1.0, nbytes=1, now=0.0) is slots[1]


def test_too_large_request_is_refused_even_with_free_slots() -> None:
    manager = make_manager()
    with pytest.raises(BufferExhaustedError, match=r"^65 bytes do not fit a 64-byte staging slot$"):
        manager.acquire("big", lease_s=1.0, nbytes=SLOT_BYTES + 1, now=0.0)
    assert manager.free_slots == 3
    assert all(slot.state is SlotState.FREE for slot in manager.slots)


def test_poisoned_slot_is_never_handed_out_until_cleared() -> None:
    manager = make_manager(num_slots=2)
    victim = manager.acquire("stuck", lease_s=1.0, nbytes=1, now=0.0)
    assert not manager.has_poisoned_buffer()

    manager.poison(victim, "READ could not be cancelled")

    assert victim.state is SlotState.POISONED
    assert victim.poison_reason == "READ could not be cancelled"
    assert manager.has_poisoned_buffer()
    with pytest.raises(ValueError, match="slot 0 is poisoned, not leased"):
        manager.release(victim)
    for round_ in range(5):  # acquire/release cycles never reach the poisoned slot
        slot = manager.acquire(round_, lease_s=1.0, nbytes=1, now=float(round_))
        assert slot.index == 1
        manager.release(slot)
    other = manager.acquire("other", lease_s=1.0, nbytes=1, now=10.0)
    with pytest.raises(BufferExhaustedError, match=r"all 2 staging slots are in use \(1 poisoned\)"):
        manager.acquire("more", lease_s=1.0, nbytes=1, now=10.0)

    manager.clear_poison(victim)

    assert (victim.state, victim.owner, victim.poison_reason) == (SlotState.FREE, None, "")
    assert not manager.has_poisoned_buffer()
    assert manager.acquire("more", lease_s=1.0, nbytes=1, now=10.0) is victim
    assert other.state is SlotState.LEASED


def test_clear_poison_leaves_a_leased_slot_alone() -> None:
    manager = make_manager()
    slot = manager.acquire("r", lease_s=1.0, nbytes=1, now=0.0)
    manager.clear_poison(slot)
    assert (slot.state, slot.owner) == (SlotState.LEASED, "r")


def test_expire_leases_poisons_only_leases_that_ran_out() -> None:
    manager = make_manager()
    a = manager.acquire("a", lease_s=10.0, nbytes=1, now=100.0)  # until 110
    b = manager.acquire("b", lease_s=5.0, nbytes=1, now=100.0)  # until 105
    c = manager.acquire("c", lease_s=1.0, nbytes=1, now=100.0)  # until 101, released in time
    manager.release(c)

    assert manager.expire_leases(now=104.999) == []
    assert not manager.has_poisoned_buffer()

    assert manager.expire_leases(now=105.0) == [b]  # a lease ends at its deadline
    assert b.state is SlotState.POISONED
    assert b.poison_reason == "lease of 'b' expired while granted"
    assert a.state is SlotState.LEASED
    assert c.state is SlotState.FREE
    assert manager.has_poisoned_buffer()
    assert manager.free_slots == 1

    assert manager.expire_leases(now=1000.0) == [a]  # b is already poisoned and is not reported again
    assert a.poison_reason == "lease of 'a' expired while granted"
    assert c.state is SlotState.FREE
    assert manager.acquire("d", lease_s=1.0, nbytes=1, now=1000.0) is c
    with pytest.raises(BufferExhaustedError, match=r"\(2 poisoned\)"):
        manager.acquire("e", lease_s=1.0, nbytes=1, now=1000.0)


def test_expired_slot_comes_back_after_clear_poison() -> None:
    manager = make_manager(num_slots=1)
    slot = manager.acquire(("ctx", 7), lease_s=2.0, nbytes=SLOT_BYTES, now=0.0)
    assert manager.expire_leases(now=2.0) == [slot]
    assert slot.poison_reason == "lease of ('ctx', 7) expired while granted"
    with pytest.raises(BufferExhaustedError):
        manager.acquire("next", lease_s=2.0, nbytes=1, now=3.0)
    manager.clear_poison(slot)
    assert manager.acquire("next", lease_s=2.0, nbytes=1, now=3.0) is slot
    assert slot.lease_deadline == 5.0


def test_a_slot_poisoned_by_its_leases_end_comes_back_after_the_grace() -> None:
    manager = make_manager(num_slots=1)
    slot = manager.acquire(("ctx", 8), lease_s=2.0, nbytes=1, now=0.0)
    assert manager.expire_leases(now=2.0, grace_s=3.0) == [slot]  # its reader vanished
    assert (slot.state, slot.poisoned_until) == (SlotState.POISONED, 5.0)
    assert manager.expire_leases(now=4.999, grace_s=3.0) == [] and slot.state is SlotState.POISONED
    with pytest.raises(BufferExhaustedError, match=r"\(1 poisoned\)"):
        manager.acquire("next", lease_s=2.0, nbytes=1, now=4.999)
    assert manager.expire_leases(now=5.0, grace_s=3.0) == []  # a READ from it now belongs to a refused request
    assert (slot.state, slot.owner, slot.poison_reason) == (SlotState.FREE, None, "")
    assert manager.acquire("next", lease_s=2.0, nbytes=1, now=5.0) is slot
    manager.poison(slot, "abandoned with a READ in flight")  # poisoned otherwise: only clear_poison frees it
    assert manager.expire_leases(now=1e9, grace_s=3.0) == [] and slot.state is SlotState.POISONED
