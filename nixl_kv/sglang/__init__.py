"""nixl_kv inside SGLang: a disaggregation transfer backend (``conn``), loaded through SGLang's plugin entry point.

SGLang's transfer backends are a closed set, chosen by ``--disaggregation-transfer-backend``. This package's plugin
(entry point ``nixl_kv`` in the group ``sglang.srt.plugins``, which SGLang loads in each of its processes) wraps
SGLang's ``get_kv_class``: with ``NIXL_KV_SGLANG=1`` in a server's environment, the backend name ``nixl`` gives
nixl_kv's classes instead of SGLang's own NIXL backend. Both servers of a pair must set it (or neither).

``kv_args`` (the layout of SGLang's KV) imports without SGLang; ``conn`` needs it.
"""

from __future__ import annotations

import os
from typing import Any

SELECT_ENV = "NIXL_KV_SGLANG"
# SGLang's own NIXL backend registers its KV as VRAM; on a CPU-only machine (the comparison here) it must say DRAM
OWN_NIXL_DRAM_ENV = "NIXL_KV_SGLANG_NIXL_DRAM"


def selected() -> bool:
    return os.environ.get(SELECT_ENV, "") not in ("", "0")


def kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    """The AROUND hook on ``get_kv_class``: ours for backend ``nixl`` when selected, SGLang's otherwise."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

    if not selected() or transfer_backend != TransferBackend.NIXL or class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    from nixl_kv.sglang import conn

    return {
        KVClassType.MANAGER: conn.NixlKvManager,
        KVClassType.SENDER: conn.NixlKvSender,
        KVClassType.RECEIVER: conn.NixlKvReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.NixlKvBootstrapServer,
    }[class_type]


def _own_nixl_in_dram(*args: Any, **kwargs: Any) -> None:
    """BEFORE hook on SGLang's ``NixlKVManager.__init__``: its KV buffers are host memory on a CPU-only server."""
    kv_args = args[1] if len(args) > 1 else kwargs["args"]
    kv_args.kv_data_mem_kinds = ["DRAM"] * len(kv_args.kv_data_ptrs)


def register() -> None:
    """The plugin: SGLang calls it at start-up in every process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", kv_class, HookType.AROUND)
    if os.environ.get(OWN_NIXL_DRAM_ENV, "") not in ("", "0"):
        HookRegistry.register(
            "sglang.srt.disaggregation.nixl.conn.NixlKVManager.__init__", _own_nixl_in_dram, HookType.BEFORE
        )
