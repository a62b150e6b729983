"""Name -> implementation registries for agents and formatters, loaded lazily so nixl_kv imports neither."""

from __future__ import annotations

import importlib
from typing import Any

from nixl_kv.errors import NotSupportedError

AGENTS: dict[str, str] = {"NIXL": "agents.nixl_agent:NixlAgent"}
FORMATTERS: dict[str, str] = {
    "default": "formatters.standard:StandardFormatter",
    "mla": "formatters.mla:MLAFormatter",
}


def _load(table: dict[str, str], name: str, kind: str) -> Any:
    try:
        target = table[name]
    except KeyError:
        raise NotSupportedError(f"no {kind} named {name!r}; known: {', '.join(sorted(table))}") from None
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def agent_class(name: str) -> Any:
    return _load(AGENTS, name, "transfer agent")


def formatter_class(name: str) -> Any:
    return _load(FORMATTERS, name, "formatter")


def register_agent(name: str, target: str) -> None:
    """Add an agent implementation as ``"module:Class"``."""
    AGENTS[name] = target


def register_formatter(name: str, target: str) -> None:
    FORMATTERS[name] = target
