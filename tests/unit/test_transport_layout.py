"""The transport package's import structure: the framing and link machinery lives in
``framing.py``, which both link kinds use; the shared-memory link does not import the tcp
transport (it once reached into tcp's private names while tcp imported it back).

    .venv/bin/python -m pytest tests/unit/test_transport_layout.py -q
"""

from __future__ import annotations

import ast
from pathlib import Path

TRANSPORT = Path(__file__).resolve().parents[2] / "mlfabric" / "transport"


def _imported_modules(path: Path) -> set[str]:
    """The sibling modules ``path`` imports (``from .x import ...``, anywhere in the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlfabric.transport."):
            found.add(node.module.split(".")[2])
    return found


def _private_names_from(path: Path, module: str) -> list[str]:
    """Names starting with ``_`` that ``path`` imports from sibling ``module``."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module == module:
            names += [alias.name for alias in node.names if alias.name.startswith("_")]
    return names


def test_shared_memory_links_do_not_import_the_tcp_transport() -> None:
    assert "tcp" not in _imported_modules(TRANSPORT / "shm.py")
    assert "framing" in _imported_modules(TRANSPORT / "shm.py")


def test_framing_imports_neither_link_kind() -> None:
    assert not {"tcp", "shm"} & _imported_modules(TRANSPORT / "framing.py")


def test_no_private_name_crosses_a_transport_module() -> None:
    crossings = {(path.name, module): names
                 for path in TRANSPORT.glob("*.py")
                 for module in {p.stem for p in TRANSPORT.glob("*.py")}
                 if (names := _private_names_from(path, module))}
    assert crossings == {}
