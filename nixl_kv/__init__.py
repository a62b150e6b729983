"""nixl_kv: KV cache and RNN state transfer between disaggregated prefill (ctx) and decode (gen) servers over NIXL.

What a server embeds is importable from here (``from nixl_kv import CacheTransceiver, PagedKVCache``; see
docs/embedding.md). Each name loads its module on first use (PEP 562 ``__getattr__``), so ``import nixl_kv``
alone imports neither numpy nor nixl, torch or cupy. ``__version__`` comes from the installed package metadata.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib.machinery import PathFinder
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, tuple[str, ...]] = {
    "nixl_kv.transceiver": ("CacheTransceiver", "create_cache_transceiver"),
    "nixl_kv.config": ("CacheTransceiverConfig",),
    "nixl_kv.cache": ("CacheManager", "PagedKVCache"),
    "nixl_kv.rnn_cache": ("RnnStatePools",),
    "nixl_kv.layout": ("KVLayout", "LayoutKind", "MemoryKind", "MemoryRegion", "RnnLayout"),
    "nixl_kv.dtypes": ("DataType",),
    "nixl_kv.state": (
        "AttentionType",
        "CacheState",
        "CommState",
        "ContextPhaseParams",
        "ConvSectionLayout",
        "DataTransceiverState",
        "ModelConfig",
        "ParallelConfig",
        "RankCommInfo",
        "RnnConfig",
    ),
    "nixl_kv.requests": ("RequestState", "RequestStatuses", "TransferRequest"),
    "nixl_kv.progress": ("ContextProgress",),
    "nixl_kv.comm": ("CacheTransceiverComm", "MpiComm", "SingleProcessComm"),
    "nixl_kv.errors": (
        "AgentError",
        "BufferExhaustedError",
        "IncompatibleStateError",
        "NixlKvError",
        "NotSupportedError",
        "TransferError",
        "WireFormatError",
    ),
    "nixl_kv.interfaces": ("Formatter", "TransferAgent", "TransferStatus"),
    "nixl_kv.registry": ("register_agent", "register_formatter"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "AgentError",
    "AttentionType",
    "BufferExhaustedError",
    "CacheManager",
    "CacheState",
    "CacheTransceiver",
    "CacheTransceiverComm",
    "CacheTransceiverConfig",
    "CommState",
    "ContextPhaseParams",
    "ContextProgress",
    "ConvSectionLayout",
    "DataTransceiverState",
    "DataType",
    "Formatter",
    "IncompatibleStateError",
    "KVLayout",
    "LayoutKind",
    "MemoryKind",
    "MemoryRegion",
    "ModelConfig",
    "MpiComm",
    "NixlKvError",
    "NotSupportedError",
    "PagedKVCache",
    "ParallelConfig",
    "RankCommInfo",
    "RequestState",
    "RequestStatuses",
    "RnnConfig",
    "RnnLayout",
    "RnnStatePools",
    "SingleProcessComm",
    "TransferAgent",
    "TransferError",
    "TransferRequest",
    "TransferStatus",
    "WireFormatError",
    "create_cache_transceiver",
    "register_agent",
    "register_formatter",
]

if TYPE_CHECKING:  # the same names for type checkers and IDEs (tests/test_packaging.py keeps the lists equal)
    from nixl_kv.cache import CacheManager, PagedKVCache
    from nixl_kv.comm import CacheTransceiverComm, MpiComm, SingleProcessComm
    from nixl_kv.config import CacheTransceiverConfig
    from nixl_kv.dtypes import DataType
    from nixl_kv.errors import (
        AgentError,
        BufferExhaustedError,
        IncompatibleStateError,
        NixlKvError,
        NotSupportedError,
        TransferError,
        WireFormatError,
    )
    from nixl_kv.interfaces import Formatter, TransferAgent, TransferStatus
    from nixl_kv.layout import KVLayout, LayoutKind, MemoryKind, MemoryRegion, RnnLayout
    from nixl_kv.progress import ContextProgress
    from nixl_kv.registry import register_agent, register_formatter
    from nixl_kv.requests import RequestState, RequestStatuses, TransferRequest
    from nixl_kv.rnn_cache import RnnStatePools
    from nixl_kv.state import (
        AttentionType,
        CacheState,
        CommState,
        ContextPhaseParams,
        ConvSectionLayout,
        DataTransceiverState,
        ModelConfig,
        ParallelConfig,
        RankCommInfo,
        RnnConfig,
    )
    from nixl_kv.transceiver import CacheTransceiver, create_cache_transceiver

    __version__: str


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name == "__version__":
        value = _version()
    else:
        raise AttributeError(f"module 'nixl_kv' has no attribute {name!r}")
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__"})


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nixl-kv")
    except PackageNotFoundError:  # a source checkout on sys.path that was never installed
        return "0+unknown"


class _CheckoutFolders:
    """Finds exactly ``nixl_kv.agents`` and ``nixl_kv.formatters`` in a source checkout's top-level folders."""

    NAMES = frozenset({"nixl_kv.agents", "nixl_kv.formatters"})

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> Any:
        return PathFinder.find_spec(fullname, [self.root]) if fullname in self.NAMES else None


def _map_checkout_folders() -> None:
    # The repository keeps agents/ and formatters/ beside nixl_kv/. A wheel holds them inside nixl_kv/
    # (pyproject.toml's package-dir), so there is nothing to do. Imported from a checkout instead (its root on
    # sys.path: the tests, the scripts, PYTHONPATH on the GPU machine, or an editable install), this package's own
    # folder has no agents/: a meta path finder, ahead of the others, then resolves those two names, and only
    # those, to the folders of this same checkout. Nothing else of the checkout root becomes part of nixl_kv.
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if os.path.isdir(os.path.join(here, "agents")) or not os.path.isfile(os.path.join(root, "pyproject.toml")):
        return
    mapped = (type(finder).__name__ == "_CheckoutFolders" and finder.root == root for finder in sys.meta_path)
    if not any(mapped):  # not already there (a reload of this module)
        sys.meta_path.insert(0, _CheckoutFolders(root))


_map_checkout_folders()
