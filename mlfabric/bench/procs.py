"""Launch N local ranks the way torchrun does and collect what each one returns.

    .venv/bin/python -m pytest tests/local/test_cli.py -q -k procs

``run_ranks(fn, world_size=4)`` starts ``world_size`` fresh Python processes with the
torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, OMP_NUM_THREADS=1), runs ``fn(*args, **kwargs)`` in each and returns the
per-rank return values, ordered by rank. ``fn`` is either a picklable callable (a function
defined at module level) or a ``"package.module:function"`` string; ``run_module`` runs a
module as ``python -m`` would instead. A rank can send progress to the parent while it runs
with :func:`report`; the parent receives it, in its main thread, through ``on_report``.

Failures are loud and attributed: if a rank raises, the others get ``grace_s`` seconds to
finish (they usually fail too, waiting for the dead peer) and are then killed, and
:class:`RankFailedError` names the first rank that failed and carries its traceback. A job
that runs past ``timeout_s`` is killed and raises :class:`RankTimeoutError` naming the
ranks still running.

Each rank is a plain subprocess (not ``multiprocessing``) so that a launcher can wrap it in
a command prefix per rank (``ip netns exec ns3`` for the emulator) and give it its own
environment. Parent and rank talk through a pipe: the parent writes the pickled job on the
rank's stdin, the rank writes length-prefixed pickled messages (reports, then its result
or its error) to an inherited file descriptor.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import queue
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

__all__ = [
    "LaunchConfig", "RankEnv", "RankFailedError", "RankFailure", "RankTimeoutError", "check_choices",
    "check_distinct", "free_port", "rank_env", "report", "run_module", "run_ranks", "stop_processes",
]


def check_distinct(values: Sequence[str], what: str) -> None:
    """A benchmark's or job's list option is non-empty and has no repeats (ValueError naming ``what``)."""
    if not values or len(set(values)) != len(values):
        raise ValueError(f"{what} must be distinct and non-empty, got {values}")


def check_choices(values: Sequence[str], allowed: Sequence[str], what: str, item: str) -> None:
    """A benchmark's or job's list option: non-empty, no repeats, each one of ``allowed``
    (ValueError naming ``what``, the list, or ``item``, one entry)."""
    check_distinct(values, what)
    for value in values:
        if value not in allowed:
            raise ValueError(f"unknown {item} {value!r}; choose from {', '.join(allowed)}")

REPORT_FD_ENV = "MLFABRIC_PROCS_FD"
PARENT_PID_ENV = "MLFABRIC_PROCS_PARENT"
PREFIXED_ENV = "MLFABRIC_PROCS_PREFIXED"  # a command prefix may leave a process between us
_HEADER = struct.Struct("<Q")


class RankFailedError(RuntimeError):
    """A rank raised or died. ``rank`` is the first rank that failed; ``traceback`` its
    traceback text (or the tail of its stderr when it died without one); ``others`` the
    ranks that failed after it (usually because it died)."""

    def __init__(self, message: str, *, rank: int, exc_type: str, traceback: str,
                 others: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.traceback = traceback
        self.others = tuple(others)


class RankTimeoutError(TimeoutError):
    """The job ran past its timeout; ``pending`` are the ranks that had not finished."""

    def __init__(self, message: str, *, pending: Sequence[int]) -> None:
        super().__init__(message)
        self.pending = tuple(pending)


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How to start the ranks.

    ``env`` is added to every rank's environment, ``rank_env[r]`` to rank r's only.
    ``command_prefix[r]`` is put in front of rank r's command (e.g. ``("ip", "netns",
    "exec", "ns3")``). ``capture_output`` sends each rank's stdout/stderr to a log file
    (its tail goes into errors) instead of the parent's terminal; ``log_dir`` keeps those
    files. ``master_port=None`` picks a free port.
    """

    world_size: int
    timeout_s: float = 300.0
    grace_s: float = 5.0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    omp_num_threads: int = 1
    env: Mapping[str, str] = field(default_factory=dict)
    rank_env: Sequence[Mapping[str, str]] | None = None
    command_prefix: Sequence[Sequence[str]] | None = None
    capture_output: bool = False
    log_dir: str | None = None
    python: str = sys.executable

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        if self.timeout_s <= 0 or self.grace_s < 0:
            raise ValueError(f"timeout_s must be positive and grace_s non-negative, got "
                             f"{self.timeout_s} and {self.grace_s}")
        for name in ("rank_env", "command_prefix"):
            value = getattr(self, name)
            if value is not None and len(value) != self.world_size:
                raise ValueError(f"{name} has {len(value)} entries for world_size {self.world_size}")


@dataclass(frozen=True, kw_only=True)
class RankEnv:
    """This process's place in the job, as the torchrun variables describe it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def rank_env() -> RankEnv:
    """Read RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (inside a rank)."""
    try:
        return RankEnv(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                       local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
                       master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                       master_port=int(os.environ["MASTER_PORT"]))
    except KeyError as exc:
        raise RuntimeError(f"{exc.args[0]} is not set: rank_env() only works inside a rank "
                           "started by mlfabric.bench.procs or torchrun") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------- inside a rank

_report_file: io.BufferedWriter | None = None
_report_lock = threading.Lock()


def _send(kind: str, payload: Any) -> None:
    global _report_file
    if _report_file is None:
        fd = os.environ.get(REPORT_FD_ENV)
        if fd is None:
            return
        _report_file = os.fdopen(int(fd), "wb", buffering=0)
    data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
    frame = memoryview(_HEADER.pack(len(data)) + data)
    with _report_lock:
        try:
            # An unbuffered write is one write(2): a signal can cut it short on a pipe (a large
            # result then arrived truncated and the rank looked dead): write the rest too.
            while frame:
                frame = frame[_report_file.write(frame) or 0:]
        except BrokenPipeError:
            os._exit(1)  # the parent is gone: nobody is left to run for


def report(payload: Any) -> None:
    """Send ``payload`` (picklable) to the parent's ``on_report(rank, payload)``.

    A no-op outside a rank started by this module, so workloads can call it unconditionally.
    """
    _send("report", payload)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when the launcher dies, so no rank outlives its job."""
    parent = int(os.environ.get(PARENT_PID_ENV, "0"))
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if parent and os.getppid() != parent and os.environ.get(PREFIXED_ENV) != "1":
        os._exit(1)  # the launcher died before we got here


def _child_main() -> None:
    """Entry point of a rank: read the job from stdin, run it, send back the outcome."""
    _die_with_parent()
    outer = pickle.loads(sys.stdin.buffer.read())
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the rank has no terminal input
    for entry in reversed(outer["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        job = pickle.loads(outer["job"])  # after sys.path: it imports the function's module
        if job["kind"] == "module":
            import runpy

            sys.argv = [job["target"], *job["argv"]]
            try:
                runpy.run_module(job["target"], run_name="__main__", alter_sys=True)
            except SystemExit as exc:
                if exc.code not in (None, 0):
                    raise
            result = None
        else:
            fn = _resolve(job["target"])
            result = fn(*job["args"], **job["kwargs"])
        try:
            _send("result", result)
        except Exception as exc:  # noqa: BLE001 - an unpicklable result is the rank's error
            raise TypeError(f"rank returned a value that does not pickle: {exc}") from exc
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        text = traceback.format_exc()
        sys.stdout.flush()
        if outer["echo_errors"]:  # into the rank's log file; the parent re-raises it anyway
            sys.stderr.write(text)
        sys.stderr.flush()
        _send("error", (type(exc).__name__, str(exc), text))
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: lingering non-daemon threads of a workload must not keep a
    # rank (and so the whole job) alive after it has delivered its result.
    os._exit(0)


def _resolve(target: Any) -> Callable[..., Any]:
    if callable(target):
        return target
    module_name, _, attr = str(target).partition(":")
    if not attr:
        raise ValueError(f"entry point {target!r} must look like 'package.module:function'")
    import importlib

    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------- in the parent


def run_ranks(fn: Callable[..., Any] | str, world_size: int | None = None, *,
              args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
              timeout: float | None = None, config: LaunchConfig | None = None,
              expect_failures: Collection[int] = (),
              on_report: Callable[[int, Any], None] | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` ranks; return their results by rank.

    ``fn`` must pickle by reference (a module-level function) or be a
    ``"package.module:function"`` string. Pass ``world_size`` (and optionally ``timeout``,
    seconds) or a full ``config``. Ranks in ``expect_failures`` may raise or die without
    failing the job; their entry in the result is a :class:`RankFailure` if they did.
    """
    config = _config(config, world_size, timeout)
    if not callable(fn) and not (isinstance(fn, str) and ":" in fn):
        raise TypeError(f"run_ranks needs a callable or a 'package.module:function' string, got {fn!r}")
    job = {"kind": "call", "target": fn, "args": tuple(args), "kwargs": dict(kwargs or {})}
    return _launch(job, config, on_report, frozenset(expect_failures))


def run_module(module: str, argv: Sequence[str] = (), world_size: int | None = None, *,
               timeout: float | None = None, config: LaunchConfig | None = None,
               on_report: Callable[[int, Any], None] | None = None) -> None:
    """Run ``python -m module *argv`` in each rank (with the torchrun environment)."""
    config = _config(config, world_size, timeout)
    _launch({"kind": "module", "target": module, "argv": [str(a) for a in argv]}, config,
            on_report, frozenset())


def _config(config: LaunchConfig | None, world_size: int | None, timeout: float | None) -> LaunchConfig:
    if config is None:
        if world_size is None:
            raise TypeError("pass world_size= or config=")
        config = LaunchConfig(world_size=world_size)
    elif world_size is not None and world_size != config.world_size:
        raise ValueError(f"world_size={world_size} contradicts config.world_size={config.world_size}")
    if timeout is not None:
        config = dataclasses.replace(config, timeout_s=timeout)
    return config


@dataclass(frozen=True, kw_only=True)
class RankFailure:
    """What a rank in ``expect_failures`` left instead of a result."""

    rank: int
    exc_type: str  # "ProcessDied" when it exited without reporting an exception
    message: str
    traceback: str


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen
    log_path: str | None
    reader: threading.Thread
    done: bool = False
    outcome: str | None = None  # "result" | "error" | "died"
    result: Any = None
    error: tuple[str, str, str] | None = None
    failed_at: float = 0.0


def _launch(job: dict[str, Any], config: LaunchConfig, on_report: Callable[[int, Any], None] | None,
            expect_failures: frozenset[int]) -> list[Any]:
    try:
        payload = pickle.dumps({"sys_path": [p for p in sys.path if p],
                                "echo_errors": config.capture_output,
                                "job": pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)},
                               protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - name the culprit
        raise TypeError(f"the job for the ranks does not pickle ({exc}); pass a module-level "
                        "function or a 'package.module:function' string and picklable arguments") from exc
    port = config.master_port if config.master_port is not None else free_port(config.master_addr)
    log_dir = config.log_dir
    tmp: tempfile.TemporaryDirectory | None = None
    if config.capture_output and log_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="mlfabric-ranks-")
        log_dir = tmp.name
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
    events: queue.Queue[tuple[int, str, Any]] = queue.Queue()
    ranks: list[_Rank] = []
    try:
        for rank in range(config.world_size):
            ranks.append(_start(rank, config, port, payload, log_dir, events))
        return _supervise(ranks, config, events, on_report, expect_failures)
    finally:
        for r in ranks:
            _kill(r.proc)
        for r in ranks:
            r.reader.join(timeout=2.0)
        if tmp is not None:
            tmp.cleanup()


def _start(rank: int, config: LaunchConfig, port: int, payload: bytes, log_dir: str | None,
           events: queue.Queue) -> _Rank:
    read_fd, write_fd = os.pipe()
    env = dict(os.environ)
    env.update(config.env)
    if config.rank_env is not None:
        env.update(config.rank_env[rank])
    env.update({
        "RANK": str(rank), "WORLD_SIZE": str(config.world_size),
        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(config.world_size),
        "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(config.world_size),
        "MASTER_ADDR": config.master_addr, "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": str(config.omp_num_threads),
        REPORT_FD_ENV: str(write_fd),
        PARENT_PID_ENV: str(os.getpid()),
    })
    prefix = list(config.command_prefix[rank]) if config.command_prefix is not None else []
    env[PREFIXED_ENV] = "1" if prefix else "0"
    cmd = [*prefix, config.python, "-c", "from mlfabric.bench.procs import _child_main; _child_main()"]
    log_path = os.path.join(log_dir, f"rank{rank}.log") if log_dir is not None else None
    out = open(log_path, "wb") if log_path is not None else None  # noqa: SIM115
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT if out else None,
                                env=env, pass_fds=(write_fd,), start_new_session=True)
    finally:
        os.close(write_fd)
        if out is not None:
            out.close()
    reader = threading.Thread(target=_read_messages, args=(rank, read_fd, events),
                              name=f"mlfabric-procs-rank{rank}", daemon=True)
    reader.start()
    assert proc.stdin is not None
    try:
        proc.stdin.write(payload)
        proc.stdin.close()
    except BrokenPipeError:
        pass  # the rank died at once; the supervisor reports it
    return _Rank(rank=rank, proc=proc, log_path=log_path, reader=reader)


def _read_messages(rank: int, fd: int, events: queue.Queue) -> None:
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while True:
            header = _read_exact(pipe, _HEADER.size)
            if header is None:
                break
            data = _read_exact(pipe, _HEADER.unpack(header)[0])
            if data is None:
                break
            try:
                kind, payload = pickle.loads(data)
            except Exception as exc:  # noqa: BLE001 - e.g. a class the parent cannot import
                kind, payload = "error", (type(exc).__name__, f"cannot unpickle a message from rank {rank}: {exc}",
                                          traceback.format_exc())
            events.put((rank, kind, payload))
    events.put((rank, "eof", None))


def _read_exact(pipe: Any, n: int) -> bytes | None:
    chunks = []
    while n > 0:
        chunk = pipe.read(n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _supervise(ranks: list[_Rank], config: LaunchConfig, events: queue.Queue,
               on_report: Callable[[int, Any], None] | None, expect_failures: frozenset[int]) -> list[Any]:
    start = time.monotonic()
    deadline = start + config.timeout_s
    first_failure: float | None = None
    while True:
        if all(r.done for r in ranks):
            break
        now = time.monotonic()
        if first_failure is not None and now > first_failure + config.grace_s:
            break
        if now > deadline:
            pending = [r.rank for r in ranks if not r.done]
            if first_failure is not None:
                break
            raise RankTimeoutError(
                f"ranks {pending} did not finish within {config.timeout_s:g}s; they were killed"
                f"{_log_hint(ranks)}. Raise the timeout or look for a rank stuck in a collective.",
                pending=pending)
        try:
            rank, kind, payload = events.get(timeout=0.05)
        except queue.Empty:
            continue
        r = ranks[rank]
        if kind == "report":
            if on_report is not None:
                on_report(rank, payload)
        elif kind == "result":
            r.outcome, r.result = "result", payload
        elif kind == "error":
            r.outcome, r.error, r.failed_at = "error", payload, time.monotonic()
        elif kind == "eof":
            code = _wait(r.proc, 10.0)
            r.done = True
            if r.outcome is None or (r.outcome == "result" and code != 0):
                r.outcome, r.failed_at = "died", time.monotonic()
                r.error = ("ProcessDied", _describe_exit(code),
                           _tail(r.log_path) or "(no traceback: see the rank's stderr above)")
            if r.outcome != "result" and first_failure is None and r.rank not in expect_failures:
                first_failure = r.failed_at
    failed = sorted((r for r in ranks if r.outcome in ("error", "died") and r.rank not in expect_failures),
                    key=lambda r: r.failed_at)
    if failed:
        first = failed[0]
        assert first.error is not None
        exc_type, message, text = first.error
        others = [r.rank for r in failed[1:]]
        killed = [r.rank for r in ranks if not r.done]
        extra = f"; ranks {others} failed after it" if others else ""
        extra += f"; ranks {killed} were killed" if killed else ""
        raise RankFailedError(
            f"rank {first.rank} of {config.world_size} failed with {exc_type}: {message}{extra}\n"
            f"--- rank {first.rank} traceback ---\n{text.rstrip()}",
            rank=first.rank, exc_type=exc_type, traceback=text, others=others)
    results = []
    for r in ranks:
        if r.outcome == "result":
            results.append(r.result)
        else:
            assert r.error is not None
            results.append(RankFailure(rank=r.rank, exc_type=r.error[0], message=r.error[1], traceback=r.error[2]))
    return results


def _wait(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        return proc.poll()


def _kill(proc: subprocess.Popen) -> None:
    """Kill a rank and anything it started (it leads its own session)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass


def stop_processes(procs: Iterable[subprocess.Popen], timeout: float = 10.0) -> None:
    """Kill every process of ``procs`` still running and reap it (waiting at most ``timeout``
    s for each): a parent's last step, on success or error, so that nothing outlives it."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:  # a zombie's parent is us: nothing more to do
                print(f"mlfabric: process {proc.pid} did not end within {timeout:g} s of SIGKILL", file=sys.stderr)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "the rank closed its result pipe but did not exit"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the rank was killed by {name} before returning a result"
    return f"the rank exited with code {code} before returning a result"


def _tail(path: str | None, lines: int = 40) -> str:
    if path is None or not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        text = f.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def _log_hint(ranks: list[_Rank]) -> str:
    logs = [r.log_path for r in ranks if r.log_path]
    return f" (logs: {', '.join(logs)})" if logs else ""


# -- aligned starts ----------------------------------------------------------------------------

#: Ranks start a timed step this long after the last one got there (:func:`aligned_start`):
#: above a barrier's exit skew on 2 cores (up to ~30 ms with 9 ranks).
ALIGN_MARGIN_S = 0.1


def aligned_start(latest: Callable[[float], float], margin_s: float = ALIGN_MARGIN_S) -> float:
    """The instant (``time.monotonic()``) at which every rank starts its next timed step:
    ``margin_s`` after the last rank called this. ``latest(t)`` returns the largest ``t`` over
    the ranks (an allreduce with max). Ranks on one machine, local processes and emulated
    hosts alike, share CLOCK_MONOTONIC, so the instant is the same everywhere, where a
    barrier's exit reaches the ranks tens of milliseconds apart on a busy machine."""
    return latest(time.monotonic()) + margin_s


def sleep_until(instant: float) -> bool:
    """Sleep until ``instant`` (``time.monotonic()``); False if it had passed already."""
    wait = instant - time.monotonic()
    if wait <= 0:
        return False
    time.sleep(wait)
    return True
