"""Issue #38 check 2: a joiner receives a 100 MB state from 1 or 3 senders, on loopback or emulated.

    .venv/bin/python docs/bench/elastic-2026-11-28/transfer.py --mb 100 --senders 1 3 --json transfer.json
    sudo .venv/bin/python docs/bench/elastic-2026-11-28/transfer.py --mb 100 --senders 1 3 --emulate 1gbit \
        --json transfer-emu.json

For each sender count S, S members (processes) hold a state of MB megabytes (a StateHolder
of one uint8 buffer: model and optimizer bytes alike), run tiny steps until a joiner asks in,
then form the next epoch with it; the joiner's rate is the state's bytes over the time from
its epoch's connection to the checked state (``MembershipChange.synced - formed``: the
senders' packing, the striped copy and the CRC-32 checks); ``copy_rate_mb_s`` is the striped
copy's alone (``MembershipChange.copy_s``, the network part). S=1 is one TCP flow: the
baseline the issue compares with.

``--emulate RATE`` (root): every member on its own host of an emulated star of S+1 hosts
with NICs at RATE (the joiner on host S, which also serves the store: the root namespace is
not on the emulated fabric); each row adds one TCP flow's goodput from host 0 to the
joiner's host in the same cluster (``mlfabric.emu.goodput``, warm-up left out) and the
transfer's rate over it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class Blob:
    """A state of ``nbytes`` bytes (seeded), packed as itself."""

    def __init__(self, nbytes: int, fill: bool) -> None:
        self.committed = 1 if fill else 0
        self.data = (torch.arange(nbytes, dtype=torch.int64) % 251).to(torch.uint8) if fill else \
            torch.empty(nbytes, dtype=torch.uint8)

    def signature(self) -> str:
        return f"blob:{self.data.numel()}"

    def pack(self) -> tuple[dict[str, Any], torch.Tensor]:
        return {"committed": self.committed}, self.data

    def unpack(self, header: dict[str, Any], blob: torch.Tensor) -> None:
        self.data.copy_(blob)
        self.committed = int(header["committed"])


def member(port: int, member_id: int, senders: int, nbytes: int, out: "mp.Queue[Any]", host: str = "127.0.0.1") -> None:
    from mlfabric.runtime.elastic import ElasticCommunicator

    torch.set_num_threads(1)
    store = dist.TCPStore(store_host(), port, is_master=False, timeout=timedelta(seconds=60))
    joiner = member_id == senders
    holder = Blob(nbytes, fill=not joiner)
    ec = ElasticCommunicator(store, member_id, holder, initial=None if joiner else range(senders),
                             timeout=120, address=host)
    if joiner:
        change = ec.history[0]
        out.put({"bytes": change.transferred_bytes, "seconds": change.synced - change.formed,
                 "crc_ok": zlib.crc32(holder.data.numpy()) == zlib.crc32(Blob(nbytes, True).data.numpy()),
                 "sources": list(change.sources), "members": list(change.members),
                 "steps": {str(k): v for k, v in ec.membership.steps.items()}, "epoch": change.epoch,
                 "copy_s": change.copy_s})
    else:
        while True:
            flag = torch.tensor([1.0 if ec.rank == 0 and ec.joiners_waiting() else 0.0])
            assert ec.comm is not None
            ec.comm.allreduce(flag)
            if flag.item() > 0:
                ec.reconfigure("admitting the joiner", after_commit=True)  # the flag's allreduce completed here
                break
            time.sleep(0.01)
    ec.finish()
    ec.close()


def store_host() -> str:
    return os.environ.get("TRANSFER_STORE_HOST", "127.0.0.1")


class _FileQueue:
    """The joiner's result, handed back through a file (emulated members are other programs)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def put(self, item: Any) -> None:
        with open(self.path, "w") as f:
            json.dump(item, f)


def member_main(spec: str) -> None:
    """A member started by :func:`run` inside an emulated host."""
    a = json.loads(spec)
    member(a["port"], a["member"], a["senders"], a["nbytes"], _FileQueue(a["out"]), a["host"])  # type: ignore[arg-type]


def run(senders: int, nbytes: int, hosts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``hosts`` (emulated; this process runs in the joiner's host): per member its command
    prefix, environment and address."""
    store = dist.TCPStore(store_host(), 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    if hosts is not None:
        return _run_emulated_members(store, senders, nbytes, hosts)
    ctx = mp.get_context("spawn")
    out: "mp.Queue[Any]" = ctx.Queue()
    procs = [ctx.Process(target=member, args=(store.port, m, senders, nbytes, out)) for m in range(senders + 1)]
    from mlfabric.runtime.membership import MembershipStore

    for p in procs[:-1]:
        p.start()
    ms = MembershipStore(store)
    deadline = time.monotonic() + 300
    while ms.current_epoch() < 0 and time.monotonic() < deadline:  # the senders' job runs: then join it
        time.sleep(0.05)
    time.sleep(1.0)  # the members' first transfer (to all but the lowest) is over
    procs[-1].start()
    result = out.get(timeout=300)
    for p in procs:
        p.join(60)
    return {"senders": senders, "mb": nbytes / 1e6, **result, "rate_mb_s": result["bytes"] / result["seconds"] / 1e6,
            "copy_rate_mb_s": result["bytes"] / result["copy_s"] / 1e6}


def _run_emulated_members(store: Any, senders: int, nbytes: int, hosts: list[dict[str, Any]]) -> dict[str, Any]:
    import subprocess
    import sys
    import tempfile

    from mlfabric.runtime.membership import MembershipStore

    out = tempfile.mktemp(prefix="transfer-joiner-", suffix=".json")
    env_base = {**os.environ, "TRANSFER_STORE_HOST": store_host(), "OMP_NUM_THREADS": "1"}

    def start(m: int) -> subprocess.Popen:
        spec = json.dumps({"port": store.port, "member": m, "senders": senders, "nbytes": nbytes, "out": out,
                           "host": hosts[m]["address"]})
        return subprocess.Popen([*hosts[m]["prefix"], sys.executable, __file__, "member", spec],
                                env={**env_base, **hosts[m]["env"]})

    procs = [start(m) for m in range(senders)]
    ms = MembershipStore(store)
    deadline = time.monotonic() + 300
    while ms.current_epoch() < 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0 + nbytes / 50e6)  # the members' first transfer (to all but the lowest) is over
    procs.append(start(senders))
    for p in procs:
        p.wait(300)
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return {"senders": senders, "mb": nbytes / 1e6, **result, "rate_mb_s": result["bytes"] / result["seconds"] / 1e6,
            "copy_rate_mb_s": result["bytes"] / result["copy_s"] / 1e6}


def run_in_cluster(senders: int, nbytes: int, rate_bps: float, pace: bool = True) -> dict[str, Any]:
    """One transfer on a fresh emulated star of ``senders + 1`` hosts, beside one TCP flow's
    goodput. ``pace`` False: the members do not know the NIC rate, so the senders do not pace
    (the comparison for mlfabric/runtime/elastic.py's ``_pace_transfer``)."""
    from mlfabric.runtime.fair_share import NIC_RATE_ENV

    import subprocess
    import sys
    import tempfile

    from mlfabric.emu.cluster import Cluster, new_prefix, plan_cluster
    from mlfabric.emu.goodput import two_host_goodput_bps

    plan = plan_cluster(f"star:n={senders + 1}", rate_bps, prefix=new_prefix())
    prefixes = plan.command_prefixes()
    hosts = [{"prefix": prefixes[h], "env": {k: v for k, v in plan.rank_env(h).items() if pace or k != NIC_RATE_ENV},
              "address": plan.hosts[h].address} for h in range(senders + 1)]
    with tempfile.TemporaryDirectory(prefix="transfer-emu-") as tmp, Cluster.create(plan, temporary_dir=tmp):
        goodput = two_host_goodput_bps(plan, src=0, dst=senders)
        out = os.path.join(tmp, "row.json")
        proc = subprocess.run([*prefixes[senders], sys.executable, __file__, "coordinate",
                               json.dumps({"senders": senders, "nbytes": nbytes, "hosts": hosts, "out": out})],
                              env={**os.environ, "TRANSFER_STORE_HOST": plan.hosts[senders].address},
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"the emulated transfer failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        with open(out) as f:
            row = json.load(f)
    goodput_mb_s = goodput / 8 / 1e6
    return {**row, "cluster": plan.prefix, "rate_bps": rate_bps, "paced": pace, "one_flow_goodput_mb_s": goodput_mb_s,
            "of_one_flow": row["rate_mb_s"] / goodput_mb_s, "copy_of_one_flow": row["copy_rate_mb_s"] / goodput_mb_s}


def main() -> None:
    import sys

    if len(sys.argv) > 2 and sys.argv[1] in ("member", "coordinate"):
        if sys.argv[1] == "member":
            member_main(sys.argv[2])
        else:
            a = json.loads(sys.argv[2])
            with open(a["out"], "w") as f:
                json.dump(run(a["senders"], a["nbytes"], a["hosts"]), f)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--senders", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--emulate", default=None, metavar="RATE", help="root: on an emulated star at RATE, e.g. 1gbit")
    parser.add_argument("--no-pace", action="store_true", help="with --emulate: the senders do not pace")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.emulate:
        from mlfabric.units import parse_rate

        rate = parse_rate(args.emulate)
        rows = [run_in_cluster(s, int(args.mb * 1e6), rate, pace=not args.no_pace)
                for _ in range(args.repeat) for s in args.senders]
    else:
        rows = [run(s, int(args.mb * 1e6)) for _ in range(args.repeat) for s in args.senders]
    for row in rows:
        extra = (f"; one TCP flow {row['one_flow_goodput_mb_s']:.1f} MB/s, {row['of_one_flow']:.2f} of it "
                 f"(the copy alone: {row['copy_rate_mb_s']:.0f} MB/s, {row['copy_of_one_flow']:.2f})"
                 if "of_one_flow" in row else f" (the copy alone: {row['copy_rate_mb_s']:.0f} MB/s)")
        print(f"{row['senders']} sender(s): {row['mb']:.0f} MB in {row['seconds']:.3f} s = {row['rate_mb_s']:.0f} MB/s "
              f"(from {row['sources']}, CRC ok: {row['crc_ok']}){extra}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
