"""Test environment only: a stand-in for ``sgl_kernel`` (SGLang's CPU kernels, not on PyPI).

Several SGLang modules import names from it at import time. Every name here is a function that raises when called:
on a CPU without AMX SGLang calls none of them, and a call shows up as this error rather than a wrong result.
Submodules (``sgl_kernel.x``) resolve to the same stand-in.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, NoReturn


class StandInError(RuntimeError):
    pass


class _StandIn:
    """A name from ``sgl_kernel``: calling it raises; its attributes (``scalar_types.uint4b8``) are stand-ins too."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise StandInError(f"sgl_kernel.{self._name} was called: it is a test stand-in (the real one is not here)")

    def __getattr__(self, name: str) -> _StandIn:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn(f"{self._name}.{name}")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._name}>"


def _stand_in(name: str) -> Any:
    return _StandIn(name)


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _stand_in(name)


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__getattr__ = __getattr__  # type: ignore[attr-defined]
        module.__path__ = []  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.insert(0, _Submodules())
__version__ = "0.0.0+stand-in"
