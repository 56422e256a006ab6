"""What must never be committed: the virtual environment (a directory, or a symlink to one).

    .venv/bin/python -m pytest tests/unit/test_repo_hygiene.py -q

Regression: a `.venv` symlink (pointing into another checkout) was committed by `git add -A`
because `.gitignore` said `.venv/`, which matches a directory but not a symlink; a fresh clone
then carried a link into a path that does not exist on another machine.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_no_virtual_environment_is_tracked_and_a_venv_symlink_is_ignored() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert not [p for p in tracked if p == ".venv" or p.startswith(".venv/")], "a virtual environment is tracked"
    ignored = subprocess.run(["git", "check-ignore", "--no-index", "-q", ".venv"], cwd=ROOT)
    assert ignored.returncode == 0, ".gitignore must ignore .venv whether it is a directory or a symlink"
