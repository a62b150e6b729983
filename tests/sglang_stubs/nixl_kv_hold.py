"""Test fault injection only: with ``NIXL_KV_SGLANG_TEST_HOLD=PATH`` in a server's environment, every nixl_kv READ
of that server stays in flight while the file ``PATH`` exists (its agent reports each transfer IN_PROGRESS), and
``PATH.held`` is created the first time a READ is held (the test's sign that a READ is in flight).

A one-sided READ over UCX's shared memory completes in microseconds without the target's progress: neither a kill
nor an abort could otherwise be timed to land while it runs. Imported from ``sitecustomize``; it patches
``nixl_kv.transceiver`` once that module is imported (before that it imports nothing).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from pathlib import Path
from typing import Any

ENV = "NIXL_KV_SGLANG_TEST_HOLD"
TARGET = "nixl_kv.transceiver"


def _hold(module: Any) -> None:
    """Every CacheTransceiver's agent reports IN_PROGRESS while the hold file exists."""
    from nixl_kv.interfaces import TransferStatus

    hold = Path(os.environ[ENV])
    held = hold.with_name(hold.name + ".held")
    real_init = module.CacheTransceiver.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        agent = self._agent
        real_status = agent.status

        def status(handle: Any) -> Any:
            if hold.exists():
                held.touch()
                return TransferStatus.IN_PROGRESS
            return real_status(handle)

        agent.status = status

    module.CacheTransceiver.__init__ = init


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader, real_exec = spec.loader, spec.loader.exec_module

        def exec_module(module: Any) -> None:
            real_exec(module)
            _hold(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get(ENV):
    sys.meta_path.insert(0, _PatchOnImport())
