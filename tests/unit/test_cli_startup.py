"""The ``mlfabric`` command starts without torch or numpy (issue #39: every command, ``--help``
included, took ~3.4 s): ``import mlfabric`` and the CLI's module import neither; the commands
import what they need when they run. Structural checks, in fresh interpreters (this one has
torch loaded already); the timings are in docs/results.md.

    .venv/bin/python -m pytest tests/unit/test_cli_startup.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HEAVY = ("torch", "numpy", "matplotlib", "scipy")


def _run(script: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_import_mlfabric_and_the_cli_loads_no_heavy_module() -> None:
    script = ("import sys, mlfabric, mlfabric.cli, mlfabric.emu, mlfabric.runtime, mlfabric.units; "
              f"print([m for m in {HEAVY!r} if m in sys.modules])")
    assert _run(script).split() == ["[]"]


def test_every_help_page_loads_no_heavy_module() -> None:
    """``mlfabric --help`` and ``mlfabric <cmd> [<sub>] --help`` for every command."""
    script = f"""
import json, sys
from typer.main import get_command
from mlfabric.cli import app
root = get_command(app)
paths, todo = [], [[]]
while todo:
    path = todo.pop()
    paths.append(path)
    group = root
    for name in path:
        group = group.commands[name]
    todo += [path + [name] for name in getattr(group, "commands", {{}})]
for path in paths:
    try:
        root.main(path + ["--help"], prog_name="mlfabric", standalone_mode=False)
    except SystemExit:
        pass
print(json.dumps({{"pages": len(paths), "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    result = json.loads(_run(script).splitlines()[-1])
    assert result["heavy"] == [] and result["pages"] >= 25, result


def test_the_backend_is_registered_when_torch_loads_after_mlfabric() -> None:
    """``import mlfabric`` before torch, with torch's own entry-point autoload off: the import
    hook registers "mlfabric" once torch has loaded; the lazy names resolve."""
    script = ("import sys, mlfabric; assert 'torch' not in sys.modules; "
              "import torch.distributed as dist; from mlfabric import PeerLeftError, Communicator; "
              "print('mlfabric' in dist.Backend.backend_list, callable(mlfabric.torch.allreduce_hook), "
              "issubclass(PeerLeftError, mlfabric.PeerLostError), Communicator.__name__, mlfabric.DEFAULT_TIMEOUT_S, "
              "mlfabric.runtime.DEFAULT_TIMEOUT_S)")
    assert _run(script, TORCH_DEVICE_BACKEND_AUTOLOAD="0").split() == ["True", "True", "True", "Communicator",
                                                                        "60.0", "60.0"]
    script = "import torch.distributed as dist, mlfabric; print('mlfabric' in dist.Backend.backend_list)"
    assert _run(script, TORCH_DEVICE_BACKEND_AUTOLOAD="0").split() == ["True"]


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    import pytest

    import mlfabric

    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        mlfabric.no_such_thing  # noqa: B018
