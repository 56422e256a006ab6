"""The DAG a PS worker executes per iteration: compute ops and the recv ops (parameter pulls).

    .venv/bin/python -m pytest tests/unit/test_order_dag.py -q

TicTac (§2.3-2.4) reduces ordering in Model-Replica with a parameter server to the order of
the worker partition's *recv* ops: every read of a parameter becomes a recv (a leaf of the
worker's DAG), every update a send (a root, not modelled here: pushes travel on the other
direction of a full-duplex link and nothing in the iteration waits on them).

:class:`Dag` is the small generic structure the heuristics and the simulator work on: nodes
added in topological order (an input must exist before its user, so a :class:`Dag` is
acyclic by construction), each a ``compute`` or a ``recv`` node, with an optional hand-given
``cost`` (used by :meth:`mlfabric.order.oracle.TimeOracle.from_costs`, for tests and worked
examples) and, for recvs, the parameter and its size in bytes.

Two extractors build a :class:`ModelDag` (the :class:`Dag` plus the torch.fx GraphModule
whose nodes it names, so the oracle can time them):

* :func:`forward_dag`: ``torch.fx.symbolic_trace`` at *module* granularity (a leaf module
  such as ``Conv2d`` is one op; its parameters are the recvs attached to it; a parameter
  read with ``get_attr`` becomes that recv). Module granularity is where a worker can gate
  execution on arrived parameters (forward pre-hooks). When symbolic tracing fails (Python
  control flow on tensor values or shapes), ``torch.export`` is used instead: an ATen-level
  graph whose lifted parameter placeholders are the recvs.
* :func:`training_dag`: forward + backward at ATen granularity, from ``make_fx`` (torch.fx's
  proxy-tensor tracer) of ``grad(loss(model(x)), params)``; parameter placeholders are the
  recvs; nodes that the loss does not depend on are tagged ``backward``.

Inputs (the data batch) are local and available at time 0, so they are not nodes; buffers
and constants are not pulled (the PS stores parameters only), so they are not recvs either.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping, Sequence

import torch
from torch import fx, nn

__all__ = ["EXECUTORS", "Dag", "Kind", "ModelDag", "Node", "dag_from_edges", "default_loss", "forward_dag",
           "recv_name", "training_dag"]

#: How a worker runs its forward: ``eager`` (PyTorch: the ops in program order) or
#: ``dataflow`` (the paper's TensorFlow: any op whose inputs are in), :meth:`Dag.as_run_by`.
EXECUTORS = ("eager", "dataflow")

Phase = Literal["forward", "backward"]


class Kind(str, Enum):
    """Which resource a node runs on: the compute resource or the (single) channel."""

    COMPUTE = "compute"
    RECV = "recv"


@dataclass(frozen=True, kw_only=True, slots=True)
class Node:
    """One op of the worker partition. ``inputs`` are the names of the nodes it depends on."""

    name: str
    kind: Kind
    inputs: tuple[str, ...] = ()
    cost: float = 0.0  # hand-given time (TimeOracle.from_costs); measured oracles ignore it
    size_bytes: int = 0  # recv: bytes pulled from the PS
    param: str | None = None  # recv: the parameter's fully qualified name
    target: str = ""  # compute: what runs (module class / ATen op), for reports
    phase: Phase = "forward"


def recv_name(param: str) -> str:
    """The DAG name of the recv that pulls parameter ``param``."""
    return f"recv:{param}"


class Dag:
    """A DAG of compute and recv nodes, kept in topological (insertion) order.

    Insertion order doubles as the program order the simulator's compute resource uses to
    break ties among ready ops (what eager PyTorch would run first), so it is part of the
    structure, not an accident of construction."""

    def __init__(self) -> None:
        self._nodes: dict[str, Node] = {}
        self._succs: dict[str, list[str]] = {}
        self._deps: dict[str, frozenset[str]] | None = None

    # ----------------------------------------------------------------- construction
    def add(self, node: Node) -> Node:
        if node.name in self._nodes:
            raise ValueError(f"Dag: duplicate node {node.name!r}")
        for i in node.inputs:
            if i not in self._nodes:
                raise ValueError(f"Dag: node {node.name!r} uses {i!r}, which is not in the DAG yet "
                                 "(add nodes in topological order)")
        if node.kind is Kind.RECV and node.inputs:
            # §2.4: in the worker partition every recv is a leaf.
            raise ValueError(f"Dag: recv {node.name!r} has inputs {node.inputs}; recvs are leaves")
        if len(set(node.inputs)) != len(node.inputs):
            node = _replace_inputs(node, tuple(dict.fromkeys(node.inputs)))
        self._nodes[node.name] = node
        self._succs[node.name] = []
        for i in node.inputs:
            self._succs[i].append(node.name)
        self._deps = None
        return node

    def add_recv(self, name: str, *, size_bytes: int = 0, cost: float = 0.0, param: str | None = None) -> Node:
        return self.add(Node(name=name, kind=Kind.RECV, size_bytes=size_bytes, cost=cost, param=param))

    def add_compute(self, name: str, inputs: Sequence[str] = (), *, cost: float = 0.0, target: str = "",
                    phase: Phase = "forward") -> Node:
        return self.add(Node(name=name, kind=Kind.COMPUTE, inputs=tuple(inputs), cost=cost, target=target,
                             phase=phase))

    # ----------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def __iter__(self) -> Iterator[Node]:
        return iter(self._nodes.values())

    def node(self, name: str) -> Node:
        return self._nodes[name]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._nodes)

    @property
    def recvs(self) -> tuple[str, ...]:
        return tuple(n for n, v in self._nodes.items() if v.kind is Kind.RECV)

    @property
    def computes(self) -> tuple[str, ...]:
        return tuple(n for n, v in self._nodes.items() if v.kind is Kind.COMPUTE)

    def succs(self, name: str) -> tuple[str, ...]:
        return tuple(self._succs[name])

    def edges(self) -> list[tuple[str, str]]:
        return [(i, n.name) for n in self._nodes.values() for i in n.inputs]

    def recv_bytes(self) -> int:
        return sum(self._nodes[r].size_bytes for r in self.recvs)

    def comm_deps(self) -> dict[str, frozenset[str]]:
        """``op.dep`` (§4.1): the recvs each node depends on, directly or transitively.

        A recv's own dep is itself, so ``M = sum(Time(r) for r in dep & R)`` (Alg. 1 line 3)
        gives a recv its own transfer time, as §4.1 defines. Computed once per DAG in one
        topological sweep (the paper's depth-first post-order visits the same sets)."""
        if self._deps is None:
            deps: dict[str, frozenset[str]] = {}
            for n in self._nodes.values():
                if n.kind is Kind.RECV:
                    deps[n.name] = frozenset((n.name,))
                else:
                    acc: set[str] = set()
                    for i in n.inputs:
                        acc |= deps[i]
                    deps[n.name] = frozenset(acc)
            self._deps = deps
        return self._deps

    def in_program_order(self) -> "Dag":
        """This DAG as eager PyTorch executes it: each compute op also depends on the compute
        op before it in program order (a control edge). A dataflow executor (the paper's
        TensorFlow) runs any op whose inputs are in; eager PyTorch runs the forward's ops one
        after the other, so an op whose parameters are in still waits for the ops written
        before it. Heuristics and the simulator on this DAG see that constraint."""
        out = Dag()
        previous: str | None = None
        for n in self._nodes.values():
            if n.kind is Kind.COMPUTE:
                if previous is not None and previous not in n.inputs:
                    n = _replace_inputs(n, n.inputs + (previous,))
                previous = n.name
            out.add(n)
        return out

    def as_run_by(self, executor: str) -> "Dag":
        """This DAG as ``executor`` (one of :data:`EXECUTORS`) runs it: eager adds the
        program-order edges (:meth:`in_program_order`), dataflow is the DAG itself."""
        if executor not in EXECUTORS:
            raise ValueError(f"unknown executor {executor!r}; choose one of {', '.join(EXECUTORS)}")
        return self.in_program_order() if executor == "eager" else self

    def summary(self) -> dict[str, int]:
        return {"nodes": len(self), "compute": len(self.computes), "recv": len(self.recvs),
                "edges": len(self.edges()), "recv_bytes": self.recv_bytes()}

    def __getstate__(self) -> dict[str, Any]:
        return {"nodes": list(self._nodes.values())}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()
        for n in state["nodes"]:
            self.add(n)

    def __repr__(self) -> str:
        s = self.summary()
        return f"Dag(nodes={s['nodes']}, compute={s['compute']}, recv={s['recv']}, edges={s['edges']})"


def _replace_inputs(node: Node, inputs: tuple[str, ...]) -> Node:
    return Node(name=node.name, kind=node.kind, inputs=inputs, cost=node.cost, size_bytes=node.size_bytes,
                param=node.param, target=node.target, phase=node.phase)


# --------------------------------------------------------------------------- torch models
@dataclass(kw_only=True)
class ModelDag:
    """A :class:`Dag` extracted from a torch model, with what is needed to time its ops.

    ``graph_module`` is the fx graph whose node names are the DAG's compute names;
    ``arg_builder(model, inputs)`` returns the positional arguments that graph's
    placeholders take (parameters first for the ATen graphs), so the tracer in
    :mod:`mlfabric.order.oracle` can run it node by node."""

    dag: Dag
    graph_module: fx.GraphModule
    mode: Literal["forward", "training"]
    tracer: Literal["symbolic_trace", "export", "make_fx"]
    params: tuple[str, ...]  # unique parameter FQNs, model.named_parameters() order
    arg_builder: Callable[[nn.Module, tuple[torch.Tensor, ...]], list[Any]] = field(repr=False)

    def args(self, model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> list[Any]:
        return self.arg_builder(model, inputs)


def _unique_params(model: nn.Module) -> tuple[list[str], dict[int, str]]:
    """Parameter FQNs (tied parameters once, first name wins) and id(param) -> FQN."""
    names: list[str] = []
    by_id: dict[int, str] = {}
    for name, p in model.named_parameters():  # remove_duplicate=True: a tied weight is pulled once
        names.append(name)
        by_id[id(p)] = name
    return names, by_id


def _add_recvs(dag: Dag, model: nn.Module, names: Iterable[str]) -> None:
    params = dict(model.named_parameters())
    for name in names:
        p = params[name]
        dag.add_recv(recv_name(name), size_bytes=p.numel() * p.element_size(), param=name)


def _target_str(node: fx.Node, gm: fx.GraphModule | None = None) -> str:
    if node.op == "call_module" and gm is not None:
        return type(gm.get_submodule(str(node.target))).__name__
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__name__", None) or str(t)


def forward_dag(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> ModelDag:
    """The forward pass's DAG (module granularity via symbolic_trace; torch.export if that fails)."""
    try:
        gm = fx.symbolic_trace(model)
    except Exception as exc:  # noqa: BLE001 - any trace failure means "fall back", the reason is kept
        try:
            return _forward_dag_export(model, inputs)
        except Exception as exc2:
            raise RuntimeError(f"forward_dag: torch.fx.symbolic_trace failed ({exc!r}) and torch.export "
                               f"failed too ({exc2!r}); make the model traceable or pass a traceable wrapper") from exc2
    return _forward_dag_fx(model, gm)


def _forward_dag_fx(model: nn.Module, gm: fx.GraphModule) -> ModelDag:
    names, by_id = _unique_params(model)
    dag = Dag()
    _add_recvs(dag, model, names)
    alias: dict[str, str] = {}  # fx node name -> DAG node it stands for (get_attr of a param -> its recv)
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.op == "get_attr":
            obj = _fetch_attr(gm, str(n.target))
            if isinstance(obj, nn.Parameter) and id(obj) in by_id:
                alias[n.name] = recv_name(by_id[id(obj)])
            continue  # a buffer or constant is local: no node, no dependency
        ins = [alias.get(a.name, a.name) for a in n.all_input_nodes]
        ins = [i for i in ins if i in dag]
        if n.op == "call_module":
            sub = gm.get_submodule(str(n.target))
            # symbolic_trace keeps torch.nn leaves whole: the op needs all of their parameters.
            ins += [recv_name(by_id[id(p)]) for p in sub.parameters() if id(p) in by_id]
        dag.add_compute(n.name, ins, target=_target_str(n, gm))

    def arg_builder(_model: nn.Module, inp: tuple[torch.Tensor, ...]) -> list[Any]:
        return list(inp)

    return ModelDag(dag=dag, graph_module=gm, mode="forward", tracer="symbolic_trace", params=tuple(names),
                    arg_builder=arg_builder)


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _forward_dag_export(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> ModelDag:
    from torch.export import export
    from torch.export.graph_signature import InputKind

    ep = export(model, inputs)
    gm = ep.graph_module
    names, by_id = _unique_params(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    canon = {fqn: by_id[id(p)] for fqn, p in params.items()}
    specs = list(ep.graph_signature.input_specs)
    dag = Dag()
    _add_recvs(dag, model, names)
    alias: dict[str, tuple[str, ...]] = {}
    for spec in specs:
        if spec.kind == InputKind.PARAMETER:
            alias[spec.arg.name] = (recv_name(canon[spec.target]),)
    _add_aten_nodes(dag, gm, alias, lambda _n: "forward")
    constants = dict(ep.constants)
    state = dict(ep.state_dict)

    def arg_builder(m: nn.Module, inp: tuple[torch.Tensor, ...]) -> list[Any]:
        mp = dict(m.named_parameters(remove_duplicate=False))
        mb = dict(m.named_buffers(remove_duplicate=False))
        user = iter(inp)
        out: list[Any] = []
        for spec in specs:
            if spec.kind == InputKind.PARAMETER:
                out.append(mp[spec.target])
            elif spec.kind == InputKind.BUFFER:
                out.append(mb.get(spec.target, state.get(spec.target)))
            elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
                out.append(constants[spec.target])
            else:
                out.append(next(user))
        return out

    return ModelDag(dag=dag, graph_module=gm, mode="forward", tracer="export", params=tuple(names),
                    arg_builder=arg_builder)


def _is_view(n: fx.Node) -> bool:
    """An ATen view/alias op (t, view, detach, expand, ...) or a tuple getitem: metadata, no work."""
    return n.target is operator.getitem or bool(getattr(n.target, "is_view", False))


def _add_aten_nodes(dag: Dag, gm: fx.GraphModule, alias: dict[str, tuple[str, ...]],
                    phase: Callable[[fx.Node], Phase]) -> None:
    """Add an ATen graph's ops to ``dag``; ``alias`` maps parameter placeholders to their recvs.

    View ops are folded into their users (a user depends on what the view reads): they do no
    work, and keeping them would hand TAO fake compute. ``t(weight)`` alone depends on one
    recv, so with it a recv's ``P`` becomes a few microseconds instead of 0, and eq. 5 then
    ranks a large FC weight first because "something" can run once it is in (seen on the
    VGG- and AlexNet-like training graphs before this rule)."""
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        ins: list[str] = []
        for a in n.all_input_nodes:
            ins.extend(alias.get(a.name, (a.name,)))
        ins = [i for i in dict.fromkeys(ins) if i in dag]
        if n.op == "call_function" and _is_view(n):
            alias[n.name] = tuple(ins)
            continue
        dag.add_compute(n.name, ins, target=_target_str(n), phase=phase(n))


def default_loss(out: Any) -> torch.Tensor:
    """A synthetic loss for synthetic inputs: mean of squares of every output tensor."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return sum(t.float().square().mean() for t in leaves)  # type: ignore[return-value]


def training_dag(model: nn.Module, inputs: tuple[torch.Tensor, ...],
                 loss_fn: Callable[[Any], torch.Tensor] = default_loss) -> ModelDag:
    """Forward + backward at ATen granularity: make_fx of ``grad(loss_fn(model(*inputs)), params)``."""
    from torch.func import functional_call
    from torch.fx.experimental.proxy_tensor import make_fx

    names, _ = _unique_params(model)
    n_params = len(names)

    def step(params: list[torch.Tensor], *xs: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        out = functional_call(model, dict(zip(names, params)), xs)
        loss = loss_fn(out)
        # The loss is returned too: its ancestors are the forward pass, everything else backward.
        return loss, torch.autograd.grad(loss, params, allow_unused=True)

    ps = [p.detach().requires_grad_(True) for p in dict(model.named_parameters()).values()]
    gm = make_fx(step)(ps, *inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    alias = {ph.name: (recv_name(names[i]),) for i, ph in enumerate(placeholders[:n_params])}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    loss_node = out_node.args[0][0]
    forward_set = _ancestors(loss_node)
    dag = Dag()
    _add_recvs(dag, model, names)
    _add_aten_nodes(dag, gm, alias, lambda n: "forward" if n in forward_set else "backward")

    def arg_builder(m: nn.Module, inp: tuple[torch.Tensor, ...]) -> list[Any]:
        mp = dict(m.named_parameters())
        return [mp[k].detach() for k in names] + list(inp)

    return ModelDag(dag=dag, graph_module=gm, mode="training", tracer="make_fx", params=tuple(names),
                    arg_builder=arg_builder)


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def dag_from_edges(recvs: Mapping[str, float], computes: Sequence[tuple[str, Sequence[str], float]]) -> Dag:
    """A hand-made DAG: ``recvs`` name -> cost, ``computes`` (name, inputs, cost) in topological order."""
    dag = Dag()
    for r, c in recvs.items():
        dag.add_recv(r, cost=c)
    for name, ins, c in computes:
        dag.add_compute(name, ins, cost=c)
    return dag

