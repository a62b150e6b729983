"""Connectors that time their own hooks, for comparing connectors' host cost the same way.

``TimedNixlKvConnector`` and ``TimedNixlConnector`` are nixl_kv's connector and vLLM's NixlConnector with every
scheduler and worker hook on the request path wrapped: the wall time spent inside them (a hook that calls another
counts once) adds up per process. A daemon thread writes the totals every 0.2 s to
``$NIXL_KV_HOOK_TIMES/<role>-<pid>.json`` (``{"seconds": ..., "hooks": {name: [calls, seconds]}}``), so a
benchmark reads them before and after a phase. Load them by module path: ``"kv_connector": "TimedNixlConnector",
"kv_connector_module_path": "nixl_kv.vllm.timing"``.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

from nixl_kv.vllm.connector import NixlKvConnector

HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
    "request_finished", "bind_connector_metadata", "clear_connector_metadata", "start_load_kv",
    "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished", "get_transfer_results",
    "get_block_ids_with_load_errors", "get_kv_connector_stats", "build_connector_worker_meta",
)  # fmt: skip
DUMP_EVERY_S = 0.2


class HookClock:
    """This process's totals; nested hook calls (a hook calling another) count only the outer one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hooks: dict[str, list[float]] = {}
        self.local = threading.local()
        self.role = "unknown"
        self._writer: threading.Thread | None = None

    def timed(self, name: str, method: Callable) -> Callable:
        @functools.wraps(method)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(self.local, "depth", 0):
                return method(*args, **kwargs)
            self.local.depth = 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                self.local.depth = 0
                with self.lock:
                    entry = self.hooks.setdefault(name, [0, 0.0])
                    entry[0] += 1
                    entry[1] += spent

        return wrapper

    def start_writer(self, role: str) -> None:
        folder = os.environ.get("NIXL_KV_HOOK_TIMES")
        if not folder or self._writer is not None:
            return
        self.role = role
        path = Path(folder) / f"{role}-{os.getpid()}.json"
        self._writer = threading.Thread(target=self._write_forever, args=(path,), daemon=True, name="hook-times")
        self._writer.start()

    def _write_forever(self, path: Path) -> None:
        while True:
            with self.lock:
                hooks = {name: list(entry) for name, entry in self.hooks.items()}
            snapshot = {"seconds": sum(seconds for _, seconds in hooks.values()), "hooks": hooks}
            temporary = path.with_suffix(".tmp")
            temporary.write_text(json.dumps(snapshot))
            temporary.replace(path)
            time.sleep(DUMP_EVERY_S)


CLOCK = HookClock()


def _timed(base: type) -> type:
    def __init__(self: Any, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        base.__init__(self, vllm_config, role, kv_cache_config)
        CLOCK.start_writer(role.name.lower())

    namespace: dict[str, Any] = {"__init__": __init__}
    namespace.update({name: CLOCK.timed(name, getattr(base, name)) for name in HOOKS if hasattr(base, name)})
    return type(f"Timed{base.__name__}", (base,), namespace)


TimedNixlKvConnector = _timed(NixlKvConnector)
TimedNixlConnector = _timed(NixlConnector)
