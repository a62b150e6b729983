"""What an embedder sees of the package: the public names, a cheap import, nixl_kv.agents and nixl_kv.formatters
from a checkout and from the editable install, nothing generic at the top level, and plug-ins found through entry
points (a real plug-in package installed into a temporary virtual environment)."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import json
import re
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

import nixl_kv
from nixl_kv import registry
from nixl_kv.errors import NotSupportedError

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("nixl", "torch", "cupy", "numpy")

# What the issue asks the top level to export (a subset of __all__).
REQUIRED = {
    "CacheTransceiver", "create_cache_transceiver", "CacheTransceiverConfig", "CacheManager", "PagedKVCache",
    "RnnStatePools", "CacheState", "ModelConfig", "ParallelConfig", "RnnConfig", "AttentionType",
    "ConvSectionLayout", "DataType", "ContextPhaseParams", "DataTransceiverState", "TransferRequest",
    "RequestState", "RequestStatuses", "ContextProgress", "CacheTransceiverComm", "SingleProcessComm", "MpiComm",
    "NixlKvError", "WireFormatError", "IncompatibleStateError", "NotSupportedError", "BufferExhaustedError",
    "TransferError", "AgentError",
}  # fmt: skip


def _python(*args: str, cwd: Path, timeout_s: float = 120, python: str = sys.executable) -> str:
    result = subprocess.run([python, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


# --- the public surface ---------------------------------------------------------------------------------------------
def test_every_public_name_resolves_to_its_module_object() -> None:
    assert not REQUIRED - set(nixl_kv.__all__), REQUIRED - set(nixl_kv.__all__)
    assert sorted(nixl_kv.__all__) == nixl_kv.__all__ and set(nixl_kv.__all__) == set(nixl_kv._MODULE_OF)
    for name in nixl_kv.__all__:
        module = importlib.import_module(nixl_kv._MODULE_OF[name])
        assert getattr(nixl_kv, name) is getattr(module, name), name
    assert set(nixl_kv.__all__) | {"__version__"} <= set(dir(nixl_kv))
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        nixl_kv.Nope  # noqa: B018


def test_the_type_checking_imports_match_the_lazy_table() -> None:
    """Type checkers read the ``if TYPE_CHECKING`` imports; the lazy loader reads ``_EXPORTS``: the same names from
    the same modules."""
    tree = ast.parse(Path(nixl_kv.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    typed = {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert typed == nixl_kv._MODULE_OF


def test_version_comes_from_the_package_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    assert nixl_kv.__version__ == importlib.metadata.version("nixl-kv")

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert nixl_kv._version() == "0+unknown"  # a checkout on sys.path that was never installed


def test_importing_nixl_kv_is_cheap(tmp_path: Path) -> None:
    """``import nixl_kv`` loads no numpy, nixl, torch or cupy; the public names load their modules on first use,
    and even the transceiver's leave nixl to the first agent created."""
    report = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import nixl_kv"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert report.returncode == 0, report.stderr
    rows = [line.split("|") for line in report.stderr.splitlines() if line.startswith("import time:")][1:]
    imported = {row[2].strip(): int(row[1]) for row in rows}
    assert not [name for name in imported if name.split(".")[0] in HEAVY]
    assert imported["nixl_kv"] < 100_000, imported["nixl_kv"]  # microseconds, cumulative (about 5 ms here)
    code = (
        "import sys, json, nixl_kv; nixl_kv.__version__;"
        "from nixl_kv import CacheTransceiver, PagedKVCache, create_cache_transceiver;"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'nixl', 'torch', 'cupy'})))"
    )
    assert json.loads(_python("-c", code, cwd=tmp_path)) == []


# --- nixl_kv.agents and nixl_kv.formatters ----------------------------------------------------------------------
_WHERE = textwrap.dedent(
    """
    import importlib.util, json, sys
    import nixl_kv.agents, nixl_kv.formatters
    print(json.dumps({
        "nixl_kv": nixl_kv.__file__,
        "agents": nixl_kv.agents.__file__,
        "formatters": nixl_kv.formatters.__file__,
        "top_level": sorted(name for name in ("agents", "formatters") if name in sys.modules),
        "tests": importlib.util.find_spec("nixl_kv.tests") is not None,
    }))
    """
)


def test_a_checkout_on_sys_path_maps_its_own_folders_without_any_install(tmp_path: Path) -> None:
    """No site-packages at all (-S): nixl_kv.agents and .formatters are the checkout's agents/ and formatters/,
    under those names only; nothing else of the checkout root becomes part of nixl_kv."""
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + _WHERE
    where = json.loads(_python("-I", "-S", "-c", code, cwd=tmp_path))
    assert where == {
        "nixl_kv": str(ROOT / "nixl_kv" / "__init__.py"),
        "agents": str(ROOT / "agents" / "__init__.py"),
        "formatters": str(ROOT / "formatters" / "__init__.py"),
        "top_level": [],
        "tests": False,
    }


def test_the_editable_install_maps_them_and_puts_nothing_generic_at_the_top_level(tmp_path: Path) -> None:
    """From outside the checkout (-I: no cwd, no PYTHONPATH), through the project venv's editable install."""
    code = _WHERE + textwrap.dedent(
        """
        import nixl_kv.agents.nixl_agent, nixl_kv.formatters.mla
        assert importlib.util.find_spec("agents") is None and importlib.util.find_spec("formatters") is None
        """
    )
    where = json.loads(_python("-I", "-c", code, cwd=tmp_path))
    assert where["agents"] == str(ROOT / "agents" / "__init__.py")
    assert where["formatters"] == str(ROOT / "formatters" / "__init__.py")
    assert where["top_level"] == [] and not where["tests"]
    top_level = importlib.metadata.distribution("nixl-kv").read_text("top_level.txt").split()
    assert top_level == ["nixl_kv"]


# --- the registry -----------------------------------------------------------------------------------------------
def test_pyproject_declares_the_builtin_entry_points() -> None:
    tomllib = pytest.importorskip("tomllib")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared.pop("sglang.srt.plugins") == {"nixl_kv": "nixl_kv.sglang:register"}  # SGLang's plugin group
    assert declared == registry.BUILTIN
    installed = {
        group: {p.name: p.value for p in importlib.metadata.entry_points(group=group)} for group in registry.BUILTIN
    }
    assert installed == registry.BUILTIN


def test_an_unknown_name_lists_what_is_installed() -> None:
    with pytest.raises(NotSupportedError) as caught:
        registry.agent_class("NO_SUCH_AGENT")
    version = importlib.metadata.version("nixl-kv")
    installed = ", ".join(f"{name} (nixl-kv {version})" for name in ("MOONCAKE", "MPI", "NIXL", "UCX"))
    assert (
        f"no transfer agent named 'NO_SUCH_AGENT'; installed (entry point group 'nixl_kv.agents'): {installed}"
        in str(caught.value)
    )
    with pytest.raises(
        NotSupportedError, match=r"no formatter named 'mamba'; .*: default \(nixl-kv .*\), mla \(nixl-kv"
    ):
        registry.formatter_class("mamba")


def test_run_time_registration_comes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry._REGISTERED, registry.AGENT_GROUP, {"NIXL": "json:JSONDecoder", "MINE": "json:dumps"})
    assert registry.agent_class("NIXL") is json.JSONDecoder and registry.agent_class("MINE") is json.dumps
    assert registry.agent_names() == ["MINE", "MOONCAKE", "MPI", "NIXL", "UCX"]
    nixl_kv.register_formatter("other", "json:loads")
    try:
        assert registry.formatter_class("other") is json.loads
    finally:
        registry._REGISTERED[registry.FORMATTER_GROUP].pop("other")


def _points(*declared: tuple[str, str, str]) -> list[SimpleNamespace]:
    return [
        SimpleNamespace(name=name, value=value, dist=SimpleNamespace(metadata={"Name": dist}, version="1.0"))
        for name, value, dist in declared
    ]


def test_without_its_own_metadata_the_builtins_still_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """A source checkout on PYTHONPATH (the GPU machine) has no nixl-kv metadata: the built-ins stand in."""
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: _points(("X", "json:loads", "plug")))
    from nixl_kv.agents.nixl_agent import NixlAgent

    assert registry.agent_class("NIXL") is NixlAgent and registry.agent_class("X") is json.loads
    assert registry.available(registry.AGENT_GROUP)["NIXL"][0].source == "nixl-kv (source checkout)"


def test_a_name_declared_by_two_distributions_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    points = _points(("NIXL", "nixl_kv.agents.nixl_agent:NixlAgent", "nixl-kv"), ("NIXL", "evil:Agent", "evil"))
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: points)
    with pytest.raises(NotSupportedError, match=r"'NIXL' is declared more than once: .* from nixl-kv 1.0; evil:Agent"):
        registry.agent_class("NIXL")


def test_a_plugin_that_cannot_load_says_which(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry._REGISTERED, registry.AGENT_GROUP, {"GONE": "no_such_module_here:Agent"})
    with pytest.raises(NotSupportedError, match="'GONE' .*from register_agent.* cannot be loaded: No module named"):
        registry.agent_class("GONE")


# --- a real plug-in, installed ---------------------------------------------------------------------------------
PLUGIN_PYPROJECT = """\
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "kv-loopback-plugin"
version = "1.0"

[project.entry-points."nixl_kv.agents"]
LOOPBACK = "kv_loopback_plugin:LoopbackAgent"

[project.entry-points."nixl_kv.formatters"]
loopback = "kv_loopback_plugin:LoopbackFormatter"

[tool.setuptools]
py-modules = ["kv_loopback_plugin"]
"""

PLUGIN_MODULE = '''\
"""A third-party transfer agent and formatter: NIXL's and the standard one, counting their uses."""

from nixl_kv.agents.nixl_agent import NixlAgent
from nixl_kv.formatters.standard import StandardFormatter


class LoopbackAgent(NixlAgent):
    created = []

    def __init__(self, name, **options):
        super().__init__(name, **options)
        LoopbackAgent.created.append(name)


class LoopbackFormatter(StandardFormatter):
    pass
'''

PLUGIN_CHECK = """\
import numpy as np

import kv_loopback_plugin
from nixl_kv import (
    CacheState, CacheTransceiverConfig, DataType, ModelConfig, NotSupportedError, PagedKVCache, ParallelConfig,
    RequestState, TransferRequest, create_cache_transceiver,
)
from nixl_kv.registry import agent_class, formatter_class

assert formatter_class("loopback") is kv_loopback_plugin.LoopbackFormatter
try:
    agent_class("NOPE")
except NotSupportedError as exc:
    print("unknown:", exc)

state = CacheState(ModelConfig((2,) * 2, 8, 16), ParallelConfig(attention_layers_per_pp_rank=(2,)), DataType.INT8)
caches = [PagedKVCache(16, 2, 2, 16, 8, DataType.INT8) for _ in range(2)]
ctx = create_cache_transceiver(caches[0], state, CacheTransceiverConfig(backend="LOOPBACK"), environ={})
gen = create_cache_transceiver(caches[1], state, CacheTransceiverConfig(), environ={"NIXL_KV_BACKEND": "LOOPBACK"})
by_switch = create_cache_transceiver(
    PagedKVCache(4, 2, 2, 16, 8, DataType.INT8), state, CacheTransceiverConfig(backend="DEFAULT"),
    environ={"NIXL_KV_USE_LOOPBACK": "1"},
)
try:
    assert ctx.config.backend == gen.config.backend == by_switch.config.backend == "LOOPBACK"
    caches[0].allocate(1, 40)
    kv = np.arange(2 * 2 * 2 * 40 * 8, dtype=np.uint8).reshape(2, 2, 2, 40, 8)
    caches[0].write_tokens(1, kv)
    ctx_request = TransferRequest(1, num_tokens=40)
    ctx.respond_and_send_async(ctx_request)
    caches[1].allocate(2, 40)
    gen_request = TransferRequest(2, context_phase_params=ctx_request.context_phase_params)
    gen.request_and_receive_sync(gen_request)
    assert gen_request.state is RequestState.GENERATION_TRANS_COMPLETE, gen_request.error
    assert np.array_equal(caches[1].read_tokens(2, 40), kv)
    print("agents:", len(kv_loopback_plugin.LoopbackAgent.created))
    print("verified")
finally:
    for transceiver in (by_switch, gen, ctx):
        transceiver.close()
"""


def test_a_plugin_package_installed_with_pip_is_selected_by_name(tmp_path: Path) -> None:
    """The plug-in is a package of its own (pyproject.toml declaring entry points), built and installed by pip
    offline into a temporary venv that also sees this project's venv; it is then selected by name."""
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "pyproject.toml").write_text(PLUGIN_PYPROJECT)
    (plugin / "kv_loopback_plugin.py").write_text(PLUGIN_MODULE)
    venv = tmp_path / "venv"
    # `venv --system-site-packages` would expose the base interpreter's site-packages, not this venv's: a .pth
    # file adds this venv's (its own .pth files included, so the editable nixl_kv) behind the new venv's own.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = str(venv / "bin" / "python")
    purelib = Path(
        _python("-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path, python=python).strip()
    )
    project_site = sysconfig.get_paths()["purelib"]
    (purelib / "_nixl_kv_project_venv.pth").write_text(f"import site; site.addsitedir({project_site!r})\n")
    # pip and setuptools come from the project venv; --no-index: nothing is downloaded
    install = ["-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", str(plugin)]
    _python(*install, cwd=tmp_path, python=python, timeout_s=300)
    assert (purelib / "kv_loopback_plugin.py").exists()  # installed into the temporary venv, not the project's
    assert not (Path(project_site) / "kv_loopback_plugin.py").exists()
    (tmp_path / "check.py").write_text(PLUGIN_CHECK)
    out = _python(str(tmp_path / "check.py"), cwd=tmp_path, python=python)
    assert "verified" in out and "agents: 3" in out, out
    version = importlib.metadata.version("nixl-kv")
    listed = f"LOOPBACK (kv-loopback-plugin 1.0), MOONCAKE (nixl-kv {version}), MPI (nixl-kv {version}), "
    listed += f"NIXL (nixl-kv {version}), UCX (nixl-kv {version})"
    assert f"unknown: no transfer agent named 'NOPE'; installed (entry point group 'nixl_kv.agents'): {listed}" in out
    # and the project venv itself never saw it
    with pytest.raises(NotSupportedError, match="no transfer agent named 'LOOPBACK'"):
        registry.agent_class("LOOPBACK")


# --- dependencies ----------------------------------------------------------------------------------------------
# Third-party modules imported only where optional: cupy for VRAM pools (the gpu-cu12/gpu-cu13 extras), torch for
# the harness's NCCL baseline on GPUs (None without it; nixl itself depends on torch), mooncake for its agent (the
# mooncake extra), libucx for the UCX agent where the mpich wheel is absent (the ucx extra).
# vllm: nixl_kv.vllm runs inside vLLM, whose CPU build pins what ours does differently (numpy, torch): no extra can
# hold both, so scripts/vllm_env.sh installs it in a venv of its own; sglang likewise (scripts/sglang_env.sh)
OPTIONAL = {"cupy", "torch", "mooncake", "libucx", "vllm", "sglang"}
REQUIRED_IMPORTS = {"nixl", "msgpack", "numpy", "mpi4py", "prometheus_client"}  # each its distribution's name


def _third_party_imports(files: object) -> set[str]:
    imported: set[str] = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    return imported - set(sys.stdlib_module_names) - {"nixl_kv"}


def test_every_import_is_a_declared_dependency() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[=<>!~ ;\[]", dependency)[0] for dependency in project["dependencies"]}
    files = [*(ROOT / "nixl_kv").rglob("*.py"), *(ROOT / "agents").glob("*.py"), *(ROOT / "formatters").glob("*.py")]
    imported = _third_party_imports(files)
    third_party = imported - set(sys.stdlib_module_names) - {"nixl_kv"}
    serving = _third_party_imports((ROOT / "nixl_kv" / "serving").rglob("*.py"))
    assert third_party - OPTIONAL - (serving - REQUIRED_IMPORTS) == REQUIRED_IMPORTS == declared
    assert all(
        extra in project["optional-dependencies"] for extra in ("gpu-cu12", "gpu-cu13", "serve", "mooncake", "ucx")
    )
    serve_extra = {re.split(r"[=<>!~ ;\[]", dependency)[0] for dependency in project["optional-dependencies"]["serve"]}
    assert serving - REQUIRED_IMPORTS <= serve_extra  # the servers' imports come with `pip install nixl-kv[serve]`
    for dependency in project["dependencies"]:  # a floor (or a pin) on every one
        assert any(op in dependency for op in (">=", "==")), dependency


def test_without_prometheus_client_the_counters_still_count_and_a_warning_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from nixl_kv import metrics

    monkeypatch.setattr(metrics._Prometheus, "_collector", None)  # restored afterwards: the real one stays
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # importing it now raises ImportError
    with caplog.at_level("WARNING", logger="nixl_kv.metrics"):
        counters = metrics.TransferMetrics("no-prometheus")
    assert "prometheus_client cannot be imported: nixl_kv_* metrics are not exported" in caplog.text
    counters.add("gen", bytes=10, requests=1)
    assert counters.snapshot()["gen"]["bytes"] == 10
