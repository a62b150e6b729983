"""The wheel, not the checkout: ``python -m build`` makes the sdist and, from it, the wheel; the wheel is installed
with its dependencies into a fresh virtual environment beside ``openai-agents`` (whose top-level module is also
called ``agents``), and used from a folder outside the checkout.

Part of the default run (``scripts/test.sh``); ``pytest -m wheel`` selects it alone. It needs the package index
for openai-agents and the dependencies (pip's cache and the machine's local index serve the large ones); a build or
an installation that fails is a test failure, never a skip. The whole module takes about 75 s on the 2-core CPU
machine, 63 s of it the fresh venv (mostly pip unpacking torch, a dependency of nixl); the venv is removed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.wheel

ROOT = Path(__file__).resolve().parent.parent
VERSION = "0.1.0"
# The wheel holds the compiled modules (nixl_kv._fastpath and nixl_kv._core, from their Cython sources; the core also
# from its C, nixl_kv/csrc): one each for this Python and platform.
PYTHON_TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"
PLATFORM_TAG = sysconfig.get_platform().replace("-", "_").replace(".", "_")
WHEEL = f"nixl_kv-{VERSION}-{PYTHON_TAG}-{PYTHON_TAG}-{PLATFORM_TAG}.whl"
COMPILED = {
    f"nixl_kv/{name}{sysconfig.get_config_var('EXT_SUFFIX')}": f"nixl_kv/{name}.pyx" for name in ("_fastpath", "_core")
}
CORE_C = {"nixl_kv/csrc/nixl_capi.c", "nixl_kv/csrc/nixl_capi.h"}


def _run(command: list[str], cwd: Path, timeout_s: float, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, env=env)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def _clean_env(venv: Path, **extra: str) -> dict[str, str]:
    """The venv first on PATH; nothing that would put the checkout or another environment on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return {**env, **extra}


def _sources() -> set[str]:
    """Every file of the package in the checkout, as the wheel names it."""
    names = {str(p.relative_to(ROOT)) for p in (ROOT / "nixl_kv").rglob("*.py") if "__pycache__" not in p.parts}
    for folder in ("agents", "formatters"):
        names |= {f"nixl_kv/{folder}/{p.name}" for p in (ROOT / folder).glob("*.py")}
    return names | {"nixl_kv/py.typed", *COMPILED}


def _source_of(wheel_name: str) -> str:
    """Where a file of the wheel comes from in the checkout (and the sdist)."""
    if wheel_name in COMPILED:
        return COMPILED[wheel_name]
    for folder in ("agents", "formatters"):
        if wheel_name.startswith(f"nixl_kv/{folder}/"):
            return wheel_name.removeprefix("nixl_kv/")
    return wheel_name


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The sdist and the wheel built from it; no isolated build environment (setuptools, Cython and build come with
    the test extras), so it works offline. The wheel's build compiles the two modules from the sdist's sources."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)], out, 300)
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert [w.name for w in wheels] == [WHEEL], wheels
    assert [s.name for s in sdists] == [f"nixl_kv-{VERSION}.tar.gz"], sdists
    return wheels[0], sdists[0]


@pytest.fixture(scope="module")
def wheel_venv(built: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv (not the project's, where nixl_kv is installed editable) with the wheel and openai-agents."""
    venv = tmp_path_factory.mktemp("wheel-venv") / "venv"
    start = time.monotonic()
    _run([sys.executable, "-m", "venv", str(venv)], venv.parent, 120)
    python = str(venv / "bin" / "python")
    # one resolution for both, so pip checks they can live together; no bytecode compiling of torch's thousands
    # of files (imports compile what they need)
    install = [python, "-m", "pip", "install", "-q", "--no-compile", str(built[0]), "openai-agents"]
    _run(install, venv.parent, 600, _clean_env(venv))
    print(f"\n[wheel] fresh venv with the wheel and openai-agents in {time.monotonic() - start:.0f} s")
    try:
        yield venv
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # a few GB: not left for pytest's kept temporary folders


def test_the_wheel_holds_the_package_and_nothing_generic(built: tuple[Path, Path]) -> None:
    with zipfile.ZipFile(built[0]) as wheel:
        names = set(wheel.namelist())
        info = f"nixl_kv-{VERSION}.dist-info"
        entry_points = wheel.read(f"{info}/entry_points.txt").decode()
        metadata = wheel.read(f"{info}/METADATA").decode()
        top_level = wheel.read(f"{info}/top_level.txt").decode().split()
    assert {name.split("/")[0] for name in names} == {"nixl_kv", info}
    assert top_level == ["nixl_kv"]
    assert {name for name in names if not name.startswith(info)} == _sources()
    for line in ("[nixl_kv.agents]", "NIXL = nixl_kv.agents.nixl_agent:NixlAgent", "[nixl_kv.formatters]",
                 "default = nixl_kv.formatters.standard:StandardFormatter", "mla = nixl_kv.formatters.mla:MLAFormatter",
                 "nixl-kv = nixl_kv.cli:main"):  # fmt: skip
        assert line in entry_points.splitlines(), line
    requires = {line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Requires-Dist: ")}
    for dependency in ("nixl==1.5.1", "msgpack>=1.2.4", "numpy>=2.4.6", "mpi4py>=4.1.2", "prometheus_client>=0.26.0"):
        assert dependency in requires, dependency


def test_the_sdist_holds_what_the_wheel_is_built_from(built: tuple[Path, Path]) -> None:
    with tarfile.open(built[1]) as sdist:
        members = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    with zipfile.ZipFile(built[0]) as wheel:
        needed = {_source_of(n) for n in wheel.namelist() if not n.startswith(f"nixl_kv-{VERSION}.dist-info")}
    assert "agents/nixl_agent.py" in needed and "formatters/standard.py" in needed
    assert not (needed | CORE_C) - members, sorted((needed | CORE_C) - members)
    assert {"pyproject.toml", "setup.py", "README.md", "PKG-INFO"} <= members
    built_files = [name for name in members if name.endswith(".so") or (name.endswith(".c") and name not in CORE_C)]
    assert not built_files  # built from the .pyx and the core's own C, never shipped built


def test_the_wheel_installs_beside_openai_agents(wheel_venv: Path, tmp_path: Path) -> None:
    """From a folder outside the checkout: ``agents`` is openai-agents', untouched; ``nixl_kv`` is the wheel's."""
    check = r"""
import base64, hashlib, json, sys
import importlib.metadata as md
from pathlib import Path
import agents, nixl_kv, nixl_kv.agents, nixl_kv.formatters.standard
from nixl_kv import CacheTransceiver, PagedKVCache
from nixl_kv.registry import agent_class, available

def intact(dist):  # every file pip recorded for it, with the hash it recorded
    bad = []
    for f in md.distribution(dist).files:
        if f.hash is not None:
            digest = base64.urlsafe_b64encode(hashlib.new(f.hash.mode, f.read_binary()).digest()).rstrip(b"=")
            if digest.decode() != f.hash.value:
                bad.append(str(f))
    return bad

owners = md.packages_distributions()
print(json.dumps({
    "prefix": sys.prefix,
    "agents": agents.__file__,
    "agents_owners": owners.get("agents"),
    "openai_agents_api": hasattr(agents, "Agent") and hasattr(agents, "Runner"),
    "openai_agents_broken": intact("openai-agents"),
    "nixl_kv": nixl_kv.__file__,
    "nixl_kv_owners": owners.get("nixl_kv"),
    "nixl_kv_agents": nixl_kv.agents.__file__,
    "nixl_kv_broken": intact("nixl-kv"),
    "nixl_kv_files": sorted({str(f).split("/")[0] for f in md.distribution("nixl-kv").files}),
    "version": nixl_kv.__version__,
    "py_typed": (Path(nixl_kv.__file__).parent / "py.typed").is_file(),
    "fastpath": __import__("nixl_kv._fastpath").__file__ and sys.modules["nixl_kv._fastpath"].__file__,
    "core": __import__("nixl_kv._core").__file__ and sys.modules["nixl_kv._core"].__file__,
    "sealed": __import__("nixl_kv.params_seal").params_seal.is_sealed(b"\xcf" + bytes(8)),
    "agent": agent_class("NIXL").__module__,
    "agent_source": available("nixl_kv.agents")["NIXL"][0].source,
}))
"""
    report = json.loads(_run([str(wheel_venv / "bin" / "python"), "-c", check], tmp_path, 120, _clean_env(wheel_venv)))
    site = Path(report["prefix"]) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    assert report["prefix"] == str(wheel_venv)
    assert report["agents"] == str(site / "agents" / "__init__.py")
    assert report["agents_owners"] == ["openai-agents"] and report["openai_agents_api"]
    assert report["openai_agents_broken"] == []
    assert report["nixl_kv"] == str(site / "nixl_kv" / "__init__.py")
    assert report["nixl_kv_owners"] == ["nixl-kv"]
    assert report["nixl_kv_agents"] == str(site / "nixl_kv" / "agents" / "__init__.py")
    assert report["nixl_kv_broken"] == []
    assert report["nixl_kv_files"] == ["..", "nixl_kv", f"nixl_kv-{VERSION}.dist-info"]  # ../../../bin/nixl-kv
    assert report["version"] == VERSION and report["py_typed"]
    fastpath, core = (str(site / name) for name in COMPILED)
    assert report["fastpath"] == fastpath and report["sealed"] is False  # the wheel's compiled modules
    assert report["core"] == core
    assert report["agent"] == "nixl_kv.agents.nixl_agent" and report["agent_source"] == f"nixl-kv {VERSION}"


def test_nixl_kv_pair_runs_from_the_wheel(wheel_venv: Path, tmp_path: Path) -> None:
    command = [str(wheel_venv / "bin" / "nixl-kv"), "pair", "--layers", "2", "--kv-heads", "2", "--head-dim", "64",
               "--requests", "64", "--rounds", "1", "--json"]  # fmt: skip
    summary = json.loads(_run(command, tmp_path, 300, _clean_env(wheel_venv)).strip().splitlines()[-1])
    assert summary["requests"] == summary["verified"] == 1
    assert summary["failed"] == 0 and summary["mismatched_elements"] == 0


def test_a_checkout_on_pythonpath_uses_its_own_folders_over_the_wheel(wheel_venv: Path, tmp_path: Path) -> None:
    """The checkout first on sys.path, the wheel installed: nixl_kv, nixl_kv.agents and the NIXL agent all come
    from the checkout, never half from each."""
    check = (
        "import json, nixl_kv, nixl_kv.agents, nixl_kv.formatters; from nixl_kv.registry import agent_class;"
        "import sys; print(json.dumps([nixl_kv.__file__, nixl_kv.agents.__file__, nixl_kv.formatters.__file__,"
        " sys.modules[agent_class('NIXL').__module__].__file__]))"
    )
    env = _clean_env(wheel_venv, PYTHONPATH=str(ROOT))
    files = json.loads(_run([str(wheel_venv / "bin" / "python"), "-c", check], tmp_path, 120, env))
    assert files == [
        str(ROOT / "nixl_kv" / "__init__.py"),
        str(ROOT / "agents" / "__init__.py"),
        str(ROOT / "formatters" / "__init__.py"),
        str(ROOT / "agents" / "nixl_agent.py"),
    ]
