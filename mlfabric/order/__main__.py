"""TicTac's worked example on one bench model: DAG, traced oracle, TAO/TIO vs random orders, E and S.

    .venv/bin/python -m mlfabric.order --model inception --mode forward --rate balanced --chrome /tmp/tao.json

Simulated, not measured on a network: the compute times are traced on this CPU (minimum over
``--iterations``), the transfer times are bytes / rate, and each order's makespan comes from
:func:`mlfabric.order.metrics.simulate`. ``--rate balanced`` picks the rate at which the
transfers take as long as the compute (S = 1, where ordering matters most; the paper picks
batch sizes with S > 0.9 for the same reason). "random" stands for no enforced order: the
mean, min and max over ``--random`` seeded shuffles. ``--dag eager`` adds the program-order
edges of an eager PyTorch worker (:meth:`mlfabric.order.dag.Dag.in_program_order`; the
default is the paper's dataflow executor).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

from mlfabric.order.dag import EXECUTORS, forward_dag, training_dag
from mlfabric.order.heuristics import tao, tio
from mlfabric.order.metrics import bounds, evaluate, speedup
from mlfabric.order.models import MODELS, build
from mlfabric.order.oracle import TimeOracle, trace_compute, transfer_times
from mlfabric.order.trace import write_chrome


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlfabric.order", description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="inception")
    ap.add_argument("--mode", choices=("forward", "training"), default="forward")
    ap.add_argument("--rate", default="balanced", help="transfer rate in Mbit/s, or 'balanced' (sum transfer = sum compute)")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--random", type=int, default=20, help="number of random orders (the no-ordering baseline)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dag", choices=EXECUTORS, default="dataflow",
                    help="dataflow: any op whose inputs are in may run (the paper's); eager: ops in program order")
    ap.add_argument("--chrome", default="", help="write the TAO schedule as a Chrome/Perfetto trace here")
    a = ap.parse_args(argv)

    model, x = build(a.model, seed=a.seed)
    md = forward_dag(model, x) if a.mode == "forward" else training_dag(model, x)
    d = md.dag.as_run_by(a.dag)
    compute = trace_compute(md, model, x, iterations=a.iterations).minimum()
    total_c = sum(compute.values())
    rate = d.recv_bytes() / total_c if a.rate == "balanced" else float(a.rate) * 1e6 / 8
    oracle = TimeOracle.combine(d, compute, transfer_times(d, rate))
    b = bounds(d, oracle)
    s = d.summary()
    print(f"model={a.model} mode={a.mode} dag={a.dag} tracer={md.tracer} nodes={s['nodes']} compute={s['compute']} "
          f"recv={s['recv']} recv_bytes={s['recv_bytes']} rate={rate * 8 / 1e6:.1f} Mbit/s")
    print(f"bounds: lower={b.lower * 1e3:.3f} ms upper={b.upper * 1e3:.3f} ms  S={speedup(b):.3f}")
    rows = []
    for name, pr in (("tao", tao(d, oracle)), ("tio", tio(d)), ("tio/single", tio(d, mplus="single"))):
        ev = evaluate(d, oracle, pr)
        rows.append((name, ev.makespan, ev.efficiency))
    rows.append(("dag order", *(lambda e: (e.makespan, e.efficiency))(evaluate(d, oracle, d.recvs))))
    rng = random.Random(a.seed)
    rand = []
    for _ in range(a.random):
        order = list(d.recvs)
        rng.shuffle(order)
        rand.append(evaluate(d, oracle, order))
    print(f"{'order':<12} {'makespan ms':>12} {'E':>7}")
    for name, t, e in rows:
        print(f"{name:<12} {t * 1e3:>12.3f} {e:>7.3f}")
    if rand:
        es = [r.efficiency for r in rand]
        print(f"{'random':<12} {statistics.mean(r.makespan for r in rand) * 1e3:>12.3f} {statistics.mean(es):>7.3f}"
              f"   (E min {min(es):.3f}, max {max(es):.3f}, n={len(es)})")
    print("first 6 by TAO:", ", ".join(r.removeprefix("recv:") for r in tao(d, oracle).order()[:6]))
    print("first 6 TIO classes:", " | ".join(",".join(r.removeprefix("recv:") for r in c) for c in tio(d).classes()[:6]), "...")
    if a.chrome:
        from mlfabric.order.metrics import simulate
        p = write_chrome(simulate(d, oracle, tao(d, oracle)), a.chrome, process=f"{a.model} {a.mode} TAO")
        print(f"chrome trace: {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
