"""Name -> implementation registries of transfer agents and cache formatters, loaded lazily so nixl_kv imports
neither until a transceiver is built.

A name is looked up, in this order:

1. run-time registrations, ``register_agent(name, "module:Class")`` and ``register_formatter``;
2. entry points of the installed distributions, groups ``nixl_kv.agents`` and ``nixl_kv.formatters``, read with
   ``importlib.metadata``. nixl-kv declares its own (``NIXL``; ``default`` and ``mla``) in its pyproject.toml; a
   plug-in package declares its own the same way::

       [project.entry-points."nixl_kv.agents"]
       MYFABRIC = "my_package.agent:MyAgent"

   and is selected by name (``CacheTransceiverConfig(backend="MYFABRIC")``). Two distributions declaring one name
   with different targets is an error, not a silent choice;
3. where nixl-kv's own entry points are not installed (a source checkout on PYTHONPATH, as on the GPU machine),
   the same built-ins as pyproject.toml declares (``BUILTIN``; a test keeps the two equal).

The entry points are read again at every lookup (about 3 ms, once per transceiver), so a plug-in installed after
start-up is found.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any

from nixl_kv.errors import NotSupportedError

AGENT_GROUP = "nixl_kv.agents"
FORMATTER_GROUP = "nixl_kv.formatters"
DISTRIBUTION = "nixl-kv"
BUILTIN: dict[str, dict[str, str]] = {
    AGENT_GROUP: {
        "NIXL": "nixl_kv.agents.nixl_agent:NixlAgent",
        "MOONCAKE": "nixl_kv.agents.mooncake_agent:MooncakeAgent",
        "MPI": "nixl_kv.agents.mpi_agent:MpiAgent",
        "UCX": "nixl_kv.agents.ucx_agent:UcxAgent",
    },
    FORMATTER_GROUP: {
        "default": "nixl_kv.formatters.standard:StandardFormatter",
        "mla": "nixl_kv.formatters.mla:MLAFormatter",
    },
}
_KINDS = {AGENT_GROUP: "transfer agent", FORMATTER_GROUP: "formatter"}
_REGISTER = {AGENT_GROUP: "register_agent", FORMATTER_GROUP: "register_formatter"}
_REGISTERED: dict[str, dict[str, str]] = {AGENT_GROUP: {}, FORMATTER_GROUP: {}}


@dataclass(frozen=True)
class Plugin:
    """One implementation: its ``module:attribute`` target and where it was declared."""

    name: str
    target: str
    source: str  # "<distribution> <version>", "register_*" or "nixl-kv (source checkout)"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def available(group: str) -> dict[str, list[Plugin]]:
    """Every declaration of each name in ``group``, run-time registrations first (they win)."""
    from importlib.metadata import entry_points

    found: dict[str, list[Plugin]] = {}
    for name, target in _REGISTERED[group].items():
        found[name] = [Plugin(name, target, _REGISTER[group])]
    declared: dict[str, list[Plugin]] = {}
    own = False
    for point in entry_points(group=group):
        dist = point.dist
        source = f"{dist.metadata['Name']} {dist.version}" if dist is not None else "unknown distribution"
        own = own or (dist is not None and _normalized(dist.metadata["Name"]) == DISTRIBUTION)
        plugins = declared.setdefault(point.name, [])
        if all(p.target != point.value for p in plugins):
            plugins.append(Plugin(point.name, point.value, source))
    if not own:
        for name, target in BUILTIN[group].items():
            plugins = declared.setdefault(name, [])
            if all(p.target != target for p in plugins):
                plugins.append(Plugin(name, target, f"{DISTRIBUTION} (source checkout)"))
    for name, plugins in declared.items():
        found.setdefault(name, plugins)
    return found


def _load(group: str, name: str) -> Any:
    known = available(group)
    kind = _KINDS[group]
    plugins = known.get(name)
    if not plugins:
        listed = ", ".join(f"{n} ({p[0].source})" for n, p in sorted(known.items())) or "none"
        raise NotSupportedError(f"no {kind} named {name!r}; installed (entry point group {group!r}): {listed}")
    if len(plugins) > 1:
        sources = "; ".join(f"{p.target} from {p.source}" for p in plugins)
        raise NotSupportedError(f"{kind} {name!r} is declared more than once: {sources}")
    plugin = plugins[0]
    module, _, attribute = plugin.target.partition(":")
    try:
        loaded: Any = importlib.import_module(module)
        for part in attribute.split(".") if attribute else ():
            loaded = getattr(loaded, part)
    except (ImportError, AttributeError) as exc:
        raise NotSupportedError(
            f"{kind} {name!r} ({plugin.target}, from {plugin.source}) cannot be loaded: {exc}"
        ) from exc
    return loaded


def agent_class(name: str) -> Any:
    return _load(AGENT_GROUP, name)


def formatter_class(name: str) -> Any:
    return _load(FORMATTER_GROUP, name)


def agent_names() -> list[str]:
    return sorted(available(AGENT_GROUP))


def formatter_names() -> list[str]:
    return sorted(available(FORMATTER_GROUP))


def register_agent(name: str, target: str) -> None:
    """Add a transfer agent at run time as ``"module:Class"``; it takes precedence over entry points of that name.
    Installed packages declare theirs as entry points instead (group ``nixl_kv.agents``)."""
    _REGISTERED[AGENT_GROUP][name] = target


def register_formatter(name: str, target: str) -> None:
    """Add a formatter at run time as ``"module:Class"`` (entry point group ``nixl_kv.formatters`` otherwise)."""
    _REGISTERED[FORMATTER_GROUP][name] = target
