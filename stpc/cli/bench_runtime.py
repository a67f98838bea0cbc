"""``python -m stpc bench runtime``: stpc's programs against torch's own engines, side by side.

The same model, data, optimizer (AdamW, ``--optimizer-impl``: fused by default, TorchTitan's
default) and ranks for every engine; each pair
runs one layout both ways (where torch runs sequence parallelism, stpc runs it too,
``Layout.sp``: its presets otherwise leave that layout to the solver, op by op, and the
pair would compare two layouts):

==================  ======================================  =========================================
pair                stpc                                    torch (``stpc.cli.bench_engines``)
==================  ======================================  =========================================
data parallel       the ``dp`` preset on mesh (N,)          ``DistributedDataParallel``
tensor parallel     ``megatron`` at dp 1 x tp N, SP        ``parallelize_module`` TP+SP, loss_parallel
fsdp                ``fsdp-tp`` at dp N x tp 1 (ZeRO-3)     FSDP2 ``fully_shard`` per block
fsdp + tp           ``fsdp-tp`` at dp N/2 x tp 2, SP        FSDP2 over dp, TP+SP over tp (TorchTitan)
solved              stpc's own plan (its search, N devices) the fastest of the torch engines
==================  ======================================  =========================================

Every engine is built on every rank in one process, and the steps are interleaved (one step
of each engine per round, the order rotating every round) so the machine's drift hits all
alike. A step is ``zero_grad; forward; backward; optimizer.step`` between two barriers;
its time is the slowest rank's. Reported: the median over ``--steps`` rounds after
``--warmup``; the step's work, each the mean over ranks: CPU time (user + system, every
thread of the process) and minor page faults (``--allocator`` says how the ranks' malloc
treats freed memory, for every engine alike); and per engine the peak memory of one step on the worst rank: the bytes live
at its start (parameters, optimizer state, persistent engine buffers such as DDP's
gradient buckets) plus the highest level the CPU allocator reached during the step
(``torch.profiler`` memory events, every allocation through c10 included). All engines
start from the same weights and data: their first losses must agree, and after as many
steps on each their last losses too (checked: a program that computes a wrong gradient has
its first loss right).

Targets (issue 17): each stpc preset within 5% of its torch counterpart's step time (or
faster), the solved plan no slower than the fastest counterpart, memory no higher than the
counterpart's. A target is judged on the medians; beside each ratio, the rounds in which
stpc's step was the faster and a two-sided sign test over them (``_stats``, as the fidelity
bench orders plans) say whether the run separates the two engines at all: the solved row and
the data parallel row, one program measured twice in one run, have differed by 3.5% in their
medians.
"""
from __future__ import annotations

import copy
import math
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from stpc.cli._common import Parser, add_flags, verb, write_json
from stpc.cli._progress import bar
from stpc.cli._stats import SIGN_TEST_P, paired_rounds
from stpc.cli.bench_engines import Engine, build_engine
from stpc.compile import compile as stpc_compile
from stpc.cost_models import OPTIMIZER_IMPLS
from stpc.frontend import models
from stpc.planner.baselines import Layout, layout_hints
from stpc.planner.summary import strategy_label
from stpc.runtime.launch import spawn

TIME_TARGET = 1.05   # stpc step time / torch's, at most (issue 17)

# ``--allocator``: how the ranks' C allocator (glibc's) treats freed memory, for every engine alike
ALLOCATORS = {
    "system": "glibc's defaults: a block over its mmap threshold (128 KiB, raised to the largest freed "
              "up to 32 MiB) is mapped fresh and handed back when freed, and the heap's free top trimmed",
    "keep": "glibc told to keep freed memory for reuse, as a caching allocator does: MALLOC_MMAP_THRESHOLD_"
            "=128 MiB and MALLOC_TRIM_THRESHOLD_=4 GiB for every rank (a freed block too small for the next "
            "request still leaves it to fresh pages: torch asks for its CPU tensors aligned, which splits blocks)",
}
_KEEP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(4 * 2**30)}


# ``--optimizer-impl``: the AdamW implementation every engine steps with (and stpc's plans are
# costed for). Fused by default: TorchTitan's (its optimizer config's ``implementation``), one
# pass over each element where foreach makes eight (``cost_models.compute``), so the fastest
# for every engine here: the dp pair's optimizer took 102 ms (stpc) and 99 ms (DDP) a step
# foreach, 33 and 29 ms fused, in two runs of this bench five minutes apart in the
# fifty-seventh session (its paragraph in benchmarks/RESULTS.md).
OPTIMIZER_IMPL = "fused"


def make_optimizer(params, impl: str = OPTIMIZER_IMPL) -> torch.optim.AdamW:
    """The benches' AdamW (lr 1e-4) over ``params`` in implementation ``impl``
    (``cost_models.OPTIMIZER_IMPLS``: ``foreach=True``, ``fused=True``, or ``"single"``, the
    per-tensor loop)."""
    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"unknown AdamW implementation {impl!r}; one of {', '.join(OPTIMIZER_IMPLS)}")
    return torch.optim.AdamW(params, lr=1e-4, **({"foreach": False} if impl == "single" else {impl: True}))


def add_optimizer_flag(ap, what: str) -> None:
    """``--optimizer-impl`` on a bench's parser (``what``: who steps with it, alike)."""
    ap.add_argument("--optimizer-impl", choices=OPTIMIZER_IMPLS, default=OPTIMIZER_IMPL,
                    help=f"the AdamW implementation {what} steps with, and stpc's plans are costed for: fused "
                         f"(AdamW(fused=True), TorchTitan's default), foreach, single (the per-tensor loop) "
                         f"(default: %(default)s)")


def allocator_env(allocator: str) -> dict[str, str]:
    """The environment the ranks start with for ``--allocator`` (:data:`ALLOCATORS`): glibc
    reads these variables once, when a process starts, so they go to ``spawn``."""
    return dict(_KEEP_ENV) if allocator == "keep" else {}


def add_allocator_flag(ap, what: str) -> None:
    """``--allocator`` on a bench's parser (``what``: whom it applies to, alike)."""
    ap.add_argument("--allocator", choices=sorted(ALLOCATORS), default="system",
                    help=f"the ranks' malloc, for {what} alike: system (glibc's defaults) or keep (glibc keeps "
                         f"freed memory for reuse instead of returning it to the system; default: system)")


def malloc_env() -> dict[str, str | None]:
    """This process's glibc malloc variables of ``--allocator keep`` (a rank reports them)."""
    return {k: os.environ.get(k) for k in _KEEP_ENV}


def check_malloc_env(seen: dict, allocator: str, verb: str) -> None:
    """Raise unless the ranks started with ``allocator``'s variables (``system``: whatever this
    process has), as rank 0 reported them (:func:`malloc_env`)."""
    env = allocator_env(allocator)
    expected = {k: env.get(k, os.environ.get(k)) for k in _KEEP_ENV}
    if seen != expected:
        raise RuntimeError(f"{verb}: --allocator {allocator}: the ranks started with {seen}, not {expected}")


class StpcEngine(Engine):
    """An stpc-compiled model in the benchmark's engine interface."""

    def __init__(self, name: str, layout: str, model, idx, tgt):
        super().__init__(name, layout, model, idx, tgt)

    def forward_backward(self) -> torch.Tensor:
        loss = self.model(self.idx, self.tgt)
        loss.backward()
        return loss.detach()


def _stpc_engine(label: str, spec: dict, model, idx, tgt, n: int, cluster=None,
                 optimizer_impl: str = OPTIMIZER_IMPL) -> StpcEngine:
    if "layout" in spec:
        preset, layout = spec["layout"]
        pm = stpc_compile(model, layout.mesh_shape, (idx, tgt), hints=layout_hints(preset, layout), cache=False,
                          cluster=cluster, optimizer_impl=optimizer_impl)
        where = f"{preset} {layout.describe()}"
    else:
        pm = stpc_compile(model, spec.get("mesh", n), (idx, tgt), hints=spec.get("hints"), cache=False,
                          cluster=cluster, optimizer_impl=optimizer_impl)
        where = f"{spec.get('hints') or 'solved'} on mesh {'x'.join(map(str, pm.stpc.plan.mesh_shape))}"
    counts = pm.stpc.plan.strategy_counts()
    fams = ", ".join(f"{k} {v}" for k, v in counts.items())
    return StpcEngine(label, f"{where} ({fams}; costed on {pm.stpc.plan.cluster})", pm, idx, tgt)


def pairs(n: int) -> list[tuple[str, dict, str | None, tuple]]:
    """(pair, stpc spec, torch engine, torch mesh) of the benchmark on ``n`` ranks."""
    out = [("data parallel", {"hints": "dp", "mesh": (n,)}, "ddp", (n,)),
           ("tensor parallel", {"layout": ("megatron", Layout(1, n, "-", sp=True))}, "tp", (n,)),
           ("fsdp", {"layout": ("fsdp-tp", Layout(n, 1, "-", 3))}, "fsdp", (n,))]
    if n % 2 == 0 and n > 2:
        out.append(("fsdp + tp", {"layout": ("fsdp-tp", Layout(n // 2, 2, "dp-outer", 3, sp=True))}, "fsdp-tp",
                    (n // 2, 2)))
    out.append(("solved", {}, None, ()))
    return out


def _live_storages(engine: Engine, opt) -> dict[int, int]:
    """The distinct storages of the parameters, buffers, gradients and optimizer state, and
    the gradient buckets an stpc program's reducer keeps between steps (``keep_buffers``: no
    parameter holds them after ``zero_grad``): their data pointers and bytes."""
    seen: dict[int, int] = {}

    def add(t):
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()

    for p in engine.model.parameters():
        add(p.detach())
        if p.grad is not None:
            add(p.grad)
    for b in engine.model.buffers():
        add(b)
    for state in opt.state.values():
        for v in state.values():
            add(v)
    compiled = getattr(engine.model, "stpc", None)
    for prog in getattr(compiled, "programs", {}).values():
        for b in (prog.reducer.buckets if prog.reducer is not None else ()):
            add(b.spare)
    return seen


def _live_bytes(engine: Engine, opt) -> int:
    """Bytes of the distinct storages alive between steps: parameters, buffers, gradients,
    optimizer state, and DDP's gradient buckets (allocated by its C++ reducer at
    construction; their sizes are read from DDP's own logging data)."""
    total = sum(_live_storages(engine, opt).values())
    if hasattr(engine.model, "_get_ddp_logging_data"):
        total += sum(int(x) for x in str(engine.model._get_ddp_logging_data().get("bucket_sizes", "")).split(", ")
                     if x.strip())
    return total


def memory_timeline(prof, alive_at_end: set[int], marker: str = "fidelity::") -> tuple[list[tuple[int, int]], int]:
    """Every allocation (+bytes) and free (-bytes) of a profiled step, in time order, and
    the bytes of the blocks whose free the profiler did not see.

    The profiler records an allocator event only on a thread that has its state: a block
    whose last reference dies on a collective's worker thread (gloo's, which holds a
    collective's tensors until it is done with the work, and on an oversubscribed CPU may
    be descheduled past the main thread's wait) is freed with no event, and a running sum
    would hold it to the step's end: 16 or 32 MiB more on one rank in one step, never the
    same one twice. A block with no free is therefore taken as freed at the end of the
    top-level op that allocated it (``marker`` names phase spans that are not ops), or
    where the allocator hands its address out again if that comes first, unless its
    storage is alive after the step (``alive_at_end``: a gradient, optimizer state).
    For a collective waited in the op that issued it (a reshard's all-to-all, a gather)
    that is where gloo lets it go. For one issued in one op and waited in a later one (a
    ZeRO-3 layer's gradient reduce-scatter, the next layer's prefetched gather), its input
    lives until that wait and is counted freed too early: a lower bound there, and only
    the address's reuse an upper one."""
    allocs = []  # (time, ptr, bytes, end of its top-level op)

    def walk(node, top_end):
        kind, fields = node.typed
        if kind == _EventType.Allocation:
            allocs.append((node.start_time_ns, fields.ptr, fields.alloc_size, top_end or node.start_time_ns))
            return
        if top_end is None and not node.name.startswith(marker):
            top_end = node.end_time_ns
        for c in node.children:
            walk(c, top_end)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, None)
    allocs.sort(key=lambda a: a[0])
    out, open_blocks, unseen = [], {}, 0
    for t, ptr, size, top_end in allocs:
        if size > 0 and ptr in open_blocks:  # its address handed out again: the old block was freed
            old, old_end = open_blocks.pop(ptr)
            out.append((min(old_end, t), -old))
            unseen += old
        if size > 0:
            open_blocks[ptr] = (size, top_end)
        else:
            open_blocks.pop(ptr, None)
        out.append((t, size))
    for ptr, (size, top_end) in open_blocks.items():
        if ptr not in alive_at_end:
            out.append((top_end, -size))
            unseen += size
    out.sort(key=lambda e: e[0])
    return out, unseen


def interleaved(n: int, warmup: int, steps: int, desc: str, show: bool):
    """``(round, engine)`` pairs: each of ``n`` engines once per round for ``warmup + steps``
    rounds, the order rotated every round so no engine always goes first (the machine's
    drift hits all alike); a progress bar on the rounds."""
    rounds_bar = bar(warmup + steps, desc, show)
    for r in range(warmup + steps):
        rounds_bar.set_postfix_str("warm-up" if r < warmup else "timed", refresh=False)
        rounds_bar.update()
        for k in range(n):
            yield r, (r + k) % n
    rounds_bar.close()

def _step(engine: Engine, opt) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = engine.forward_backward()
    opt.step()
    return loss


def timed_step(engine: Engine, opt) -> tuple[torch.Tensor, list[float]]:
    """:func:`_step` with a clock between its parts, every rank from a barrier: (the loss,
    [step, forward + backward, optimizer step] seconds, each the slowest rank's, then the
    step's CPU seconds (user + system, every thread of the process: the backend's too) and
    minor page faults, each the mean over ranks). On a machine with fewer cores than ranks
    the CPU time is the work a step asks of the cores, which its wall time follows; the
    faults are first touches of memory the allocator got fresh from the system."""
    dist.barrier()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = engine.forward_backward()
    t1 = time.perf_counter()
    opt.step()
    t2, r2 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    dt = torch.tensor([t2 - t0, t1 - t0, t2 - t1], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    work = torch.tensor([r2.ru_utime - r0.ru_utime + r2.ru_stime - r0.ru_stime, r2.ru_minflt - r0.ru_minflt],
                        dtype=torch.float64)
    dist.all_reduce(work)
    return loss, dt.tolist() + (work / dist.get_world_size()).tolist()


def _peak_of_step(engine: Engine, opt) -> int:
    """Live bytes at the step's start (after ``zero_grad``) plus the highest the allocator
    climbed during the step (``memory_timeline``). (The profiler reports no free of a block
    allocated before it started: the gradients are dropped before it starts, or they would
    count twice.)"""
    opt.zero_grad(set_to_none=True)
    base = _live_bytes(engine, opt)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.forward_backward()
        opt.step()
    level = peak = 0
    for _, nbytes in memory_timeline(prof, set(_live_storages(engine, opt)))[0]:
        level += nbytes
        peak = max(peak, level)
    return base + peak


def _worker(rank: int, world: int, cfg: dict) -> dict:
    torch.manual_seed(0)
    base = models.build(cfg["model"], n_layers=cfg["layers"])
    g = torch.Generator().manual_seed(1)
    vocab = base.cfg.vocab
    idx = torch.randint(0, vocab, (cfg["batch"], cfg["seq"]), generator=g)
    tgt = torch.randint(0, vocab, (cfg["batch"], cfg["seq"]), generator=g)
    engines: list[tuple[str, str, Engine]] = []  # (pair, side, engine)
    impl = cfg.get("optimizer_impl", OPTIMIZER_IMPL)
    for label, spec, torch_name, mesh in pairs(world):
        engines.append((label, "stpc", _stpc_engine(label, spec, copy.deepcopy(base), idx, tgt, world,
                                                    cfg.get("cluster"), impl)))
        if torch_name:
            engines.append((label, "torch", build_engine(torch_name, copy.deepcopy(base), idx, tgt, mesh)))
    opts = [make_optimizer(e.parameters(), impl) for _, _, e in engines]
    times = [[] for _ in engines]
    first_loss = [None] * len(engines)
    last_loss = [None] * len(engines)  # after as many steps on every engine: one training, one loss
    for r, i in interleaved(len(engines), cfg["warmup"], cfg["steps"], "[bench runtime] rounds",
                            bool(cfg.get("progress")) and rank == 0):
        loss, dt = timed_step(engines[i][2], opts[i])
        last_loss[i] = float(loss)
        if r == 0:
            first_loss[i] = last_loss[i]
        if r >= cfg["warmup"]:
            times[i].append(dt)
    peaks = []
    for i, (_, _, e) in enumerate(engines):
        dist.barrier()
        p = torch.tensor([_peak_of_step(e, opts[i])], dtype=torch.float64)
        dist.all_reduce(p, op=dist.ReduceOp.MAX)
        peaks.append(int(p))
    if rank != 0:
        return {}
    return {"malloc_env": malloc_env(),
            "engines": [{"pair": pair, "side": side, "name": e.name, "layout": e.layout,
                         "median_step_s": statistics.median(t[0] for t in times[i]),
                         "steps_s": [t[0] for t in times[i]],
                         "median_fwd_bwd_s": statistics.median(t[1] for t in times[i]),
                         "median_optimizer_s": statistics.median(t[2] for t in times[i]),
                         "median_cpu_s": statistics.median(t[3] for t in times[i]),
                         "median_faults": statistics.median(t[4] for t in times[i]),
                         "peak_bytes": peaks[i], "first_loss": first_loss[i], "last_loss": last_loss[i],
                         **_modelled(e),
                         **({"differs_from": _deltas(engines)} if (pair, side) == ("solved", "stpc") else {})}
                        for i, (pair, side, e) in enumerate(engines)]}


def plan_delta(a, b) -> list[str]:
    """Where stpc's plan ``b`` differs from ``a``, op by op: each decision node (a tied copy
    once) whose strategy differs, ``"node: a's -> b's"``, then one entry counting the
    parameters whose placement differs. Empty: the same program."""
    out = []
    for name, n in a.nodes.items():
        m = b.nodes.get(name)
        if (n.role == "decision" and not n.tied_to and m is not None and m.role == n.role
                and strategy_label(m) != strategy_label(n)):
            out.append(f"{name}: {strategy_label(n)} -> {strategy_label(m)}")
    params = sum(1 for name, n in a.nodes.items() if n.role == "param" and name in b.nodes
                 and tuple(b.nodes[name].out) != tuple(n.out))
    if params:
        out.append(f"{params} parameter placement{'s' if params > 1 else ''}")
    if tuple(a.mesh_shape) != tuple(b.mesh_shape):
        out.insert(0, f"mesh {'x'.join(map(str, a.mesh_shape))} -> {'x'.join(map(str, b.mesh_shape))}")
    return out


def _deltas(engines) -> dict:
    """For the solved row's stpc engine: per other stpc row, :func:`plan_delta` from that row's
    plan to the solved plan (what the solved note says when the two measure alike)."""
    plans = {pair: e.model.stpc.plan for pair, side, e in engines if side == "stpc"}
    solved = plans.get("solved")
    return {} if solved is None else {pair: plan_delta(p, solved) for pair, p in plans.items() if pair != "solved"}


def _modelled(engine: Engine) -> dict:
    """An stpc engine's plan's modelled step time and peak (its cost model's, on the cluster its
    row names), to stand beside the measured ones; nothing for a torch engine."""
    plan = engine.model.stpc.plan if isinstance(engine, StpcEngine) else None
    if plan is None:
        return {}
    return {"modelled_step_s": float(plan.modelled_step_time_s), "modelled_peak_bytes": float(plan.peak_memory_bytes)}


def evaluate(records: list[dict]) -> list[dict]:
    """One row per pair: stpc against its counterpart (the solved plan against the fastest
    torch engine), with the ratios and whether each target is met."""
    torch_side = [r for r in records if r["side"] == "torch"]
    fastest = min(torch_side, key=lambda r: r["median_step_s"]) if torch_side else None
    rows = []
    for r in records:
        if r["side"] != "stpc":
            continue
        other = next((t for t in torch_side if t["pair"] == r["pair"]), None) or fastest
        if other is None:
            continue
        ratio = r["median_step_s"] / other["median_step_s"]
        limit = 1.0 if r["pair"] == "solved" else TIME_TARGET
        # the same interleaved rounds, round by round: whether they separate the two at all
        # (one program measured twice in a run has differed by 3.5% in its medians)
        wins, n, p = paired_rounds(r.get("steps_s", []), other.get("steps_s", []))
        rows.append({"pair": r["pair"], "stpc": r, "torch": other, "time_ratio": ratio,
                     "time_met": ratio <= limit, "time_limit": limit,
                     "rounds_stpc_faster": wins, "rounds": n, "sign_test_p": p,
                     "memory_ratio": r["peak_bytes"] / other["peak_bytes"],
                     "memory_met": r["peak_bytes"] <= other["peak_bytes"]})
    return rows


def rounds_note(row: dict) -> str:
    """"; stpc faster in k of n rounds, separated: p 0.01" (or "not separated"): whether the
    interleaved rounds tell the row's two engines apart (the sign test the fidelity bench
    orders plans by); empty where the records hold no rounds."""
    if not row.get("rounds"):
        return ""
    word = "separated" if row["sign_test_p"] < SIGN_TEST_P else "not separated"
    return (f"; stpc faster in {row['rounds_stpc_faster']} of {row['rounds']} rounds, {word}: "
            f"p {row['sign_test_p']:.2g}")


def solved_note(records: list[dict]) -> str:
    """Whether the solved plan is the fastest of stpc's own programs in this run: if so (or if
    the rounds do not separate it from the fastest: a two-sided sign test, as the fidelity
    bench judges its order), its gap to a torch engine is the runtime's; if another stpc
    program is faster in enough rounds, the cost model misranked stpc's plans here."""
    ours = [r for r in records if r["side"] == "stpc"]
    solved = next((r for r in ours if r["pair"] == "solved"), None)
    others = [r for r in ours if r["pair"] != "solved"]
    if solved is None or not others:
        return ""
    best = min(others, key=lambda r: r["median_step_s"])
    wins, n, p = paired_rounds(solved.get("steps_s", []), best.get("steps_s", []))
    rounds = f"the solved plan faster in {wins} of {n} rounds"
    delta = solved.get("differs_from", {}).get(best["pair"])
    if delta is not None:  # what the two programs are: the same plan, or where they differ
        shown = "; ".join(delta[:3]) + (f"; and {len(delta) - 3} more" if len(delta) > 3 else "")
        rounds += (f"; the solved plan is the {best['pair']} program itself" if not delta else
                   f"; the solved plan differs from the {best['pair']} program in {shown}")
    if solved["median_step_s"] <= best["median_step_s"]:
        return (f" In this run it is the fastest of stpc's programs ({solved['median_step_s']:.3f} s; the next, "
                f"the {best['pair']} row's, {best['median_step_s']:.3f} s; {rounds}): the model ranks stpc's own "
                f"plans as they measure, and where the solved plan is slower than a torch engine the gap is the "
                f"runtime's.")
    if p >= SIGN_TEST_P:
        return (f" In this run it and stpc's {best['pair']} program measure alike ({solved['median_step_s']:.3f} "
                f"s against {best['median_step_s']:.3f} s; {rounds}, which a sign test does not separate, p = "
                f"{p:.2f}): where the solved plan is slower than a torch engine the gap is the runtime's.")
    return (f" In this run stpc's {best['pair']} program measured faster than the solved plan "
            f"({best['median_step_s']:.3f} s against {solved['median_step_s']:.3f} s; {rounds}, p = {p:.3f}): "
            f"the model misranks stpc's own plans on this machine (see the fidelity section).")


LOSS_RTOL = 1e-4  # the parity tests' rtol: one training in fp32, summed in other orders


def losses_agree(losses: list[float]) -> bool:
    """Whether ``losses`` are one loss up to fp32 summation order (a NaN or inf never agrees)."""
    return all(math.isfinite(x) for x in losses) and max(losses) - min(losses) <= LOSS_RTOL * abs(min(losses))


def last_losses(records: list[dict]) -> str:
    """", and after N steps each the last ones agree (a .. b)": the same data and optimizer
    for the same number of steps on every engine is one training, so a program that computes a
    wrong gradient (which no first-step loss shows) is seen here. Empty for records without
    them (a JSON from before they were kept)."""
    last = [r.get("last_loss") for r in records]
    if any(x is None for x in last):
        return ""
    word = "agree" if losses_agree(last) else "DISAGREE: an engine trains differently"
    return f"; after the same steps on each, the last losses {word} ({min(last):.6f} .. {max(last):.6f})"


def report(cfg: dict, records: list[dict], machine: str, command: str) -> str:
    rows = evaluate(records)
    losses = [r["first_loss"] for r in records]
    agree = losses_agree(losses)
    lines = [
        "## Runtime: stpc against torch's own engines (issue 17)", "",
        f"Command: `{command}`", "", machine, "",
        f"Model `{cfg['model']}` cut to {cfg['layers']} layers, global batch {cfg['batch']} x seq {cfg['seq']}, "
        f"fp32, AdamW ({cfg.get('optimizer_impl', 'foreach')}), {cfg['ranks']} gloo ranks on this machine "
        f"(one intra-op thread each). "
        f"Interleaved: {cfg['warmup']} warm-up rounds, then the median of {cfg['steps']} rounds; a step's time "
        f"is the slowest rank's. Peak memory: one step on the worst rank (live bytes at its start + the "
        f"allocator's highest climb during it). First-step losses of all engines "
        f"{'agree' if agree else 'DISAGREE'} ({min(losses):.6f} .. {max(losses):.6f}){last_losses(records)}.", "",
        "| pair | stpc (plan) | torch | stpc step s | stpc step s, modelled | torch step s | stpc / torch | "
        "rounds stpc faster (sign test p) | target | met | stpc peak MiB | stpc peak MiB, modelled | torch peak MiB "
        "| memory met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def rounds_cell(row):
        return f"{row['rounds_stpc_faster']} of {row['rounds']} ({row['sign_test_p']:.2g})" if row["rounds"] else "-"

    def modelled(r, key, scale, fmt):
        return format(r[key] / scale, fmt) if r.get(key) is not None else "-"
    for row in rows:
        s, t = row["stpc"], row["torch"]
        lines.append(f"| {row['pair']} | {s['layout']} | {t['name']} ({t['layout']}) | {s['median_step_s']:.3f} | "
                     f"{modelled(s, 'modelled_step_s', 1, '.3f')} | "
                     f"{t['median_step_s']:.3f} | {row['time_ratio']:.3f} | {rounds_cell(row)} | "
                     f"<= {row['time_limit']:.2f} | "
                     f"{'yes' if row['time_met'] else 'NO'} | {s['peak_bytes'] / 2**20:.1f} | "
                     f"{modelled(s, 'modelled_peak_bytes', 2**20, '.1f')} | "
                     f"{t['peak_bytes'] / 2**20:.1f} | {'yes' if row['memory_met'] else 'NO'} |")
    lines.append("")
    parts = [row for row in rows if "median_fwd_bwd_s" in row["stpc"] and "median_fwd_bwd_s" in row["torch"]]
    if parts:  # where each side's step goes (medians of the same rounds, each the slowest rank's)
        lines += ["Where the step goes (medians over the same rounds; each part the slowest rank's, so the parts "
                  "need not add up to the step):", "",
                  "| pair | stpc forward + backward s | torch forward + backward s | stpc / torch | stpc optimizer s "
                  "| torch optimizer s | stpc / torch |", "|---|---|---|---|---|---|---|"]
        for row in parts:
            s_, t = row["stpc"], row["torch"]
            lines.append(f"| {row['pair']} | {s_['median_fwd_bwd_s']:.3f} | {t['median_fwd_bwd_s']:.3f} | "
                         f"{s_['median_fwd_bwd_s'] / t['median_fwd_bwd_s']:.3f} | {s_['median_optimizer_s']:.4f} | "
                         f"{t['median_optimizer_s']:.4f} | {s_['median_optimizer_s'] / t['median_optimizer_s']:.3f} |")
        lines.append("")
    work = [row for row in rows if "median_cpu_s" in row["stpc"] and "median_cpu_s" in row["torch"]]
    if work:  # what the step asks of the cores (CPU time of every thread) and fresh pages touched
        lines += [f"The work of a step (medians over the same rounds, each the mean over ranks): CPU seconds, user + "
                  f"system, of every thread of a rank's process (the backend's included), and the minor page faults, "
                  f"first touches of memory the allocator took fresh from the system ({ALLOCATORS[cfg.get('allocator', 'system')]}):",
                  "", "| pair | stpc CPU s | torch CPU s | stpc / torch | stpc page faults | torch page faults |",
                  "|---|---|---|---|---|---|"]
        for row in work:
            s_, t = row["stpc"], row["torch"]
            lines.append(f"| {row['pair']} | {s_['median_cpu_s']:.3f} | {t['median_cpu_s']:.3f} | "
                         f"{s_['median_cpu_s'] / t['median_cpu_s']:.3f} | {s_['median_faults']:.0f} | "
                         f"{t['median_faults']:.0f} |")
        lines.append("")
    missed = [r for r in rows if not (r["time_met"] and r["memory_met"])]
    lines.append("What differs between the two sides, by construction (the code, not this run): stpc's "
                 "ZeRO/FSDP programs, like FSDP2, free a layer's gathered weights after forward and gather "
                 "them again in backward (the previous layer's issued ahead; the head's, after the last layer, "
                 "kept for its backward, as FSDP2 keeps its root module's), but the gathers are stpc's own "
                 "coalesced per-layer collectives on DTensor shards; stpc computes the global mean loss inside the "
                 "step (a scalar all-reduce issued at the end of forward and waited where the loss is first read, "
                 "not before backward; the target count's issued at the step's start) where the torch engines "
                 "reduce the loss after backward; stpc's parameters are DTensors for every plan, DDP's are plain tensors "
                 "(so the optimizer's ops go through DTensor's dispatch on stpc's side, as on FSDP2's); "
                 "stpc's gradient buckets are kept from step to step, as DDP keeps its own, where the plan's device "
                 "hands freed memory back to the system (a CPU under glibc's malloc, where buckets made in each "
                 "backward were paged in again every step; `cost_models.keeps_grad_buckets`, and the plan's memory "
                 "holds them through forward), else made in each backward and freed with the gradients. The "
                 "solved plan is the one stpc's cost model ranks first on the cluster named in its row."
                 + solved_note(records))
    lines.append("")
    lines.append(f"Targets met: {len(rows) - len(missed)} of {len(rows)} rows."
                 + ("" if not missed else " Missed: " + "; ".join(
                     f"{r['pair']} ({'time ' + format(r['time_ratio'], '.3f') + rounds_note(r) if not r['time_met'] else ''}"
                     f"{', ' if not r['time_met'] and not r['memory_met'] else ''}"
                     f"{'memory ' + format(r['memory_ratio'], '.3f') if not r['memory_met'] else ''})" for r in missed)))
    return "\n".join(lines) + "\n"


def run(cfg: dict, progress: bool = False) -> list[dict]:
    """Spawn the ranks and return one record per engine (``progress``: rank 0 draws a bar
    over the rounds on stderr). ``cfg["allocator"] == "keep"``: the ranks start with glibc's
    malloc keeping freed memory (:data:`ALLOCATORS`; the environment a process starts with
    is the only place glibc reads it from)."""
    env = allocator_env(cfg.get("allocator", "system"))
    out = spawn(_worker, cfg["ranks"], {**cfg, "progress": progress}, timeout_s=cfg.get("timeout_s", 1800), env=env)
    check_malloc_env(out[0]["malloc_env"], cfg.get("allocator", "system"), "bench runtime")
    return out[0]["engines"]


@verb
def main_runtime(argv: list[str], machine_line, write_section) -> int:
    ap = Parser("python -m stpc bench runtime", __doc__)
    add_flags(ap, {"model": {"default": "gpt-50m", "zoo": True}, "layers": {"default": 2}, "batch": {"default": 8},
                   "seq": {"default": 256}, "ranks": {"default": 4},
                   "steps": {"default": 10, "note": "timed rounds, each one step of every engine"},
                   "cluster": {"shown": "the world's: this machine's profile if there is one, else cpu-local"},
                   "timeout": {"default": 1800.0, "shown": "1800"},
                   "json": {"shown": "none", "note": "one record per engine, and the rows"}})
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default: 3)")
    add_allocator_flag(ap, "every engine")
    add_optimizer_flag(ap, "every engine")
    ap.add_argument("--results", help="regenerate this markdown file's runtime section (e.g. benchmarks/RESULTS.md)")
    args = ap.parse_args(argv)
    if args.warmup < 0:
        ap.error(f"--warmup {args.warmup}: give 0 or more")
    cfg = {k: getattr(args, k) for k in ("model", "layers", "batch", "seq", "ranks", "steps", "warmup", "cluster",
                                         "allocator", "optimizer_impl")}
    cfg["timeout_s"] = args.timeout
    records = run(cfg, progress=not args.quiet)
    command = "python -m stpc bench runtime " + " ".join(argv)
    text = report(cfg, records, machine_line(), command.strip())
    print(text.rstrip("\n").splitlines()[-1] if args.quiet else text)
    if args.json:
        write_json(args.json, {"config": cfg, "engines": records, "rows": [
            {k: v for k, v in r.items() if k not in ("stpc", "torch")} | {"stpc": r["stpc"]["name"],
                                                                        "torch": r["torch"]["name"]}
            for r in evaluate(records)]})
    if args.results:
        write_section(args.results, "runtime", text)
    return 0


__all__ = ["solved_note", "rounds_note", "main_runtime", "OPTIMIZER_IMPL", "make_optimizer", "add_optimizer_flag", "ALLOCATORS", "add_allocator_flag", "allocator_env", "malloc_env", "check_malloc_env", "pairs", "evaluate", "report", "run", "StpcEngine"]
