"""The flow-level simulator from Python: the runtime's own schedules on large topologies.

    python examples/simulate.py

Three questions a network-aware training setup asks, each answered in well under a minute on
one core:

1. BML vs ring on 16 servers: BML on BCube(4,2) (two NICs per server) against the ring on a
   non-blocking fat-tree of the same 16 servers; BML §3.2 predicts 1/k = half the ring's time.
2. A parameter server on an oversubscribed fat-tree: MLNET's aggregation trees (RACK: one
   aggregator per rack) against direct pushes and pulls (BASELINE).
3. Stragglers: the same ring when one rank in ten computes 2x slower (MLfabric's C1 model).

Every figure is a simulated time from ``mlfabric.sim``; the same calls take any topology spec
(``star:n=..``, ``racks:r=..,h=..,oversub=..``, ``fat-tree:k=..,oversub=..``,
``bcube:n=..,k=..``, ``edges:FILE``). See docs/simulator.md.
"""

from __future__ import annotations

from mlfabric.sim import ComputeModel, EngineConfig, PSConfig, simulate_collective, simulate_ps, straggler_preset


def main() -> None:
    size = 100e6  # a 100 MB gradient
    rate = "10Gbps"

    bml = simulate_collective("bcube", "bcube:n=4,k=2", rate, size_bytes=size)
    ring = simulate_collective("ring", "fat-tree:k=4", rate, size_bytes=size, config=EngineConfig(routing="spray"))
    print(f"1. 100 MB allreduce, 16 servers at {rate}: BML on BCube(4,2) {bml.time_s * 1e3:.1f} ms, "
          f"ring on fat-tree(4) {ring.time_s * 1e3:.1f} ms (ring / BML = {ring.time_s / bml.time_s:.2f}, theory 2)")

    times = {}
    for strategy in ("baseline", "rack"):
        ps = PSConfig(workers=48, servers=8, model_bytes=size, strategy=strategy)
        times[strategy] = simulate_ps("fat-tree:k=8,oversub=4", rate, ps).time_s
    print(f"2. PS iteration, 48 workers x 8 servers on fat-tree(8) with 1:4 ToR uplinks: BASELINE "
          f"{times['baseline']:.3f} s, RACK {times['rack']:.3f} s ({1 - times['rack'] / times['baseline']:.0%} less)")

    compute = ComputeModel(compute_s=0.05, straggler=straggler_preset("C1"))
    slow = [simulate_collective("ring", "fat-tree:k=4", rate, size_bytes=size, compute=compute,
                                config=EngineConfig(routing="spray", seed=seed)).time_s for seed in range(5)]
    print(f"3. 50 ms of compute then the ring, C1 stragglers (10% of ranks 2x slower), 5 seeds: "
          f"{', '.join(f'{t * 1e3:.1f}' for t in slow)} ms (no stragglers: {ring.time_s * 1e3 + 50:.1f} ms)")


if __name__ == "__main__":
    main()
