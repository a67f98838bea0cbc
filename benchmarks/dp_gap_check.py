"""Where stpc's data-parallel program loses to DDP, taken apart by measurement.

    .venv/bin/python benchmarks/dp_gap_check.py [--ranks 4] [--steps 20] [--json FILE]
                                                [--results benchmarks/RESULTS.md]

The runtime bench (``python -m stpc bench runtime``) runs stpc's ``dp`` program beside
torch's ``DistributedDataParallel`` on the same model, data and ranks, and the solved plan is
that program on the development VM, so its row's target (no slower than DDP) rests on this
pair. Two differences are built in (the bench's "by construction" paragraph), and a third
is when the gradients go out; this script times each one alone, with the bench's model, data, optimizer, ranks and step
(``stpc.cli.bench_runtime.timed_step``), interleaved in one run so the machine's drift hits
all alike:

* the gradient buckets. DDP keeps its buckets allocated from step to step; so does stpc's
  reducer where the plan's device hands freed memory back to the system (a CPU:
  ``cost_models.keeps_grad_buckets``, ``GradReducer(keep_buffers=True)``), and elsewhere it
  allocates them in each backward and frees them with the gradients. The same stpc program
  is run twice, its buckets made in each backward and kept, with DDP as the third engine.
  Their step times and parts, page faults and peak memory (the bench's measure, the kept
  buffers included);
* when the gradients go out. The program reads each parameter where it first uses
  it (``passes.read_params_at_use``), so backward hands a layer's gradients to the reducer
  as soon as they are made and the buckets' all-reduces overlap the rest of backward. A
  fifth engine is the same program with its parameters read at the step's start (the
  pipeline without that last pass), where every gradient reached the reducer only after all
  of backward. Both record, on rank 0, when forward ended, when each bucket was launched and
  when backward ended (``GradReducer.launch_at`` / ``finish_at``), in ms from the step's
  start;
* the parameters as DTensors. stpc's parameters are DTensors (the product's promise:
  optimizers, ``state_dict`` and DCP see sharded tensors), DDP's plain tensors. A fourth
  engine runs the same program again, buckets kept, with every parameter swapped for a plain
  ``nn.Parameter`` of its local tensor before its first call (the dp program replicates
  every parameter, so the local tensor is the whole one; tied parameters stay tied; the
  program reads a plain parameter as it is and its reducer hooks the plain ones): what is
  left between it and DDP is neither the buckets nor the DTensors. And, in the same rounds,
  AdamW (the bench's, ``--optimizer-impl``) steps two copies of the dp program's parameters and
  gradients alone: as DTensors, and as plain tensors of the same values. Each step timed
  from a barrier on every rank at once, the slowest rank's.

Writes the ``dp-gap`` section of ``--results`` (between its markers, replaced whole).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from stpc.cli._stats import SIGN_TEST_P, paired_rounds
from stpc.cli.bench import machine_line, write_section
from stpc.cli.bench_engines import build_engine
from stpc.cli.bench_runtime import (OPTIMIZER_IMPL, _peak_of_step, _stpc_engine, add_optimizer_flag, interleaved,
                                    last_losses, make_optimizer, timed_step)
from stpc.frontend import models
from stpc.runtime.launch import spawn

ENGINES = ("stpc dp (buckets made in each backward)", "stpc dp (buckets kept, DDP's way; as shipped on a CPU)",
           "stpc dp (buckets kept, plain-tensor parameters)", "ddp",
           "stpc dp (buckets made in each backward, parameters read at the step's start, before "
           "read_params_at_use)")
KEPT = (1, 2)  # the engines whose reducers keep their buffers (the others make them in each backward)
STAMPED = (0, 4)  # the engines whose bucket launches are timed: read where used, and at the start
PARTS = ("step", "fwd_bwd", "optimizer", "cpu", "faults")


@contextlib.contextmanager
def _reads_at_start():
    """``stpc.compile`` builds its programs without ``read_params_at_use`` (every parameter's
    local tensor read in the feed, at the step's start, as before that pass) while inside."""
    module = importlib.import_module("stpc.compile")
    original = module.run_passes
    module.run_passes = lambda *a, **k: original(*a, **{**k, "read_at_use": False})
    try:
        yield
    finally:
        module.run_passes = original


class _Stamps:
    """``engine.forward_backward`` with a clock: the step's start and forward's end (rank 0
    reads the reducers' launch and finish stamps against them)."""

    def __init__(self, engine):
        self.engine, self.start, self.forward_end = engine, 0.0, 0.0
        engine.forward_backward = self

    def __call__(self):
        self.start = time.perf_counter()
        loss = self.engine.model(self.engine.idx, self.engine.tgt)
        self.forward_end = time.perf_counter()
        loss.backward()
        return loss.detach()

    def offsets_ms(self) -> dict:
        (red,) = _reducers(self.engine)
        return {"forward_end": (self.forward_end - self.start) * 1e3,
                "launches": [(t - self.start) * 1e3 for t in red.launch_at],
                "backward_end": (red.finish_at - self.start) * 1e3}


def _reducers(engine):
    return [prog.reducer for prog in engine.model.stpc.programs.values() if prog.reducer is not None]


def _plain_parameters(engine) -> None:
    """Swap each of ``engine``'s DTensor parameters for a plain ``nn.Parameter`` of its local
    tensor (the same storage), every module attribute that held it, so tied ones stay tied.
    Only for a program that replicates every parameter: there the local tensor is the whole."""
    new: dict[int, torch.nn.Parameter] = {}
    for module in engine.model.modules():
        for name, p in list(module._parameters.items()):
            if not isinstance(p, DTensor):
                continue
            if not all(pl.is_replicate() for pl in p.placements):
                raise ValueError(f"parameter {name} is {p.placements}, not replicated: its local tensor is a piece")
            if id(p) not in new:
                new[id(p)] = torch.nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
            module._parameters[name] = new[id(p)]


def _storage_ptr(t) -> int:
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()


def _optimizer_pair(engine, impl: str):
    """Two AdamW optimizers over copies of ``engine``'s parameters with gradients: the copies
    as DTensors (as stpc holds them) and as plain tensors of the same values."""
    as_dt, plain = [], []
    for p in engine.parameters():
        local = p.to_local().detach()
        grad = p.grad.to_local().detach() if p.grad is not None else torch.ones_like(local) * 1e-3
        q = torch.nn.Parameter(DTensor.from_local(local.clone(), p.device_mesh, p.placements, run_check=False,
                                                  shape=p.shape, stride=p.stride()))
        q.grad = DTensor.from_local(grad.clone(), p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                    stride=p.stride())
        as_dt.append(q)
        r = torch.nn.Parameter(local.clone())
        r.grad = grad.clone()
        plain.append(r)
    return make_optimizer(as_dt, impl), make_optimizer(plain, impl)


def _timed_opt_step(opt) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    opt.step()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def _worker(rank: int, world: int, cfg: dict) -> dict:
    torch.manual_seed(0)
    base = models.build(cfg["model"], n_layers=cfg["layers"])
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, base.cfg.vocab, (cfg["batch"], cfg["seq"]), generator=g)
    tgt = torch.randint(0, base.cfg.vocab, (cfg["batch"], cfg["seq"]), generator=g)
    spec = {"hints": "dp", "mesh": (world,)}
    impl = cfg.get("optimizer_impl", OPTIMIZER_IMPL)
    engines = [_stpc_engine(name, spec, copy.deepcopy(base), idx, tgt, world, cfg.get("cluster"), impl)
               for name in ("fresh", "kept", "plain")] + [
               build_engine("ddp", copy.deepcopy(base), idx, tgt, (world,))]
    _plain_parameters(engines[2])  # before its first call: its reducer is built on the plain ones
    with _reads_at_start():
        engines.append(_stpc_engine("at start", spec, copy.deepcopy(base), idx, tgt, world, cfg.get("cluster"), impl))
    stamps = {i: _Stamps(engines[i]) for i in STAMPED}
    when = {i: [] for i in STAMPED}  # rank 0's offsets, per timed round
    opts = [make_optimizer(e.parameters(), impl) for e in engines]
    times = [[] for _ in engines]
    losses = [None] * len(engines)
    last = [None] * len(engines)  # after as many steps on each: one training, one loss
    opt_pair, opt_times = None, ([], [])
    kept_at: dict[int, set[int]] = {i: set() for i in KEPT}
    for r, i in interleaved(len(engines), cfg["warmup"], cfg["steps"], "[dp gap] rounds", False):
        loss, dt = timed_step(engines[i], opts[i])
        last[i] = float(loss)
        if r == 0:
            losses[i] = last[i]
            # the reducer exists from the first call on: keep its buffers, or not, from now on
            # (whatever the plan's device calls for)
            for red in (_reducers(engines[i]) if hasattr(engines[i].model, "stpc") else ()):  # (not DDP)
                red.keep_buffers = i in KEPT
                if i not in KEPT:
                    for b in red.buckets:
                        b.spare = None
            if i == 0:
                opt_pair = _optimizer_pair(engines[0], impl)
        if r >= cfg["warmup"]:
            times[i].append(dt)
            if i in STAMPED:
                when[i].append(stamps[i].offsets_ms())
            if i in KEPT:  # where a kept engine's gradients lie: one buffer, step after step
                # (no reference kept: a gradient still held is one the reducer must not overwrite)
                kept_at[i].add(_storage_ptr(next(iter(engines[i].parameters())).grad))
            if i == 0:  # the optimizer pair, in the same rounds, the order alternating
                order = (0, 1) if r % 2 else (1, 0)
                for k in order:
                    opt_times[k].append(_timed_opt_step(opt_pair[k]))
    peaks = []
    for i, e in enumerate(engines):
        dist.barrier()
        p = torch.tensor([_peak_of_step(e, opts[i])], dtype=torch.float64)  # (kept buffers included)
        dist.all_reduce(p, op=dist.ReduceOp.MAX)
        peaks.append(int(p))
    if rank:
        return {}
    return {"engines": [{"name": name, "first_loss": losses[i], "last_loss": last[i], "peak_bytes": peaks[i],
                         "rounds": [dict(zip(PARTS, t)) for t in times[i]]} for i, name in enumerate(ENGINES)],
            "optimizer": {"dtensor_s": opt_times[0], "plain_s": opt_times[1]},
            "when": {ENGINES[i]: w for i, w in when.items()},
            "read_at_use": [sum(kind == "param_ref" for prog in engines[i].model.stpc.programs.values()
                                for kind, *_ in prog.feed) for i in STAMPED],
            "kept_buffers_reused": all(len(at) == 1 for at in kept_at.values()),
            "plain_parameters": not any(isinstance(p, DTensor) for p in engines[2].parameters())}


def _faster(a: list[float], b: list[float]) -> str:
    """"faster in k of n rounds" and whether the sign test separates the two (``_stats``)."""
    wins, n, p = paired_rounds(a, b)
    return f"faster in {wins} of {n} rounds, " + ("separated" if p < SIGN_TEST_P else "not separated") + f": p {p:.2g}"


def report(cfg: dict, res: dict, machine: str, command: str) -> str:
    eng = res["engines"]
    med = [{k: statistics.median([r[k] for r in e["rounds"]]) for k in PARTS} for e in eng]
    fresh, kept, plain, ddp, start = med
    steps = [[r["step"] for r in e["rounds"]] for e in eng]
    n = len(steps[0])
    lines = ["## The data-parallel gap, taken apart: stpc's dp program against DDP (issue 17)", "",
             f"Command: `{command}`", "", machine, "",
             f"Model `{cfg['model']}` cut to {cfg['layers']} layer{'s' if cfg['layers'] != 1 else ''}, global batch {cfg['batch']} x seq {cfg['seq']}, "
             f"fp32, AdamW ({cfg.get('optimizer_impl', 'foreach')}), {cfg['ranks']} gloo ranks on this machine, as the "
             f"runtime bench runs its data "
             f"parallel pair (`benchmarks/dp_gap_check.py` says how each part is timed). Interleaved: "
             f"{cfg['warmup']} warm-up rounds, then the median of {n}; a step's time and parts are the slowest "
             f"rank's, CPU seconds and page faults the mean over ranks. First-step losses: "
             + ", ".join(f"{e['first_loss']:.6f}" for e in eng) + last_losses(eng) + ".", "",
             "| engine | step s | forward + backward s | optimizer s | CPU s | page faults | peak MiB | step / DDP's |",
             "|---|---|---|---|---|---|---|---|"]
    for e, m in zip(eng, med):
        lines.append(f"| {e['name']} | {m['step']:.4f} | {m['fwd_bwd']:.4f} | {m['optimizer']:.4f} | {m['cpu']:.3f} | "
                     f"{m['faults']:.0f} | {e['peak_bytes'] / 2**20:.1f} | {m['step'] / ddp['step']:.3f} |")
    opt = res["optimizer"]
    o_dt, o_plain = statistics.median(opt["dtensor_s"]), statistics.median(opt["plain_s"])
    lines += ["", f"AdamW's step alone over the same parameters and gradients (the dp program's, copied), "
                  f"every rank at once, the slowest rank's, median of {len(opt['dtensor_s'])}: as DTensors "
                  f"{o_dt * 1e3:.1f} ms, as plain tensors {o_plain * 1e3:.1f} ms (plain "
                  f"{_faster(opt['plain_s'], opt['dtensor_s'])}).", ""]

    def ms(a, b, part="step"):
        return f"{(a[part] - b[part]) * 1e3:+.1f} ms"

    def parts(a, b):
        return f"forward + backward {ms(a, b, 'fwd_bwd')}, optimizer {ms(a, b, 'optimizer')}"

    lines.append(
        f"Taken apart: with its buckets made in each backward, the program's step is {ms(fresh, ddp)} from DDP's "
        f"({fresh['step'] / ddp['step']:.3f}x). Keeping the buckets (as stpc ships it on a CPU) moves it by "
        f"{ms(kept, fresh)} (kept than fresh: {_faster(steps[1], steps[0])}; "
        f"page faults {fresh['faults']:.0f} -> {kept['faults']:.0f} a step) at "
        f"{(eng[1]['peak_bytes'] - eng[0]['peak_bytes']) / 2**20:+.1f} MiB of peak. Plain-tensor parameters in place "
        f"of the DTensors move the kept program by {ms(plain, kept)} ({parts(plain, kept)}; plain than DTensors: "
        f"{_faster(steps[2], steps[1])}); the optimizer's DTensor dispatch alone costs {(o_dt - o_plain) * 1e3:+.1f} ms "
        f"a step over plain tensors. Left with kept buckets and plain parameters, neither of the two: "
        f"{ms(plain, ddp)} ({plain['step'] / ddp['step']:.3f}x DDP; {parts(plain, ddp)}; plain than DDP: "
        f"{_faster(steps[2], steps[3])}). With DTensor parameters and kept buckets, as stpc ships it on a CPU: "
        f"{ms(kept, ddp)} ({kept['step'] / ddp['step']:.3f}x DDP; kept than DDP: {_faster(steps[1], steps[3])}); "
        f"with buckets made in each backward, than DDP: {_faster(steps[0], steps[3])}.")
    lines += ["", _overlap_sentence(res, fresh, start, steps)]
    return "\n".join(lines) + "\n"


def _when(records: list[dict]) -> str:
    """Rank 0's stamps as one phrase: medians over the rounds, ms from the step's start."""
    launches = [statistics.median(r["launches"][k] for r in records) for k in range(len(records[0]["launches"]))]
    return (f"forward ended at {statistics.median(r['forward_end'] for r in records):.0f}, the "
            f"{len(launches)} buckets went out at {', '.join(f'{t:.0f}' for t in launches)} and backward ended at "
            f"{statistics.median(r['backward_end'] for r in records):.0f}")


def _overlap_sentence(res: dict, fresh: dict, start: dict, steps: list) -> str:
    when = res["when"]
    return (f"When the gradients go out (rank 0, medians over the rounds, ms from the step's start): buckets "
            f"made in each backward, each "
            f"parameter read where first used ({res['read_at_use'][0]} reads), {_when(when[ENGINES[0]])}; with every "
            f"parameter read at the step's start ({res['read_at_use'][1]} reads where used), "
            f"{_when(when[ENGINES[4]])}. Reading them where used moves the step by "
            f"{(fresh['step'] - start['step']) * 1e3:+.1f} ms (forward + backward "
            f"{(fresh['fwd_bwd'] - start['fwd_bwd']) * 1e3:+.1f} ms; where used than at the start: "
            f"{_faster(steps[0], steps[4])}).")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--model", default="gpt-50m")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cluster", default="benchmarks/data/calibration_cpu_vm_s33.json",
                    help="the profile stpc plans the dp program on (the runtime bench's)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    add_optimizer_flag(ap, "every engine")
    ap.add_argument("--json")
    ap.add_argument("--results", help="write the dp-gap section of this markdown file (benchmarks/RESULTS.md)")
    args = ap.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("ranks", "model", "layers", "batch", "seq", "steps", "warmup", "cluster",
                                         "optimizer_impl")}
    res = spawn(_worker, args.ranks, cfg, timeout_s=args.timeout)[0]
    command = "python benchmarks/dp_gap_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(cfg, res, machine_line(), command.strip())
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, **res}, f, indent=1)
    if args.results:
        write_section(args.results, "dp-gap", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
