"""The compiled core (``nixl_kv._core``) bound to NIXL's C API from the nixl package that ``import nixl`` picked.

The nixl wheels ship ``libnixl_capi.so`` beside ``libnixl.so`` in ``.nixl_cu1X.mesonpy.libs``; opening that one keeps
a single ``libnixl.so`` (and a single UCX) in the process, shared with NIXL's Python binding.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

from nixl_kv.errors import AgentError

CAPI = "libnixl_capi.so"


def capi_path() -> Path:
    """Where the picked nixl package keeps its C API (it may be missing: ``core`` says so)."""
    import nixl._api as api  # the nixl meta-package picks nixl_cu12 or nixl_cu13

    package = api.__name__.split(".")[0]
    site = Path(os.path.realpath(api.__file__)).parent.parent
    return site / f".{package}.mesonpy.libs" / CAPI


def core() -> ModuleType:
    """``nixl_kv._core`` with its call table loaded; AgentError naming what is missing."""
    try:
        from nixl_kv import _core
    except ImportError as exc:
        raise AgentError(
            f"nixl_kv's compiled core (nixl_kv._core) is not built: {exc}; run `pip install -e .` or "
            "`python setup.py build_ext --inplace`"
        ) from exc
    if _core.loaded() is None:
        path = capi_path()
        if not path.is_file():
            raise AgentError(
                f"nixl_kv needs NIXL's C API, {CAPI}, beside libnixl.so in {path.parent}, and it is not there: "
                "install the nixl release nixl_kv pins (nixl==1.5.1), whose wheels ship it"
            )
        os.environ.setdefault("NIXL_PLUGIN_DIR", str(path.parent / "plugins"))
        _core.load(str(path))
    return _core
