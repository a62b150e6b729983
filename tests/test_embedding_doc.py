"""docs/embedding.md: its example runs as written, verifies what it received, and imports only the public API."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import nixl_kv

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "embedding.md"
MARKER = re.compile(r"<!-- tested:[^>]*-->\n```python\n(.*?)\n```", re.S)


def _example() -> str:
    blocks = MARKER.findall(GUIDE.read_text())
    assert len(blocks) == 1, f"docs/embedding.md should hold one tested python block, found {len(blocks)}"
    return blocks[0]


def test_the_example_imports_only_the_public_names() -> None:
    imported: set[str] = set()
    for node in ast.walk(ast.parse(_example())):
        if isinstance(node, ast.Import):
            assert not any(alias.name.startswith("nixl_kv") for alias in node.names), ast.unparse(node)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nixl_kv"):
            assert node.module == "nixl_kv", f"not the public API: {ast.unparse(node)}"
            imported |= {alias.name for alias in node.names}
    assert imported and imported <= set(nixl_kv.__all__), imported - set(nixl_kv.__all__)


def test_the_example_moves_and_verifies_the_bytes(tmp_path: Path) -> None:
    script = tmp_path / "embedding_example.py"
    script.write_text(_example())
    # its own process, from outside the checkout: only what is installed is importable
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "every element verified" in result.stdout
    blocks = -(-100 // 16)
    assert f"moved {blocks * 4 * 2 * 2 * 16 * 64 * 2} bytes" in result.stdout  # whole blocks of bf16 KV
