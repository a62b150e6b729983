"""nixl_kv inside vLLM: ``NixlKvConnector``, a ``KVConnectorBase_V1`` (see ``connector`` and README.md here).

The connector is imported on first use, so the launcher, router and client modules of this package work in a
Python without vLLM (the tests drive vLLM servers from such a Python).
"""

from __future__ import annotations

from typing import Any

__all__ = ["NixlKvConnector"]


def __getattr__(name: str) -> Any:
    if name == "NixlKvConnector":
        from nixl_kv.vllm.connector import NixlKvConnector

        return NixlKvConnector
    raise AttributeError(f"module 'nixl_kv.vllm' has no attribute {name!r}")
