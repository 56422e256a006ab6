"""The worker's overlap (TicTac §5.1): each module's forward starts once its own parameters are in.

    .venv/bin/python -m pytest tests/unit/test_ps_ordered.py -q -k gate

:class:`ParameterGate` puts a forward pre-hook on every submodule that owns parameters: the
hook waits (bounded) on the current :class:`~mlfabric.ps.ordered.ArrivingModel` until that
module's own parameters have landed, so the forward of the first layers overlaps the transfer
of the later ones. With no pull attached (a flat pull, or none) the hooks do not wait.

The same hooks record the iteration's **trace**: per leaf-module call, the span from the end
of its wait to the end of its forward (named like the DAG's node of that call, so the time
oracle and E of :mod:`mlfabric.order` read it), and the wait itself. With ``device_time``
(seconds per DAG node), the leaf modules run on an emulated accelerator, for machines whose
CPU is shared (``mlfabric bench tictac`` documents when it uses it): the op runs for real,
then sleeps until ``start + device_time`` where ``start`` is when the device was free and the
op's parameters were in; its span is that device interval. A late wake-up or a descheduled
process is absorbed by the following pads instead of adding up (a real op that outlasts its
device time ends the interval, and counts in ``overrun``). :meth:`ParameterGate.trace` joins the spans with the pull's transfers into
an :class:`mlfabric.order.trace.Trace` (Chrome/Perfetto export: :func:`mlfabric.order.trace.write_chrome`).
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from torch import fx, nn

from mlfabric.order.trace import Span, Trace

from .ordered import ArrivingModel

__all__ = ["ParameterGate", "call_names"]


def call_names(graph_module: fx.GraphModule) -> dict[str, list[str]]:
    """Module name -> the fx node names of its calls, in program order (a module called
    twice, e.g. one shared ReLU, has several): how a hook names the DAG node it runs."""
    out: dict[str, list[str]] = {}
    for n in graph_module.graph.nodes:
        if n.op == "call_module":
            out.setdefault(str(n.target), []).append(n.name)
    return out


class ParameterGate:
    """Forward pre-hooks on ``module`` (module docstring). ``node_names``: module name -> DAG
    node names of its calls (:func:`call_names`), for the trace; ``device_time``: DAG node ->
    seconds a leaf's forward is padded to; ``timeout_s``: bound of each wait (default: the
    pull's ``timeout_s``). Use :meth:`attach` per iteration, :meth:`remove` at the end."""

    def __init__(self, module: nn.Module, *, node_names: Mapping[str, Sequence[str]] | None = None,
                 device_time: Mapping[str, float] | None = None, timeout_s: float | None = None) -> None:
        self.module = module
        self.node_names = {k: list(v) for k, v in (node_names or {}).items()}
        self.device_time = dict(device_time or {})
        self.timeout_s = timeout_s
        key_of = {id(p): k for k, p in module.named_parameters()}
        self._own: dict[str, list[str]] = {}
        self._handles: list[Any] = []
        for name, sub in module.named_modules():
            own = [key_of[id(p)] for p in sub.parameters(recurse=False) if id(p) in key_of]
            leaf = not any(True for _ in sub.children())
            if not own and not leaf:
                continue
            self._own[name] = own
            self._handles.append(sub.register_forward_pre_hook(self._pre_hook(name, own)))
            if leaf:
                self._handles.append(sub.register_forward_hook(self._post_hook(name)))
        self.arriving: ArrivingModel | None = None
        self.spans: list[Span] = []
        self.waits: list[Span] = []  # (module, wait start, wait end) of the waits that blocked
        self.overrun = 0  # leaf calls whose real compute took longer than their device time
        self._calls: dict[str, int] = {}
        self._started: dict[str, tuple[float, float]] = {}  # module -> (real start, its parameters' arrival)
        self._device_free = 0.0  # when the emulated device finished its last op

    def attach(self, arriving: ArrivingModel | None) -> None:
        """Start an iteration: the hooks wait on ``arriving`` (None: no waiting); spans restart."""
        self.arriving = arriving
        self.spans, self.waits = [], []
        self._calls = {}
        self._started = {}
        self._device_free = time.monotonic()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "ParameterGate":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _node(self, module_name: str) -> str:
        k = self._calls.get(module_name, 0)
        self._calls[module_name] = k + 1
        names = self.node_names.get(module_name)
        if names and k < len(names):
            return names[k]
        return module_name if k == 0 else f"{module_name}#{k}"

    def _pre_hook(self, name: str, own: list[str]) -> Any:
        def hook(_module: nn.Module, _args: Any) -> None:
            arriving = self.arriving
            ready = 0.0
            if own and arriving is not None:
                if any(k not in arriving.complete for k in own):
                    start = time.monotonic()
                    arriving.wait(own, timeout=self.timeout_s, who=f"module {name!r}")
                    self.waits.append((name, start, time.monotonic()))
                ready = max(arriving.complete[k] for k in own)
            self._started[name] = (time.monotonic(), ready)
        return hook

    def _post_hook(self, name: str) -> Any:
        def hook(_module: nn.Module, _args: Any, _out: Any) -> None:
            started = self._started.pop(name, None)
            if started is None:
                return
            start, ready = started
            node = self._node(name)
            target = self.device_time.get(node)
            if target is None:
                end = time.monotonic()
            else:
                # The emulated device runs the op from when it was free and the op's parameters
                # were in, for its device time; a host that fell behind (a late wake-up, another
                # process on the CPU) catches up in the next pads instead of adding up.
                start = max(self._device_free, ready)
                end = start + target
                if not pad_to(end, 0.0):
                    self.overrun += 1
                    end = time.monotonic()
            self._device_free = end
            self.spans.append((node, start, end))
        return hook

    def trace(self, transfers: Sequence[Span] | None = None, **meta: Any) -> Trace:
        """This iteration's compute spans with ``transfers`` (default: the attached pull's)."""
        if transfers is None:
            transfers = self.arriving.transfer_spans() if self.arriving is not None else ()
        return Trace.of(self.spans, transfers, **meta)


def pad_to(start: float, seconds: float) -> bool:
    """Sleep until ``start + seconds`` (an emulated device op); False if that had passed."""
    left = start + seconds - time.monotonic()
    if left > 0:
        time.sleep(left)
        return True
    return False

