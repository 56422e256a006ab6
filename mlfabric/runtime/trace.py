"""Timelines of every collective and transfer, per rank, as Chrome / Perfetto trace JSON.

    MLFABRIC_TRACE=/tmp/trace torchrun --nproc-per-node 4 examples/allreduce.py
    mlfabric trace merge /tmp/trace        # -> /tmp/trace/merged.json: open in ui.perfetto.dev

With ``MLFABRIC_TRACE=DIR`` (or ``Communicator(trace=DIR)``) each communicator records, in
memory, one event per collective (its description, algorithm, sequence number, bytes and
outcome) and one per transfer (a send from when it was handed to the transport until the
transport let go of the payload; a receive from when it was posted until the message
landed), with peer, channel and bytes. The file ``DIR/rank<R>-<pid>-<n>.json`` is written when
the communicator closes (at exit for one that was not closed). Each rank is a process of the
timeline, each (direction, peer, channel) a lane. Timestamps are wall-clock microseconds, so
ranks on one machine (or NTP-synchronised machines) line up when merged.

Nothing is recorded, and nothing costs, when tracing is off.

Exercise it with ``python -m pytest tests/unit/test_trace.py``.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from pathlib import Path

TRACE_ENV = "MLFABRIC_TRACE"
# Beyond this many events a rank keeps counting but stops recording (the file says how
# many were dropped): a day-long job must not grow without bound.
MAX_EVENTS = 2_000_000
# Marks a file as an mlfabric rank trace (``merge`` ignores other JSON in the directory).
FORMAT = "mlfabric-trace/1"
MERGED_NAME = "merged.json"

_COLLECTIVE_LANE = 0
_files_created = itertools.count()


class Tracer:
    """The timeline of one communicator on one rank; see the module docstring."""

    def __init__(self, directory: str | os.PathLike[str], rank: int, world_size: int, *,
                 transport: str = "") -> None:
        self.directory = Path(directory)
        self.rank = rank
        self.world_size = world_size
        self.transport = transport
        self.path = self.directory / f"rank{rank}-{os.getpid()}-{next(_files_created)}.json"
        # monotonic seconds -> wall-clock microseconds, fixed once so intervals stay exact.
        self._offset_us = time.time() * 1e6 - time.monotonic() * 1e6
        self._events: list[dict[str, object]] = []
        self._lanes: dict[tuple[str, int, str], int] = {}
        self._lock = threading.Lock()
        self.dropped = 0
        self.closed = False

    def _us(self, t: float) -> float:
        return round(t * 1e6 + self._offset_us, 3)

    def _add(self, event: dict[str, object]) -> None:
        with self._lock:
            if len(self._events) >= MAX_EVENTS:
                self.dropped += 1
            else:
                self._events.append(event)

    def collective(self, *, seq: int, description: str, algorithm: str, nbytes: int,
                   start: float, end: float, outcome: str) -> None:
        """One collective, ``start``/``end`` in ``time.monotonic()`` seconds."""
        self._add({"name": description, "cat": "collective", "ph": "X", "ts": self._us(start),
                   "dur": round((end - start) * 1e6, 3), "pid": self.rank, "tid": _COLLECTIVE_LANE,
                   "args": {"seq": seq, "algorithm": algorithm, "bytes": nbytes, "outcome": outcome}})

    def transfer(self, *, direction: str, peer: int, channel: str, nbytes: int, start: float,
                 end: float, seq: int, op: int) -> None:
        """One send or receive (``direction``) of collective ``seq``'s op ``op``."""
        key = (direction, peer, channel)
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = len(self._lanes) + 1
        arrow = "->" if direction == "send" else "<-"
        self._add({"name": f"{direction} {arrow} {peer}", "cat": "transfer", "ph": "X",
                   "ts": self._us(start), "dur": round((end - start) * 1e6, 3), "pid": self.rank,
                   "tid": lane, "args": {"peer": peer, "channel": channel, "bytes": nbytes,
                                         "seq": seq, "op": op}})

    def document(self) -> dict[str, object]:
        """The trace as Chrome's JSON object format, with lane names."""
        with self._lock:
            events = list(self._events)
            lanes = dict(self._lanes)
        meta: list[dict[str, object]] = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "args": {"sort_index": self.rank}},
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": _COLLECTIVE_LANE,
             "args": {"name": "collectives"}},
        ]
        for (direction, peer, channel), lane in sorted(lanes.items(), key=lambda item: item[1]):
            meta.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": lane,
                         "args": {"name": f"{direction} {'to' if direction == 'send' else 'from'} "
                                          f"rank {peer}, channel {channel}"}})
        return {"traceEvents": meta + events, "displayTimeUnit": "ms",
                "otherData": {"format": FORMAT, "rank": self.rank, "world_size": self.world_size,
                              "transport": self.transport, "dropped_events": self.dropped}}

    def close(self) -> Path:
        """Write the file (once; atomically, so a reader never sees half of it)."""
        if not self.closed:
            self.closed = True
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_suffix(".json.partial")
            partial.write_text(json.dumps(self.document()))
            partial.replace(self.path)
        return self.path


def tracer_from(trace: str | os.PathLike[str] | None, rank: int, world_size: int, *,
                transport: str = "") -> Tracer | None:
    """A tracer writing to ``trace``, else to ``MLFABRIC_TRACE``; None when neither is set."""
    directory = trace if trace is not None else (os.environ.get(TRACE_ENV) or None)
    if directory is None:
        return None
    return Tracer(directory, rank, world_size, transport=transport)


def merge(directory: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> tuple[Path, int]:
    """Merge the rank files in ``directory`` into one trace (default ``DIR/merged.json``);
    returns its path and how many rank files went in. Two communicators of one rank (two
    files) keep their lanes apart."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no trace directory {directory} (set {TRACE_ENV}={directory} when running)")
    out_path = Path(out) if out is not None else directory / MERGED_NAME
    files = []
    for path in sorted(directory.glob("*.json")):
        if path.resolve() == out_path.resolve():
            continue
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path} is not a readable trace ({exc}): was its rank killed while writing?") from exc
        if isinstance(document, dict) and document.get("otherData", {}).get("format") == FORMAT:
            files.append(document)
    if not files:
        raise FileNotFoundError(f"no mlfabric rank traces in {directory}: did the job run with "
                                f"{TRACE_ENV}={directory} and close its communicators?")
    files.sort(key=lambda d: d["otherData"]["rank"])
    merged: list[dict[str, object]] = []
    seen_per_rank: dict[int, int] = {}
    dropped = 0
    for document in files:
        rank = document["otherData"]["rank"]
        # The n-th file of a rank shifts its lanes by n * 1000: lanes of two communicators differ.
        shift = 1000 * seen_per_rank.get(rank, 0)
        seen_per_rank[rank] = seen_per_rank.get(rank, 0) + 1
        dropped += document["otherData"].get("dropped_events", 0)
        for event in document["traceEvents"]:
            if "tid" in event and shift:
                event = {**event, "tid": event["tid"] + shift}
            if event.get("ph") == "M" and event["name"] in ("process_name", "process_sort_index") and shift:
                continue  # named once per rank
            merged.append(event)
    merged.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0)))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"traceEvents": merged, "displayTimeUnit": "ms",
                                    "otherData": {"format": FORMAT, "ranks": sorted(seen_per_rank),
                                                  "files": len(files), "dropped_events": dropped}}))
    return out_path, len(files)
