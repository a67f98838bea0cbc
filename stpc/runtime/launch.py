"""A small multi-rank launcher: run a function on N real gloo (or NCCL) processes.

The one launcher of stpc: the multi-rank tests, the demo and calibration all use
it. It is deliberately not torchrun: tests need the per-rank return values back in
the parent, a hard timeout, and a failure report that names the rank.

    results = spawn(fn, world_size, *args, timeout_s=120)

runs ``fn(rank, world_size, *args)`` in ``world_size`` processes started with
the "spawn" method (never fork: the parent may hold threads / OpenMP pools),
each with a process group (``backend``: gloo, NCCL with rank i on GPU i, or per device
such as ``"cpu:gloo,cuda:gloo"``, CUDA tensors over gloo with ranks sharing the GPUs) that
meets at a TCP store on 127.0.0.1 served by the parent (bound before the ranks start, so no
other socket can take its port meanwhile), and ``threads_per_rank`` intra-op threads. ``fn`` and
``args`` must be picklable (a module-level function). Returns the list of
per-rank return values (picklable), in rank order.

Guarantees: never hangs (a deadline covers start-up, the run and the
collection of results; on expiry every child is killed and
:class:`SpawnTimeout` is raised), never leaves orphans (all children are
killed before any error propagates; on Linux a rank is also killed by the
kernel when the process that spawned it dies, even by a signal no handler
sees, such as SIGKILL or an uncaught SIGTERM; a rank's own children, such as
inductor's compile workers, are theirs to end), and a failing rank raises
:class:`SpawnError` carrying the rank and its traceback. When several ranks
fail (one rank's exception typically breaks its peers' P2P/collectives), the
earliest failure is reported and the others are listed as consequences.

Each rank exits with ``os._exit`` right after reporting (its atexit handlers
run first): the interpreter teardown of a torch process costs seconds per
rank on a small machine and buys nothing here.
"""
from __future__ import annotations

import atexit
import ctypes
import datetime
import faulthandler
import os
import pickle
import queue as queue_mod
import socket
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn", "free_port", "SpawnError", "SpawnTimeout"]


# After the first failure, how long to wait for the other ranks' reports, to
# tell the root cause from the peers that failed because of it.
_FAILURE_GRACE_S = 2.0


class SpawnError(RuntimeError):
    """A rank raised (or died); ``.rank`` and ``.remote_traceback`` say which and why.
    ``.failures`` (rank -> traceback) and ``.values`` (rank -> return value) hold what every
    rank reported before the others were killed."""

    def __init__(self, rank: int, remote_traceback: str, failures: dict | None = None, values: dict | None = None):
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.failures = dict(failures or {})
        self.values = dict(values or {})
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")


class SpawnTimeout(TimeoutError):
    """The ranks did not all finish before the deadline; all were killed."""


def _per_device(backend: str) -> bool:
    """A backend string of ``device:backend`` pairs, as ``init_process_group`` takes it."""
    pairs = [p.split(":") for p in backend.split(",")]
    return all(len(p) == 2 and p[0].strip() in ("cpu", "cuda") and p[1].strip() in ("gloo", "nccl") for p in pairs)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The signal at which a rank writes every thread's stack to its fault log (``spawn``'s
# deadline sends it before the kill), and how long the parent waits for the writes.
_STACKS_SIGNAL = signal.SIGUSR1
_STACKS_WAIT_S = 2.0


def _fault_log(fault_dir: str, rank: int) -> str:
    return os.path.join(fault_dir, f"rank{rank}.fault")


_PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this rank when ``parent_pid`` (the process that spawned it)
    dies, whatever kills it: its own clean-up of the ranks runs only if it lives to run
    it. Linux only (elsewhere the parent's clean-up is the one guard; where the request
    fails, a warning says so). The kernel sends the signal when the parent *thread* that
    started the rank ends, which is the parent's end here: :func:`spawn` starts and waits
    for its ranks on one thread. Ranks are started with the "spawn" method, so a rank's
    parent is :func:`spawn`'s process; one that is gone already (it died before the
    request took hold: the rank is someone else's now): exit at once."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            # (prctl is variadic: every argument passed as the unsigned long the kernel reads)
            got = libc.prctl(ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL),
                             ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
        except (OSError, AttributeError):
            got = -1
        if got != 0:
            warnings.warn(f"spawn: rank {os.getpid()} could not ask to die with its launcher (prctl errno "
                          f"{ctypes.get_errno()}); it is left to the launcher's own clean-up", RuntimeWarning)
    if os.getppid() != parent_pid:
        os._exit(1)


def _worker(fn: Callable, rank: int, world_size: int, port: int, args: tuple,
            timeout_s: float, results: Any, backend: str, threads: int, fault_dir: str,
            parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    # A native crash (SIGSEGV in a kernel or a communication thread) kills the
    # process before it can report; faulthandler writes every thread's Python
    # stack to a file the parent reads, so the failure says where it happened.
    fault_file = open(_fault_log(fault_dir, rank), "w")  # noqa: SIM115 - open until os._exit
    faulthandler.enable(file=fault_file, all_threads=True)
    # ... and on the parent's SIGUSR1 at the deadline, so a hang names the line each rank is stuck on
    faulthandler.register(_STACKS_SIGNAL, file=fault_file, all_threads=True, chain=False)
    # Few threads per rank: ranks share the machine's cores, and OpenMP
    # oversubscription makes start-up and every matmul slower, not faster.
    initialised = False
    try:
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        elif "cuda:" in backend:  # e.g. CUDA tensors over gloo: ranks may share a GPU
            torch.cuda.set_device(rank % torch.cuda.device_count())
        timeout = datetime.timedelta(seconds=max(timeout_s, 1.0))
        dist.init_process_group(
            backend,
            # the parent's store (``spawn``): every rank a client, none binds a port
            store=dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout),
            rank=rank,
            world_size=world_size,
            # a collective stuck on a dead peer fails instead of hanging
            timeout=timeout,
        )
        initialised = True
        value = fn(rank, world_size, *args)
        # plain pickle (not torch's shared-memory reductions): the payload
        # must outlive this process, which exits right after.
        report, code = (rank, True, pickle.dumps(value), time.time()), 0
    except BaseException:  # report everything, including SystemExit/KeyboardInterrupt
        # stamp the failure before tearing the group down: the teardown is
        # what makes the peers fail, and the parent ranks failures by time
        report, code = (rank, False, traceback.format_exc(), time.time()), 1
    if initialised:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the report matters more than a clean teardown
            pass
    results.put(report)
    _fast_exit(results, code)


def _fast_exit(results: Any, code: int) -> None:
    """Exit without the interpreter's teardown of torch's ~2,000 modules
    (seconds per rank on a loaded machine), but only after the report is
    flushed to the parent and the atexit handlers (e.g. inductor's compile
    worker pools, so no grandchild is orphaned) have run."""
    results.close()
    results.join_thread()  # the report is in the pipe
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _kill_all(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)


def spawn(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120, backend: str = "gloo",
          threads_per_rank: int = 1, grace_s: float = _FAILURE_GRACE_S, env: dict[str, str] | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results.

    ``env``: environment variables the ranks start with (besides ``OMP_NUM_THREADS`` and
    ``MKL_NUM_THREADS``, set to ``threads_per_rank``), for what a process reads only at its
    start (glibc's ``MALLOC_*`` variables); this process's environment is left as it was.

    Raises :class:`SpawnError` naming the first rank that failed (with its
    traceback; the others' reports, collected for up to ``grace_s`` seconds after
    the first failure, ride along), or :class:`SpawnTimeout` if not all ranks
    returned within ``timeout_s`` seconds. In every case all child processes are
    gone when this returns or raises.
    """
    if world_size < 1:
        raise ValueError(f"spawn: world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl") and not _per_device(backend):
        raise ValueError(f"spawn: backend must be 'gloo', 'nccl' or per device ('cpu:gloo,cuda:gloo'), "
                         f"got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"spawn: {world_size} NCCL ranks need {world_size} GPUs, this machine has "
                         f"{torch.cuda.device_count()}; use backend='gloo' or fewer ranks")
    threads = max(1, int(threads_per_rank))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # The ranks' rendezvous store is served from this process, bound (to a port the kernel
    # picks) before any rank starts and open until they are gone: no moment in which a port
    # probed free can be taken before its owner binds it (rank 0 binding a port picked here
    # left that window open while the ranks imported torch, seconds, where another
    # process's socket, or a rank's own connection attempt to the port not yet listening,
    # could take it).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)))
    port = store.port
    fault_dir = tempfile.mkdtemp(prefix="stpc-spawn-")
    procs = []
    # Children inherit the environment at start: OMP_NUM_THREADS must be set
    # before torch is imported there, which happens while unpickling fn.
    start_env = {**(env or {}), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    saved = {k: os.environ.get(k) for k in start_env}
    os.environ.update(start_env)
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_worker,
                args=(fn, rank, world_size, port, args, timeout_s, results, backend, threads, fault_dir,
                      os.getpid()),
                name=f"stpc-rank{rank}",
            )
            p.start()
            procs.append(p)
    except BaseException:
        _kill_all(procs)
        shutil.rmtree(fault_dir, ignore_errors=True)
        raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    exited_quietly: set[int] = set()
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    failures: dict[int, tuple[float, str]] = {}  # rank -> (wall time of failure, traceback)
    grace_end = None
    try:
        while len(values) + len(failures) < world_size:
            now = time.monotonic()
            if grace_end is not None and now >= grace_end:
                break
            if now >= deadline:
                if failures:
                    break
                missing = sorted(set(range(world_size)) - set(values))
                raise SpawnTimeout(
                    f"spawn: ranks {missing} of {world_size} did not finish within {timeout_s} s "
                    f"(deadlock in a collective/P2P sequence?); all ranks were killed"
                    + _hung_stacks(procs, missing, fault_dir)
                )
            try:
                rank, ok, payload, when = results.get(timeout=min(0.2, deadline - now))
            except queue_mod.Empty:
                # a rank that died without reporting (segfault, OOM kill) would
                # otherwise leave us waiting for the full timeout; its report
                # may still be in the pipe, so only count it after a quiet poll
                for r, p in enumerate(procs):
                    if r in values or r in failures or p.is_alive() or p.exitcode in (0, None):
                        continue
                    if r in exited_quietly:
                        # a silent death is the likeliest root cause: peers fail
                        # through Python exceptions, which are reported
                        failures[r] = (float("-inf"), _silent_death(r, p.exitcode, fault_dir))
                    else:
                        exited_quietly.add(r)
                if failures and grace_end is None:
                    grace_end = time.monotonic() + grace_s
                continue
            if ok:
                values[rank] = pickle.loads(payload)
            else:
                failures[rank] = (when, payload)
                if grace_end is None:
                    grace_end = time.monotonic() + grace_s
        if failures:
            # One rank's exception usually makes its peers fail too (a P2P or
            # collective sees the connection close); the root cause is the
            # earliest failure, not the first report to arrive.
            first = min(failures, key=lambda r: failures[r][0])
            others = sorted(set(failures) - {first})
            tb = failures[first][1]
            if others:
                tb += f"\n(ranks {others} failed after it, probably as a consequence)"
            raise SpawnError(first, tb, {r: f[1] for r, f in failures.items()}, values)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return [values[r] for r in range(world_size)]
    finally:
        _kill_all(procs)
        results.close()
        results.join_thread()
        shutil.rmtree(fault_dir, ignore_errors=True)


def _hung_stacks(procs: list, ranks: list[int], fault_dir: str) -> str:
    """Every thread's Python stack of each hung rank in ``ranks``, as its faulthandler writes
    it on :data:`_STACKS_SIGNAL`: where each one waits (a collective no peer joins, a lock),
    so a deadlock seen once, on a loaded machine, can be told apart from a slow run."""
    alive = [r for r in ranks if procs[r].is_alive()]
    for r in alive:
        try:
            os.kill(procs[r].pid, _STACKS_SIGNAL)
        except OSError:
            pass
    time.sleep(_STACKS_WAIT_S if alive else 0.0)
    parts = []
    for r in ranks:
        try:
            with open(_fault_log(fault_dir, r)) as f:
                stacks = f.read().strip()
        except OSError:
            stacks = ""
        parts.append(f"\n--- rank {r}'s stacks at the deadline ---\n{stacks or '(none written)'}")
    return "".join(parts)


def _silent_death(rank: int, exitcode: int, fault_dir: str) -> str:
    """What a rank that died without reporting left behind: its exit code (a negative
    one is the signal) and the stacks faulthandler wrote when it crashed."""
    msg = f"process exited with code {exitcode} without reporting"
    if exitcode < 0:
        try:
            msg += f" (killed by {signal.Signals(-exitcode).name})"
        except ValueError:
            pass
    try:
        with open(_fault_log(fault_dir, rank)) as f:
            stacks = f.read().strip()
    except OSError:
        stacks = ""
    return f"{msg}\n{stacks}" if stacks else msg
