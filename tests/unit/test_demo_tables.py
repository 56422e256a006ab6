"""The demo's tables stay readable in an 80-column terminal and through a pipe (rich renders
a pipe at 80 columns): every column and every value shows, nothing is cut (issue #26).

Run: python -m pytest tests/unit/test_demo_tables.py
"""

from __future__ import annotations

from types import SimpleNamespace

from rich.console import Console

from mlfabric.demo import _stragglers_table


def test_straggler_table_shows_every_column_in_80_columns() -> None:
    runs = [SimpleNamespace(mode=mode, steps_per_s=rate, final_metric=mse, mean_active=active)
            for mode, rate, mse, active in [("allreduce", 10.12, 0.2412, None),
                                            ("eager-solo", 31.55, 0.2539, 1.3),
                                            ("eager-majority", 18.02, 0.2444, 4.5)]]
    result = SimpleNamespace(config=SimpleNamespace(workers=8, injects=["one-random:300ms"], steps=64),
                             runs=runs, get=lambda mode: runs[0])
    console = Console(width=80, force_terminal=False, color_system=None, record=True)
    console.print(_stragglers_table(result))
    text = console.export_text()
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    assert "…" not in text  # rich marks a cut cell with an ellipsis
    header = next(line for line in text.splitlines() if "gradients via" in line)
    for column in ("steps/s", "speedup", "val MSE", "MSE change", "active"):
        assert column in header, header
    for values in (("eager-majority", "18.02", "1.78x", "0.244", "+1.3%", "4.5 of 8"),
                   ("eager-solo", "31.55", "3.12x", "0.254", "+5.3%", "1.3 of 8")):
        row = next(line for line in text.splitlines() if line.strip().startswith(values[0] + " "))
        assert row.split() == [*values[:5], *values[5].split()], row
