"""DAG extraction from torch models (torch.fx symbolic_trace, torch.export fallback, make_fx
forward + backward), the traced time oracle, and TicTac on the five bench models.

    .venv/bin/python -m pytest tests/unit/test_order_dag.py -q
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from mlfabric.order import (Kind, TimeOracle, dag_from_edges, forward_dag, makespan, measured_oracle, recv_name, tao,
                            tio, trace_compute, training_dag, transfer_times)
from mlfabric.order.models import MODELS, build, param_bytes, param_count

# (params, recvs, forward compute ops): the table in mlfabric/order/models.py.
EXPECTED = {
    "par32": (131_072, 32, 34),  # 32 Linear + stack + sum
    "seq32": (131_072, 32, 64),  # 32 x (Linear, tanh)
    "inception": (24_278, 32, 39),  # stem conv, relu, pool; 2 x 16 block ops; pool; avgpool, flatten, fc
    "vgg": (337_050, 16, 19),  # 6 conv + 6 relu + 3 pool + flatten + 2 linear + 1 relu
    "alexnet": (578_250, 16, 19),  # 5 conv + 7 relu + 3 pool + flatten + 3 linear
}


@pytest.fixture(scope="module")
def forwards():
    out = {}
    for name in MODELS:
        model, x = build(name)
        out[name] = (model, x, forward_dag(model, x))
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_forward_dag_of_each_model(forwards, name):
    model, x, md = forwards[name]
    params, recvs, computes = EXPECTED[name]
    d = md.dag
    assert md.tracer == "symbolic_trace" and md.mode == "forward"
    assert param_count(model) == params
    assert len(d.recvs) == recvs == len(list(model.parameters()))
    assert len(d.computes) == computes and len(d) == recvs + computes
    named = dict(model.named_parameters())
    for p, t in named.items():  # every parameter is exactly one recv with its size
        node = d.node(recv_name(p))
        assert node.kind is Kind.RECV and node.param == p and node.size_bytes == t.numel() * 4
        assert d.succs(node.name), f"{p} is pulled but no op uses it"
    assert d.recv_bytes() == param_bytes(model)
    last = d.computes[-1]
    assert d.comm_deps()[last] == set(d.recvs)  # the output needs every parameter


def test_forward_dag_structure(forwards):
    par = forwards["par32"][2].dag
    linears = [n for n in par.computes if par.node(n).target == "Linear"]
    assert len(linears) == 32
    for i, n in enumerate(linears):
        assert par.node(n).inputs == (recv_name(f"branches.{i}.weight"),)
    stack = next(n for n in par.computes if par.node(n).target == "stack")
    assert set(par.node(stack).inputs) == set(linears)

    seq = forwards["seq32"][2].dag
    lin = [n for n in seq.computes if seq.node(n).target == "Linear"]
    tanh = [n for n in seq.computes if seq.node(n).target == "tanh"]
    assert len(lin) == len(tanh) == 32
    assert seq.node(lin[0]).inputs == (recv_name("layers.0.weight"),)
    for i in range(1, 32):
        assert set(seq.node(lin[i]).inputs) == {tanh[i - 1], recv_name(f"layers.{i}.weight")}

    inc = forwards["inception"][2].dag
    cats = [n for n in inc.computes if inc.node(n).target == "cat"]
    assert len(cats) == 2 and all(len(inc.node(c).inputs) == 4 for c in cats)  # four branches join
    convs = [n for n in inc.computes if inc.node(n).target == "Conv2d"]
    assert len(convs) == 15
    assert inc.node("stem").inputs == (recv_name("stem.weight"), recv_name("stem.bias"))  # x is local: no node
    assert all(len(inc.node(c).inputs) == 3 for c in convs[1:])  # data, weight, bias


def test_tio_on_chains_follows_the_layers(forwards):
    for name in ("vgg", "alexnet"):
        model, _, md = forwards[name]
        layers = [m for m in model if list(m.parameters())]
        names = dict((id(p), n) for n, p in model.named_parameters())
        expected = [tuple(recv_name(names[id(p)]) for p in m.parameters()) for m in layers]
        assert tio(md.dag).classes() == expected  # weight and bias of one layer share a priority


def _symmetric(md, linear: float, other: float) -> TimeOracle:
    """Every transfer 1 (all recvs have equal bytes), Linear ops ``linear``, other ops ``other``."""
    d = md.dag
    size = d.node(d.recvs[0]).size_bytes
    compute = {n: (linear if d.node(n).target == "Linear" else other) for n in d.computes}
    return TimeOracle.combine(d, compute, transfer_times(d, rate_bytes_per_s=size))


def test_par32_model_all_orders_equal(forwards):
    md = forwards["par32"][2]
    o = _symmetric(md, 1.0, 1.0)
    g = torch.Generator().manual_seed(0)
    orders = [list(md.dag.recvs), list(reversed(md.dag.recvs)), tao(md.dag, o).order(), tio(md.dag).order()]
    orders += [[md.dag.recvs[i] for i in torch.randperm(32, generator=g).tolist()] for _ in range(10)]
    assert {makespan(md.dag, o, order) for order in orders} == {35.0}  # 32 transfers, last branch, stack, sum


def test_seq32_model_one_best_order_found(forwards):
    md = forwards["seq32"][2]
    o = _symmetric(md, 1.0, 0.0)  # a layer's compute equals a transfer: every delay shows
    best = tuple(recv_name(f"layers.{i}.weight") for i in range(32))
    assert makespan(md.dag, o, best) == 33.0
    assert tao(md.dag, o).order() == best
    assert tio(md.dag, mplus="single").order() == best
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        perm = [best[i] for i in torch.randperm(32, generator=g).tolist()]
        assert makespan(md.dag, o, perm) > 33.0


def test_export_fallback_when_symbolic_trace_fails():
    class Loop(nn.Module):  # range(x.shape[0]) on a Proxy: symbolic_trace raises, torch.export specialises
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(x.shape[0]):
                x = torch.relu(self.body(x))
            return self.head(x)

    torch.manual_seed(0)
    model, x = Loop(), torch.randn(3, 4)
    md = forward_dag(model, (x,))
    assert md.tracer == "export"
    d = md.dag
    assert d.recvs == tuple(recv_name(p) for p in ("body.weight", "body.bias", "head.weight", "head.bias"))
    linears = [n for n in d.computes if d.node(n).target.startswith("linear")]
    assert len(linears) == 4
    for n in linears[:3]:
        assert {recv_name("body.weight"), recv_name("body.bias")} <= set(d.node(n).inputs)
    assert {recv_name("head.weight"), recv_name("head.bias")} <= set(d.node(linears[3]).inputs)
    times = trace_compute(md, model, (x,), iterations=2, warmup=1).minimum()
    assert set(times) == set(d.computes) and all(t > 0 for t in times.values())


def test_training_dag_forward_and_backward():
    model, x = build("vgg")
    md = training_dag(model, x)
    fw = forward_dag(model, x)
    d = md.dag
    assert md.tracer == "make_fx" and md.mode == "training"
    assert d.recvs == fw.dag.recvs and d.recv_bytes() == param_bytes(model)
    phases = {d.node(n).phase for n in d.computes}
    assert phases == {"forward", "backward"}
    deps = d.comm_deps()
    for n in d.computes:  # the backward pass starts from the loss, which needs every parameter
        if d.node(n).phase == "backward":
            assert deps[n] == set(d.recvs)
    convs = [n for n in d.computes if d.node(n).target == "convolution.default"]
    conv_bw = [n for n in d.computes if d.node(n).target == "convolution_backward.default"]
    assert len(convs) == 6 and len(conv_bw) == 6
    for r in d.recvs:  # every pull feeds a forward op directly (views are folded into their users)
        assert any(d.node(s).phase == "forward" for s in d.succs(r))
    assert not [n for n in d.computes if d.node(n).target in ("t.default", "view.default", "detach.default")]
    assert pickle.loads(pickle.dumps(d)).edges() == d.edges()


def test_measured_oracle(forwards):
    model, x, md = forwards["vgg"]
    tr = trace_compute(md, model, x, iterations=3, warmup=1)
    assert len(tr.iterations) == 3
    mins = tr.minimum()
    assert set(mins) == set(md.dag.computes)
    for it in tr.iterations:  # §5: the oracle keeps each op's minimum over the iterations
        for n, t in it.durations().items():
            assert 0 < mins[n] <= t
    o = measured_oracle(md, model, x, rate_bytes_per_s=1e8, latency_s=1e-4, iterations=2)
    o.covers(md.dag)
    r = recv_name("0.weight")
    assert o(r) == pytest.approx(1e-4 + 3 * 16 * 9 * 4 / 1e8)
    gen = TimeOracle.general(md.dag)
    assert {gen(n) for n in md.dag.recvs} == {1.0} and {gen(n) for n in md.dag.computes} == {0.0}
    with pytest.raises(ValueError, match="rate"):
        transfer_times(md.dag, 0.0)


def test_worked_example_command(capsys, tmp_path):
    from mlfabric.order.__main__ import main

    out = tmp_path / "tao.json"
    assert main(["--model", "seq32", "--iterations", "1", "--random", "3", "--chrome", str(out)]) == 0
    text = capsys.readouterr().out
    assert "S=1.000" in text  # --rate balanced: sum of transfers = sum of compute
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()[:1] in (["tao"], ["random"])}
    assert set(rows) == {"tao", "random"} and float(rows["tao"][2]) >= float(rows["random"][2])
    assert '"traceEvents"' in out.read_text()


def test_in_program_order_chains_compute_ops_as_eager_pytorch_runs_them():
    """Two branches, a (needs ra) then b (needs rb), joined by c. Dataflow: with rb first, b
    runs while ra is still on the wire. Eager: b waits for a, so ra first is the best order,
    and TIO/TAO on the eager DAG give it."""
    d = dag_from_edges({"ra": 2.0, "rb": 2.0}, [("a", ["ra"], 2.0), ("b", ["rb"], 2.0), ("c", ["a", "b"], 1.0)])
    eager = d.in_program_order()
    assert eager.node("b").inputs == ("rb", "a")
    assert eager.node("c").inputs == ("a", "b")  # (b is an input of c already)
    assert d.as_run_by("dataflow") is d and d.as_run_by("eager").node("b").inputs == ("rb", "a")
    with pytest.raises(ValueError, match="unknown executor 'tensorflow'"):
        d.as_run_by("tensorflow")
    assert eager.node("a").inputs == ("ra",) and d.node("b").inputs == ("rb",)  # the original is untouched
    o, oe = TimeOracle.from_costs(d), TimeOracle.from_costs(eager)
    assert makespan(d, o, ["rb", "ra"]) == makespan(d, o, ["ra", "rb"]) == 7.0
    assert makespan(eager, oe, ["ra", "rb"]) == 7.0 and makespan(eager, oe, ["rb", "ra"]) == 9.0
    assert tio(eager).order() == ("ra", "rb") and tao(eager, oe).order() == ("ra", "rb")


def test_tio_on_the_eager_dag_is_the_order_of_first_use(forwards):
    """The branchy model: on its eager DAG, TIO and TAO send the parameters in the order the
    forward first uses them (the best order for an in-order executor on one channel)."""
    model, x, md = forwards["inception"]
    eager = md.dag.in_program_order()
    first_use = tuple(dict.fromkeys(i for n in eager.computes for i in eager.node(n).inputs if i in eager.recvs))
    o = _symmetric(md, 1.0, 1.0)
    assert tio(eager).order() == first_use
    assert tao(eager, TimeOracle.combine(eager, {n: o(n) for n in eager.computes},
                                         {r: o(r) for r in eager.recvs})).order() == first_use
    assert tio(md.dag).order() != first_use  # the dataflow DAG lets TIO send a later branch's first


def test_parameter_priorities_keys_tio_and_tao_by_parameter_name(forwards):
    """The one call of a training script: eager TIO is the order of first use, keyed by the
    parameter names init_model takes; TAO (rate given) agrees on the eager DAG; the
    dataflow executor gives the paper's order, which differs on the branchy model."""
    from mlfabric.order import parameter_priorities

    model, x, md = forwards["inception"]
    names = [k for k, _ in model.named_parameters()]
    eager = md.dag.in_program_order()
    first_use = [eager.node(r).param
                 for r in dict.fromkeys(i for n in eager.computes for i in eager.node(n).inputs if i in eager.recvs)]
    prio = parameter_priorities(model, x)
    assert sorted(prio) == sorted(names)
    assert sorted(prio, key=lambda k: (prio[k], first_use.index(k))) == first_use
    tao_prio = parameter_priorities(model, x, heuristic="tao", rate_bytes_per_s=1e7, iterations=2)
    assert sorted(tao_prio, key=tao_prio.__getitem__) == first_use
    dataflow = parameter_priorities(model, x, executor="dataflow")
    assert sorted(dataflow, key=lambda k: (dataflow[k], first_use.index(k))) != first_use


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"heuristic": "johnson"}, "unknown heuristic 'johnson'"),
    ({"executor": "tensorflow"}, "unknown executor 'tensorflow'"),
    ({"heuristic": "tao"}, "TAO needs rate_bytes_per_s > 0"),
    ({"heuristic": "tao", "rate_bytes_per_s": -1.0}, "TAO needs rate_bytes_per_s > 0"),
])
def test_parameter_priorities_refuses_bad_options(forwards, kwargs, message):
    from mlfabric.order import parameter_priorities

    model, x, _ = forwards["seq32"]
    with pytest.raises(ValueError, match=message):
        parameter_priorities(model, x, **kwargs)


def test_by_parameter_needs_recvs_that_name_their_parameter():
    d = dag_from_edges({"ra": 1.0}, [("a", ["ra"], 1.0)])
    with pytest.raises(ValueError, match="recv 'ra' names no parameter"):
        tio(d).by_parameter(d)
