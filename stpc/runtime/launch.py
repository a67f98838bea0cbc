"""A small multi-rank launcher: run a function on N real gloo (or NCCL) processes.

The one launcher of stpc: the multi-rank tests, the demo and calibration all use
it. It is deliberately not torchrun: tests need the per-rank return values back in
the parent, a hard timeout, and a failure report that names the rank.

    results = spawn(fn, world_size, *args, timeout_s=120)

runs ``fn(rank, world_size, *args)`` in ``world_size`` processes forked by a fork server
(never by the caller, which may hold threads / OpenMP pools: one clean process started
once, with torch and stpc imported, so a rank starts in a fraction of a second rather than
seconds; as new interpreters where a variable read at load differs from the server's,
e.g. ``env``'s), each with a process group (``backend``: gloo, NCCL with rank i on GPU i, or per device
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
sees, such as SIGKILL or an uncaught SIGTERM, through the fork server, which ends with
it; a rank's own children, such as
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
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing import forkserver as mp_forkserver

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


def _stderr_log(fault_dir: str, rank: int) -> str:
    return os.path.join(fault_dir, f"rank{rank}.stderr")


# How much of a dead rank's stderr its failure quotes (the end: the native library's reason,
# or c10's report of every thread's C++ stack, the crashing thread's first; a few KiB a thread).
_STDERR_TAIL_BYTES = 65536

_tee: subprocess.Popen | None = None  # this rank's stderr copier (``_tee_stderr``)


def _tee_stderr(path: str) -> None:
    """Send this rank's fd 2 through ``tee``, to where it went and to ``path`` too. A native
    abort writes its reason (libstdc++'s "terminate called after throwing an instance of
    'gloo::EnforceNotMet'", a ``TORCH_CHECK`` of a C++ thread) to fd 2 just before the
    process dies, where faulthandler, which writes Python stacks, cannot see it and where a
    CI log's tail rarely shows it; tee, a process of its own, drains the pipe after the
    rank is gone, and the parent quotes the file's end in the failure it reports."""
    global _tee
    try:
        _tee = subprocess.Popen(["tee", "-i", "-a", path], stdin=subprocess.PIPE, stdout=2)
    except OSError:
        return  # no tee on this system: a silent death is reported without its last words
    sys.stderr.flush()
    os.dup2(_tee.stdin.fileno(), 2)
    _tee.stdin.close()  # fd 2 holds the pipe's writing end now


def _end_tee() -> None:
    """Close this rank's end of the pipe to ``tee`` and wait for it to write the rest, so
    nothing this rank printed is lost and no tee outlives it (unless a child of the rank
    still holds the pipe open; it then ends with it)."""
    if _tee is None:
        return
    os.close(2)
    try:
        _tee.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass


_PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this rank when ``parent_pid`` (the process that spawned it)
    dies, whatever kills it: its own clean-up of the ranks runs only if it lives to run
    it. Linux only (elsewhere the parent's clean-up is the one guard; where the request
    fails, a warning says so). The kernel sends the signal when the parent *thread* that
    started the rank ends, which is the parent's end here: :func:`spawn` starts and waits
    for its ranks on one thread, and the fork server, single-threaded, forks them on its
    only one. ``parent_pid`` is the process that started the rank: :func:`spawn`'s own
    (a rank started as a new interpreter) or the fork server, which ends when
    :func:`spawn`'s process does (its pipe from it closes). A parent that is gone already
    (it died before the request took hold: the rank is someone else's now): exit at once."""
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
            launcher_pid: int, environ: dict[str, str]) -> None:
    if os.getppid() == launcher_pid:  # (started by the launcher itself)
        _die_with_parent(launcher_pid)
    else:  # forked by the fork server, which ends when the launcher does
        _let_the_server_end()
        _die_with_parent(os.getppid())
        if not _alive(launcher_pid):
            os._exit(1)
    # the launcher's environment as it is now (a fork server's child has the server's, as it
    # was when the server started)
    os.environ.clear()
    os.environ.update(environ)
    _tee_stderr(_stderr_log(fault_dir, rank))
    # A native crash (SIGSEGV in a kernel or a communication thread) kills the
    # process before it can report; faulthandler writes every thread's Python
    # stack to a file the parent reads, so the failure says where it happened.
    fault_file = open(_fault_log(fault_dir, rank), "w")  # noqa: SIM115 - open until os._exit
    faulthandler.enable(file=fault_file, all_threads=True)
    # ... and on the parent's SIGUSR1 at the deadline, so a hang names the line each rank is stuck on
    faulthandler.register(_STACKS_SIGNAL, file=fault_file, all_threads=True, chain=False)
    # A crash in a thread with no Python frames (a backend's worker) leaves faulthandler only the
    # other threads' stacks: c10's fatal-signal handler, ahead of it, writes every thread's C++
    # stack to stderr first (which the parent quotes, ``_tee_stderr``)
    torch._C._set_print_stack_traces_on_fatal_signal(True)
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


def _let_the_server_end() -> None:
    """Close this rank's copy of the fork server's "alive" pipe. The server ends when every
    holder of that pipe's writing end has closed it, and hands one to each process it forks
    (multiprocessing's ``forkserver``, ``_forkserver_alive_fd``): while a rank held it, a
    launcher killed by a signal would leave the server, and with it its ranks (who die
    with the server, :func:`_die_with_parent`), running. (A fork server this rank asks for
    is then a new one of its own.)"""
    server = mp_forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # (gone, or someone else's process by now)
        return False
    return True


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
        _end_tee()
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


# What the fork server imports once, so that a rank forked from it starts with them loaded:
# importing torch and stpc costs a process about 3 s of CPU, 6 s of a 4-rank start on two
# cores, paid again by every ``spawn`` a test suite makes.
_PRELOAD = ("torch", "torch.distributed", "stpc")

# Environment variables a library reads when it is loaded or its process starts, by prefix
# (stpc's ring kernel choice, torch's, Triton's, OpenMP's and glibc's settings): a rank
# forked from the fork server has the libraries the server loaded, with what they read then.
_READ_AT_LOAD = ("STPC_", "TORCH", "PYTORCH_", "TRITON_", "MALLOC_", "OMP_", "MKL_", "KMP_", "GLOO_",
                 "NCCL_", "CUDA_", "LD_", "PYTHON")

_server_env: dict[str, str] | None = None  # those variables as the fork server started with them


def _context(load_env: dict[str, str]):
    """The multiprocessing context the ranks start in: a fork server's (``forkserver``: one
    clean process, started at the first call, that imported only :data:`_PRELOAD`, forks
    each rank; never this process, which may hold threads and OpenMP pools), unless the
    variables of :data:`_READ_AT_LOAD` the ranks are to start with (``load_env``) differ
    from the ones the server started with: then new interpreters (``spawn``), which read
    them afresh (``spawn(env=...)``'s glibc ``MALLOC_*`` settings, for one)."""
    global _server_env
    if _server_env is None:
        _server_env = dict(load_env)  # (the server starts with this call's ranks)
    if load_env != _server_env:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))  # (no effect once the server runs)
    return ctx


def spawn(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120, backend: str = "gloo",
          threads_per_rank: int = 1, grace_s: float = _FAILURE_GRACE_S, env: dict[str, str] | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results.

    ``env``: environment variables the ranks start with (besides ``OMP_NUM_THREADS`` and
    ``MKL_NUM_THREADS``, set to ``threads_per_rank``), for what a process reads only at its
    start (glibc's ``MALLOC_*`` variables); this process's environment is left as it was.
    Each rank starts with this process's environment as it is at the call; where a
    variable read when a library loads (:data:`_READ_AT_LOAD`) differs from the fork
    server's, the ranks start as new interpreters (seconds each), which read it.

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
    # OMP_NUM_THREADS must be set before torch is imported in a rank (the fork server's
    # import, or a new interpreter's)
    start_env = {**(env or {}), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    ctx = _context({k: v for k, v in {**os.environ, **start_env}.items() if k.startswith(_READ_AT_LOAD)})
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
    saved = {k: os.environ.get(k) for k in start_env}
    os.environ.update(start_env)
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_worker,
                args=(fn, rank, world_size, port, args, timeout_s, results, backend, threads, fault_dir,
                      os.getpid(), dict(os.environ)),
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
    one is the signal), the end of what it wrote to stderr (a native abort's reason) and
    the stacks faulthandler wrote when it crashed."""
    msg = f"process exited with code {exitcode} without reporting"
    if exitcode < 0:
        try:
            msg += f" (killed by {signal.Signals(-exitcode).name})"
        except ValueError:
            pass
    last = _tail(_stderr_log(fault_dir, rank), _STDERR_TAIL_BYTES)
    if last:
        msg += f"\n--- the end of rank {rank}'s stderr ---\n{last}\n---"
    try:
        with open(_fault_log(fault_dir, rank)) as f:
            stacks = f.read().strip()
    except OSError:
        stacks = ""
    return f"{msg}\n{stacks}" if stacks else msg


def _tail(path: str, nbytes: int) -> str:
    """The last ``nbytes`` of the file at ``path`` (from a line's start), or "" without one."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - nbytes))
            data = f.read()
    except OSError:
        return ""
    if size > nbytes and b"\n" in data:
        data = data.split(b"\n", 1)[1]
    return data.decode(errors="replace").strip()
