"""Faults the pair harness injects into single requests (``nixl-kv pair --faults``, the soak), and what each may end in.

- ``corrupt``: one bit of the params flipped on the way to the gen instance: the request must fail (their checksum).
- ``forge``: before the gen instance reads, a third agent in its process (as one would be on its host) loads the
  ctx ranks' metadata and sends each a ``ReadDone(final)`` and a ``NoReaders`` for the request, without the
  request's secret: they must change nothing, so the request must arrive intact.
- ``cancel``: the gen side cancels the request right after starting it: it may end either way, never with wrong
  bytes.
- ``ctx-cancel``: the ctx side cancels the request once the gen instance started reading it (racing its READs): it
  may end either way, never with wrong bytes, and by its deadline.

Faults of the ctx instance's processes hit every request of one round (``nixl-kv pair --ctx-fault``), right after
the gen instance started reading them; those requests may end either way, never with wrong bytes, and must end by
their deadline:

- ``ctx-stop``: SIGSTOP for longer than the lease, then SIGCONT (a ctx host that hangs, then comes back);
- ``ctx-kill``: SIGKILL (a ctx host that dies); the run ends with that round.
"""

from __future__ import annotations

import os
import random
import time
from contextlib import suppress

from nixl_kv import wire
from nixl_kv.errors import AgentError, WireFormatError
from nixl_kv.protocol import NoReaders, ReadDone
from nixl_kv.state import ContextPhaseParams, DataTransceiverState

FAULTS = ("corrupt", "forge", "cancel", "ctx-cancel")
CTX_FAULTS = ("ctx-stop", "ctx-kill")
FORGER_PUSH_S = 0.05  # the forger's sends need UCX progress for a few round trips (5 ms was too short at 10 ms RTT)


def choose(fraction: float, request_id: int) -> str:
    """The fault a request gets ("" for none): the same for a request id in every run."""
    rng = random.Random(request_id)
    return rng.choice(FAULTS) if rng.random() < fraction else ""


def corrupt(params: bytes, request_id: int) -> bytes:
    rng = random.Random(request_id)
    damaged = bytearray(params)
    damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
    return bytes(damaged)


def as_expected(fault: str, verified: bool, error: str | None) -> bool:
    """Whether a request with ``fault`` ended as it must (a request without one must verify)."""
    if fault == "corrupt":
        return not verified and "fail their checksum" in (error or "")
    if fault in ("cancel", "ctx-cancel") or fault in CTX_FAULTS:
        return True  # either way; a request that completed was verified byte by byte like any other
    return verified


class Forger:
    """The third agent of ``forge``."""

    def __init__(self) -> None:
        from nixl_kv.agents.nixl_agent import NixlAgent

        self.agent = NixlAgent(f"pair-forger-{os.getpid()}")

    def forge(self, params: bytes) -> None:
        """Forged messages about the request to every ctx rank of its instance (their delivery is not awaited)."""
        try:
            decoded = wire.decode(params, ContextPhaseParams)
            state = wire.decode(decoded.ctx_state, DataTransceiverState)
        except WireFormatError:
            return
        me = self.agent.metadata()
        messages = [
            ReadDone(state.instance_id, decoded.request_id, 0, me, 1, final=True),
            NoReaders(state.instance_id, decoded.request_id, me),
        ]
        for rank in state.comm.ranks:
            with suppress(AgentError):
                self.agent.load_remote(rank.agent_metadata, rank.agent_name)
                for message in messages:
                    self.agent.notify(rank.agent_name, wire.encode(message))
        deadline = time.monotonic() + FORGER_PUSH_S
        while time.monotonic() < deadline:  # no progress thread: let UCX push the sends out
            self.agent.poll_notifications()

    def close(self) -> None:
        self.agent.close()
