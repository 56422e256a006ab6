"""The worker's overlap (TicTac §5.1): each module's forward starts once its own parameters are in.

    .venv/bin/python -m pytest tests/unit/test_ps_ordered.py -q -k gate

:class:`ParameterGate` puts a forward pre-hook on every submodule that owns parameters: the
hook waits (bounded) on the current :class:`~mlfabric.ps.policies.ordered.ArrivingModel` until that
module's own parameters have landed (or on any :class:`Arrivals`: an
:class:`~mlfabric.torch.OrderedAllreduce`, until they are updated), so the forward of the first layers overlaps the transfer
of the later ones. With no pull attached (a flat pull, or none) the hooks do not wait.

The same hooks record the iteration's **trace**: per leaf-module call, its span (named like
the DAG's node of that call, so the time oracle and E of :mod:`mlfabric.order` read it), and
each wait for parameters. With ``device_time`` (seconds per DAG node), the leaf modules run on
an **emulated accelerator**, for machines whose CPU is shared (``mlfabric bench tictac``
documents when it uses it). It behaves like a GPU stream: the host *launches* each op (runs it
for real, for its output, without sleeping) and goes on to the next; the device runs the op
from ``max(device free, parameters in, launch)`` for its device time, and that interval is
the op's span. The host so runs ahead of the device, and a descheduled host only costs time
when the device has caught up with it (counted in ``host_late``), as on an accelerator fed
by a CPU. The root module's forward ends with a synchronize (the host sleeps until the device
is done), so whoever times ``model(x)`` sees the device's time. :meth:`ParameterGate.trace`
joins the spans with the pull's transfers into an :class:`mlfabric.order.trace.Trace`
(Chrome/Perfetto export: :func:`mlfabric.order.trace.write_chrome`).
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Mapping, Protocol, Sequence

from torch import fx, nn

from mlfabric.order.trace import Span, Trace

__all__ = ["Arrivals", "ParameterGate", "call_names"]


class Arrivals(Protocol):
    """What the gate waits on: parameter -> when it became usable, and a bounded wait."""

    @property
    def complete(self) -> Mapping[str, float]: ...

    def wait(self, keys: Iterable[str] | None = None, *, timeout: float | None = None, who: str = "") -> None: ...

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
    pull's ``timeout_s``). Use :meth:`attach` per iteration, :meth:`remove` at the end.
    ``waits`` are the host's waits for parameters; ``host_late`` the leaf calls the emulated
    device waited for the host to launch (neither busy nor waiting for parameters)."""

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
        self.arriving: Arrivals | None = None
        self.spans: list[Span] = []
        self.waits: list[Span] = []  # (module, wait start, wait end) of the waits that blocked
        self.host_late = 0
        self._calls: dict[str, int] = {}
        self._started: dict[str, tuple[float, float, bool]] = {}  # module -> (launch, parameters in, waited)
        self._device_free = 0.0  # when the emulated device finishes the last op launched
        if self.device_time:
            self._handles.append(module.register_forward_hook(self._synchronize))

    def attach(self, arriving: Arrivals | None) -> None:
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
            ready, waited = 0.0, False
            if own and arriving is not None:
                if any(k not in arriving.complete for k in own):
                    start = time.monotonic()
                    arriving.wait(own, timeout=self.timeout_s, who=f"module {name!r}")
                    self.waits.append((name, start, time.monotonic()))
                    waited = True
                ready = max(arriving.complete[k] for k in own)
            self._started[name] = (time.monotonic(), ready, waited)
        return hook

    def _post_hook(self, name: str) -> Any:
        def hook(_module: nn.Module, _args: Any, _out: Any) -> None:
            started = self._started.pop(name, None)
            if started is None:
                return
            launch, ready, waited = started
            node = self._node(name)
            target = self.device_time.get(node)
            if target is None:  # no emulated device for this op: its real interval
                start, end = launch, time.monotonic()
                self._device_free = max(self._device_free, end)
            else:
                # A stream: the op starts when the device is free, its parameters are in and
                # the host has launched it. The real compute just done is the host's (it gives
                # the output); it delays only the launches that follow.
                start = max(self._device_free, ready, launch)
                if self.spans and not waited and launch > max(self._device_free, ready):
                    self.host_late += 1  # (not the first launch, nor the wake-up from a wait)
                end = self._device_free = start + target
            self.spans.append((node, start, end))
        return hook

    def _synchronize(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        """The root module's forward returns when the emulated device has run every op."""
        pad_to(self._device_free, 0.0)

    def trace(self, transfers: Sequence[Span] | None = None, **meta: Any) -> Trace:
        """This iteration's compute spans with ``transfers`` (default: the attached pull's)."""
        if transfers is None:
            spans = getattr(self.arriving, "transfer_spans", None)  # a pull's (ArrivingModel) transfers
            transfers = spans() if spans is not None else ()
        return Trace.of(self.spans, transfers, **meta)


def pad_to(start: float, seconds: float) -> bool:
    """Sleep until ``start + seconds`` (an emulated device op); False if that had passed."""
    left = start + seconds - time.monotonic()
    if left > 0:
        time.sleep(left)
        return True
    return False

