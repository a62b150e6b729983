"""The hold board: a ctx rank shows, in memory any reader can READ, which requests it still holds.

Why: a gen READ may only complete if it finished while the ctx rank still held the request's blocks (DESIGN
§5.6). Asking the ctx rank costs a round trip through its Python threads, which a busy server delays by its
GIL switch interval (5 ms). Instead each ctx rank keeps a registered table of 8-byte *hold tokens*: the token
of a request is written before its params are handed out and cleared before its blocks are released. A reader
READs the request's KV, then, once that READ has finished, READs the token's window of the board: if the token
is still there, the blocks were held for the whole first READ, so the bytes are the request's. No ctx thread
takes part. Where the token is absent (released, expired, or never posted because its window was full), the
reader falls back to asking the ctx rank for a verdict.

Each token is posted with the time until which the rank promises not to reuse the request's blocks, whatever
happens to the request (``hold_promise_ms``; CLOCK_MONOTONIC nanoseconds, 0 for no promise): a release before it
is deferred until it. A reader on the same host (one clock) may then READ the window *while* its KV READ is in
flight: if the token is there and the KV READ was seen finished before the promise ran out, no block was reused
while it read (held from before the params left until the token was seen, kept at least until the promise), so
the second READ leaves the critical path.

A token is a keyed hash of what the rank pinned (request id, token count, its block ids, its state slot), so a
reader that checks it also checks that it read the blocks the ctx pinned for that request, and a reader that
does not hold the instance key cannot forge it.
"""

from __future__ import annotations

import array
import collections
import hashlib
import struct
import threading
from collections.abc import Sequence

import numpy as np

from nixl_kv.layout import MemoryKind, MemoryRegion

BOARD_SLOTS = 1 << 14  # distinct windows; a token lives in the window starting at ``token % BOARD_SLOTS``
WINDOW = 8  # entries per window: one READ of 128 bytes; a token goes to the first free entry of its window
ENTRY_BYTES = 16  # (token, promised-until ns masked by the token's key stream: see held_until)
TOKEN_BYTES = 8
MAX_PROMISE_NS = 10 * 10**9  # a promise read as further from now than this is garbage (a torn copy)
WINDOW_BYTES = WINDOW * ENTRY_BYTES
KEY_BYTES = 16
_HEAD = struct.Struct("=3q")  # request id, tokens, state slot: native int64s, as the blocks are


def hold_token(key: bytes, request_id: int, num_tokens: int, block_ids: Sequence[int], rnn_slot: int | None) -> int:
    """The nonzero token of one rank's hold on a request (both sides compute it from what they know)."""
    digest = hashlib.blake2b(key=key, digest_size=TOKEN_BYTES)
    digest.update(_HEAD.pack(request_id, num_tokens, -1 if rnn_slot is None else rnn_slot))
    if isinstance(block_ids, np.ndarray):
        digest.update(np.ascontiguousarray(block_ids, dtype=np.int64).tobytes())
    else:  # the wire's tuples: no array to make (a few µs on every request)
        digest.update(array.array("q", block_ids).tobytes())
    return int.from_bytes(digest.digest(), "little") or 1


def window_start(token: int, slots: int = BOARD_SLOTS) -> int:
    return token % slots


def board_slots(board: MemoryRegion) -> int:
    """Windows of a peer's board, from its size (0 for a region too small to be one)."""
    return max(0, board.nbytes // ENTRY_BYTES - WINDOW)


def clock_domain() -> str:
    """Processes that print the same value read one CLOCK_MONOTONIC: the same running kernel (its boot id) and
    the same time-namespace offset. Empty where that cannot be told (promises are then never relied on)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
    except OSError:
        return ""
    try:
        with open("/proc/self/timens_offsets") as handle:  # kernels with time namespaces: this one's offsets
            offsets = " ".join(handle.read().split())
    except FileNotFoundError:
        offsets = ""
    except OSError:
        return ""
    return f"linux-boot:{boot};{offsets}" if boot else ""


def promise_mask(key: bytes, token: int) -> int:
    """What a token's promise is XORed with on the board (both sides compute it)."""
    digest = hashlib.blake2b(token.to_bytes(TOKEN_BYTES, "little"), key=key, digest_size=TOKEN_BYTES, person=b"promise")
    return int.from_bytes(digest.digest(), "little")


def shows_token(window: np.ndarray, token: int) -> bool:
    """Whether a READ copy of a token's window (``[WINDOW, 2]``) shows the token."""
    return bool((window[:, 0] == np.uint64(token)).any())


def promised_until(window: np.ndarray, token: int, mask: int, now_ns: int) -> int | None:
    """A READ copy of a token's window (``[WINDOW, 2]``): None when the token is not there, else the time its
    blocks are promised until (0: no promise).

    A copy is not atomic: it may show our token beside the promise word of a token posted in the same entry
    after ours was cleared. That word decodes (under our mask, not its own) to a pseudo-random time, which is
    taken for no promise unless it falls within MAX_PROMISE_NS of now (odds about 1e-9, after a tear that itself
    needs a clear and a post into that entry during the copy)."""
    found = np.flatnonzero(window[:, 0] == np.uint64(token))
    if not len(found):
        return None
    return unmask_promise(int(window[found[0], 1]), mask, now_ns)


def unmask_promise(masked: int, mask: int, now_ns: int) -> int:
    """The promise in a masked word, or 0 when the word is not one made under ``mask`` (garbage, a torn copy, or
    a word made for another token: it then decodes to a pseudo-random time, rarely within MAX_PROMISE_NS of now)."""
    until = masked ^ mask
    return until if abs(until - now_ns) <= MAX_PROMISE_NS else 0


class HoldBoard:
    """One ctx rank's board, in DRAM (readable by every reader whatever its pools' memory)."""

    def __init__(self, slots: int = BOARD_SLOTS) -> None:
        self._entries = np.zeros((slots + WINDOW, 2), dtype=np.uint64)  # the last window overlaps the end
        self._slots = slots
        self._lock = threading.Lock()
        self.region = MemoryRegion(int(self._entries.ctypes.data), self._entries.nbytes, 0, MemoryKind.DRAM)

    def post(self, token: int, masked_until: int = 0) -> bool:
        """Show the token with its promise (``until_ns ^ promise_mask``); False when its window is full (its
        readers then ask for a verdict)."""
        start = window_start(token, self._slots)
        with self._lock:  # (a window is 8 entries: a Python scan costs less than numpy's per-call overhead)
            tokens = self._entries[start : start + WINDOW, 0].tolist()
            if 0 not in tokens:
                return False
            entry = start + tokens.index(0)
            self._entries[entry, 1] = masked_until
            self._entries[entry, 0] = token
            return True

    def clear(self, token: int) -> None:
        """Before the blocks are released: from now on no reader sees the hold."""
        start = window_start(token, self._slots)
        with self._lock:
            for offset, shown in enumerate(self._entries[start : start + WINDOW, 0].tolist()):
                if shown == token:
                    self._entries[start + offset, 0] = 0

    @property
    def posted(self) -> int:
        return int(np.count_nonzero(self._entries[:, 0]))


def window_rows(address: int, count: int, stride: int, device_id: int) -> np.ndarray:
    """Nx3 descriptor rows of ``count`` windows starting every ``stride`` bytes (window i is row i)."""
    rows = np.empty((count, 3), dtype=np.uint64)
    rows[:, 0] = address + np.arange(count, dtype=np.uint64) * np.uint64(stride)
    rows[:, 1], rows[:, 2] = WINDOW_BYTES, device_id
    return rows


def board_rows(board: MemoryRegion) -> np.ndarray:
    """Every window of a peer's board (windows overlap: one starts at every token); prepared once per peer."""
    return window_rows(board.address, board_slots(board), ENTRY_BYTES, board.device_id)


class LandingRing:
    """The reader's side: registered DRAM windows that hold-check READs land in, one per check in flight."""

    def __init__(self, windows: int = 4096) -> None:
        self._windows = np.zeros((windows, WINDOW, 2), dtype=np.uint64)
        self._free = collections.deque(range(windows))
        base = int(self._windows.ctypes.data)
        self.region = MemoryRegion(base, self._windows.nbytes, 0, MemoryKind.DRAM)
        self.rows = window_rows(base, windows, WINDOW_BYTES, 0)

    def take(self) -> int | None:
        """A free window, zeroed (a READ that lands nothing must not show a stale token), or None."""
        try:
            index = self._free.popleft()
        except IndexError:
            return None
        self._windows[index] = 0
        return index

    def give(self, index: int) -> None:
        self._free.append(index)

    def window(self, index: int) -> np.ndarray:
        return self._windows[index]
