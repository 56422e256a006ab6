"""The test tree itself: every test module's file name is unique across tests/unit, tests/local
and tests/emu (they have no __init__.py, so pytest imports them by basename: two modules of one
name stop the collection of the whole suite, as tests/local/test_faults.py once did in CI).

    .venv/bin/python -m pytest tests/unit/test_suite_layout.py -q
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path


def test_test_module_names_are_unique() -> None:
    root = Path(__file__).resolve().parents[1]
    names = Counter(p.name for p in root.glob("*/test_*.py"))
    assert len(names) > 50  # the glob found the suite
    assert [n for n, c in names.items() if c > 1] == []
