"""stpc.runtime.launch.spawn: results in rank order, failures named, never a hang or an orphan."""
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from stpc.runtime.launch import SpawnError, SpawnTimeout, free_port, spawn

pytestmark = pytest.mark.multirank


def _allreduce_rank(rank, world_size, offset):
    import torch.distributed as dist

    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world": world_size,
        "sum": t.item(),
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "payload": torch.full((3,), float(rank)),  # tensors must come back intact
    }


def _rank1_raises(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # the others block here until killed
    return rank


def _rank0_hangs(rank, world_size):
    if rank == 0:
        time.sleep(3600)
    return rank


def _rank1_dies(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        os._exit(7)  # no traceback, no report: like a segfault or an OOM kill
    dist.barrier()  # fails (reported) when rank 1 vanishes: rank 1 must still be blamed
    return rank


def _rank1_segfaults_in_a_named_frame(rank, world_size):
    import ctypes

    import torch.distributed as dist

    if rank == 1:
        ctypes.string_at(0)  # a native crash: SIGSEGV, as a faulty kernel would raise
    dist.barrier()
    return rank


def _rank1_aborts_with_a_native_reason(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        # as libstdc++ does when a C++ thread's exception has no handler: the reason goes to
        # fd 2, unbuffered, and the process aborts (no Python frame is on that thread)
        os.write(2, b"terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
                    b"  what():  [enforce fail at pair.cc:446] op.preamble.length <= op.nbytes\n")
        os.abort()
    dist.barrier()
    return rank


def _how_started(rank, world_size, key):
    return {"parent": os.getppid(), "value": os.environ.get(key)}


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_spawn_returns_results_in_rank_order():
    t0 = time.monotonic()
    out = spawn(_allreduce_rank, 4, 10, timeout_s=60)
    elapsed = time.monotonic() - t0
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert all(o["world"] == 4 for o in out)
    assert all(o["sum"] == 10 + 11 + 12 + 13 for o in out)
    assert all(o["threads"] == "1" for o in out)
    assert all(torch.equal(o["payload"], torch.full((3,), float(r))) for r, o in enumerate(out))
    assert elapsed < 30, f"4 ranks took {elapsed:.1f}s to start and finish"
    assert multiprocessing.active_children() == []


def test_failing_rank_is_named_with_traceback_and_others_killed():
    t0 = time.monotonic()
    with pytest.raises(SpawnError) as ei:
        spawn(_rank1_raises, 2, timeout_s=60)
    assert ei.value.rank == 1
    assert "rank 1" in str(ei.value)
    assert "boom from rank one" in ei.value.remote_traceback
    assert "ValueError" in ei.value.remote_traceback
    # rank 0 was stuck in a barrier: it must have been killed, not waited for
    assert time.monotonic() - t0 < 30
    assert multiprocessing.active_children() == []


def test_timeout_kills_everything():
    t0 = time.monotonic()
    with pytest.raises(SpawnTimeout, match=r"ranks \[0\]") as ei:
        spawn(_rank0_hangs, 2, timeout_s=20)  # rank 1 must start and finish in time on a loaded machine
    assert time.monotonic() - t0 < 40
    # the hung rank's stack at the deadline names the line it was stuck on
    assert "rank 0's stacks at the deadline" in str(ei.value) and "_rank0_hangs" in str(ei.value)
    assert multiprocessing.active_children() == []


def test_rank_dying_without_report_is_detected_quickly():
    t0 = time.monotonic()
    with pytest.raises(SpawnError, match="exited with code 7") as ei:
        spawn(_rank1_dies, 2, timeout_s=60)
    assert ei.value.rank == 1
    assert time.monotonic() - t0 < 30  # well before the 60 s deadline
    assert multiprocessing.active_children() == []


def test_a_rank_killed_by_a_signal_says_which_and_where():
    with pytest.raises(SpawnError) as ei:
        spawn(_rank1_segfaults_in_a_named_frame, 2, timeout_s=60)
    tb = ei.value.remote_traceback
    assert ei.value.rank == 1 and "code -11" in tb and "SIGSEGV" in tb
    # faulthandler's stack of the crashing thread names the Python frame it died in
    assert "_rank1_segfaults_in_a_named_frame" in tb, tb
    # ... and c10's handler, ahead of it, every thread's C++ stack, the crashing one's first (a
    # backend's worker thread has no Python frame to name)
    assert "rank 1's stderr ---\nSIGSEGV(11), PID: " in tb and "fatalSignalHandler" in tb, tb
    assert multiprocessing.active_children() == []


def test_a_native_abort_is_reported_with_what_the_rank_last_wrote_to_stderr():
    """The C++ reason of an abort never reaches faulthandler's Python stacks: the failure
    quotes the end of the rank's stderr, which a tee process saved as the rank died."""
    with pytest.raises(SpawnError) as ei:
        spawn(_rank1_aborts_with_a_native_reason, 2, timeout_s=60)
    tb = ei.value.remote_traceback
    assert ei.value.rank == 1 and "SIGABRT" in tb, tb
    assert "rank 1's stderr" in tb and "gloo::EnforceNotMet" in tb and "op.preamble.length" in tb, tb
    assert multiprocessing.active_children() == []


def test_ranks_are_forked_by_the_server_and_start_with_the_environment_of_the_call(monkeypatch):
    """The second call's ranks come from the fork server the first call started (not from
    this process), and see a variable set in between: each rank takes the caller's
    environment as it is at the call, not the server's."""
    spawn(_how_started, 2, "HOME", timeout_s=60)
    monkeypatch.setenv("LAUNCH_TEST_VALUE", "set after the server started")
    out = spawn(_how_started, 2, "LAUNCH_TEST_VALUE", timeout_s=60)
    assert all(o["value"] == "set after the server started" for o in out), out
    # (a server started by an earlier spawn under other load-time variables, STPC_* or TORCH*
    # set by a test around it, sends every later call to new interpreters: launch._server_env)
    assert all(o["parent"] != os.getpid() for o in out) and len({o["parent"] for o in out}) == 1, out


def test_a_variable_read_at_load_starts_the_ranks_as_new_interpreters():
    """glibc reads MALLOC_* when a process starts, which a rank forked from the server never
    does: with one that differs from the server's, the ranks are this process's children
    (new interpreters) and have it."""
    spawn(_how_started, 2, "HOME", timeout_s=60)  # (the server runs)
    out = spawn(_how_started, 2, "MALLOC_ARENA_MAX", timeout_s=60, env={"MALLOC_ARENA_MAX": "2"})
    assert all(o["parent"] == os.getpid() and o["value"] == "2" for o in out), out
    assert "MALLOC_ARENA_MAX" not in os.environ  # (this process's environment as it was)


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        spawn(_allreduce_rank, 0, 0)


def test_spawn_names_the_backends_it_takes():
    with pytest.raises(ValueError, match="backend must be 'gloo', 'nccl' or per device"):
        spawn(_allreduce_rank, 1, 0, backend="mpi")


def _cpu_device_type(rank, world):
    from stpc import validate
    return validate.world_device_type()


def test_spawn_takes_a_per_device_backend():
    # the string init_process_group takes; a CPU world stays a CPU world under it
    assert spawn(_cpu_device_type, 2, backend="cpu:gloo", timeout_s=60) == ["cpu", "cpu"]


_LAUNCHER = '''
import os, sys, time
from stpc.runtime.launch import spawn


def sleeper(rank, world_size, where):
    with open(os.path.join(where, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


if __name__ == "__main__":
    spawn(sleeper, 2, sys.argv[1], timeout_s=600)
'''


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie not yet reaped counts as ended)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
def test_ranks_die_with_a_launcher_killed_by_a_signal(tmp_path):
    """A launcher SIGKILLed mid-run (no clean-up of its own can run) leaves no rank behind:
    each asked the kernel to kill it when its parent dies."""
    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        pids = []
        while time.monotonic() < deadline and len(pids) < 2:
            pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid") if p.read_text()]
            time.sleep(0.2)
        assert len(pids) == 2, "the ranks did not start"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(_gone(p) for p in pids):
            time.sleep(0.2)
        assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]
    finally:
        proc.kill()
        for p in tmp_path.glob("rank*.pid"):  # (only a rank still there: a pid reused since is not ours)
            pid = int(p.read_text() or 0)
            if pid and not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_rank_whose_launcher_is_gone_exits_at_once():
    """A rank whose parent died before it asked to die with it (its parent is another
    process by then) exits at once, with code 1."""
    code = ("from stpc.runtime.launch import _die_with_parent; import os; "
            "_die_with_parent(os.getppid() + 1 if os.getppid() != 1 else 2); print('still here')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "still here" not in done.stdout
    # and with its launcher alive, it goes on
    code = "from stpc.runtime.launch import _die_with_parent; import os; _die_with_parent(os.getppid()); print('on')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "on", done.stderr
