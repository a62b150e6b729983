"""How the ranks of a multi-rank server instance take the same steps: rank 0 decides, the others follow.

Rank 0 serves HTTP and runs the model; every rank holds its share of the pools and its own transceiver, whose
calls (respond, status checks) are collective over the instance. So rank 0 sends each rank its step, and all of
them apply it in the same order. A follower waits for its next step by probing every half millisecond: MPI's
blocking receive busy-polls a core, and an idle multi-rank server must not burn one core per rank.
"""

from __future__ import annotations

import time
from typing import Any

from nixl_kv.comm import CacheTransceiverComm, SingleProcessComm

STEP_TAG = 0x6E6B  # "nk"
PROBE_INTERVAL_S = 0.0005


class Lockstep:
    """Steps from rank 0 to every rank of the instance, and values gathered back to rank 0."""

    def __init__(self, comm: CacheTransceiverComm) -> None:
        self.comm = comm
        self._world: Any = None
        if not isinstance(comm, SingleProcessComm) and comm.size > 1:
            from mpi4py import MPI

            self._world = MPI.COMM_WORLD

    @property
    def is_lead(self) -> bool:
        return self.comm.rank == 0

    @property
    def size(self) -> int:
        return self.comm.size

    def send(self, steps: list[Any]) -> Any:
        """Rank 0: hand rank r ``steps[r]`` (None tells it to stop); returns rank 0's own step."""
        for rank in range(1, self.size):
            self._world.send(steps[rank], dest=rank, tag=STEP_TAG)
        return steps[0]

    def receive(self) -> Any:
        """A follower: its next step, waited for without spinning. No deadline: an idle server waits for requests
        as long as it runs, and if rank 0 dies, mpiexec ends the job (every rank with it)."""
        while not self._world.iprobe(source=0, tag=STEP_TAG):
            time.sleep(PROBE_INTERVAL_S)
        return self._world.recv(source=0, tag=STEP_TAG)

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` at rank 0 (in rank order); None on the others."""
        if self._world is None:
            return [value]
        return self._world.gather(value, root=0)
