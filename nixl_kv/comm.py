"""The collectives an instance's ranks need (allgather, bcast, barrier, split), over MPI or in one process."""

from __future__ import annotations

from typing import Any, Protocol


class CacheTransceiverComm(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def allgather(self, value: Any) -> list[Any]: ...

    def bcast(self, value: Any, root: int = 0) -> Any: ...

    def barrier(self) -> None: ...

    def split(self, color: int, key: int) -> CacheTransceiverComm: ...


class SingleProcessComm:
    """A one-rank instance: every collective is the identity."""

    rank = 0
    size = 1

    def allgather(self, value: Any) -> list[Any]:
        return [value]

    def bcast(self, value: Any, root: int = 0) -> Any:
        return value

    def barrier(self) -> None:
        return None

    def split(self, color: int, key: int) -> SingleProcessComm:
        return self


class MpiComm:
    """mpi4py's communicator behind the same interface (imported only when used)."""

    def __init__(self, comm: Any = None) -> None:
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        self._comm = comm

    @classmethod
    def of_application(cls) -> MpiComm:
        """This application's ranks in an MPMD job (``mpiexec -n A prog : -n B prog``): COMM_WORLD split by appnum."""
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        application = world.Get_attr(MPI.APPNUM)
        return cls(world.Split(0 if application is None else application, world.Get_rank()))

    @property
    def rank(self) -> int:
        return self._comm.Get_rank()

    @property
    def size(self) -> int:
        return self._comm.Get_size()

    def allgather(self, value: Any) -> list[Any]:
        return self._comm.allgather(value)

    def bcast(self, value: Any, root: int = 0) -> Any:
        return self._comm.bcast(value, root=root)

    def barrier(self) -> None:
        self._comm.Barrier()

    def split(self, color: int, key: int) -> MpiComm:
        return MpiComm(self._comm.Split(color, key))


def mpiexec_path() -> str:
    """The mpiexec beside this Python (the mpich wheel puts it in the venv), else the one on PATH."""
    import shutil
    import sys
    from pathlib import Path

    from nixl_kv.errors import NotSupportedError

    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise NotSupportedError("multi-rank instances need mpiexec: pip install mpich (or any MPI)")
    return found
