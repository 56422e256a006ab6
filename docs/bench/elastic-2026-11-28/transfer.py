"""Issue #38 check 2 (loopback part): a joiner receives a 100 MB state from 1 or 3 senders.

    .venv/bin/python docs/bench/elastic-2026-11-28/transfer.py --mb 100 --senders 1 3 --json transfer.json

For each sender count S, S members (processes) hold a state of MB megabytes (a StateHolder
of one uint8 buffer: model and optimizer bytes alike), run tiny steps until a joiner asks in,
then form the next epoch with it; the joiner's rate is the state's bytes over the time from
its epoch's connection to the checked state (``MembershipChange.synced - formed``: the
senders' packing, the striped copy and the CRC-32 checks). S=1 is one TCP flow: the
baseline the issue compares with.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
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


def member(port: int, member_id: int, senders: int, nbytes: int, out: "mp.Queue[Any]") -> None:
    from mlfabric.runtime.elastic import ElasticCommunicator

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    joiner = member_id == senders
    holder = Blob(nbytes, fill=not joiner)
    ec = ElasticCommunicator(store, member_id, holder, initial=None if joiner else range(senders),
                             timeout=120)
    if joiner:
        change = ec.history[0]
        out.put({"bytes": change.transferred_bytes, "seconds": change.synced - change.formed,
                 "crc_ok": zlib.crc32(holder.data.numpy()) == zlib.crc32(Blob(nbytes, True).data.numpy()),
                 "sources": list(change.sources)})
    else:
        while True:
            flag = torch.tensor([1.0 if ec.rank == 0 and ec.joiners_waiting() else 0.0])
            assert ec.comm is not None
            ec.comm.allreduce(flag)
            if flag.item() > 0:
                ec.reconfigure("admitting the joiner")
                break
            time.sleep(0.01)
    ec.finish()
    ec.close()


def run(senders: int, nbytes: int) -> dict[str, Any]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
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
    return {"senders": senders, "mb": nbytes / 1e6, **result, "rate_mb_s": result["bytes"] / result["seconds"] / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--senders", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = [run(s, int(args.mb * 1e6)) for _ in range(args.repeat) for s in args.senders]
    for row in rows:
        print(f"{row['senders']} sender(s): {row['mb']:.0f} MB in {row['seconds']:.3f} s = {row['rate_mb_s']:.0f} MB/s "
              f"(from {row['sources']}, CRC ok: {row['crc_ok']})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
