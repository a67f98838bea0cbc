"""What the verbs share: their flags, their error handling, planning defaults, and turning
``--model`` into a traced graph.

Flags (:func:`add_flags`): one definition each of ``--model``, ``--layers``, ``--batch``,
``--seq``, ``--mesh``, ``--cluster``, ``--dtype``, ``--budget-gib``, ``--json``,
``--ranks``, ``--steps`` and ``--timeout``, which a verb takes where they mean something to
it (the same name, meaning and help everywhere; only the default differs), and
``--quiet`` / ``--debug`` on every verb (:class:`Parser`).

Errors (:func:`verb`): every verb's entry point returns 0 on success, 1 on a failure (any
error stpc or torch raises), 2 on a usage error (:class:`UsageError`: a bad flag or flag
value, an unknown model, verb or cluster); a failure or usage error is one line on stderr,
``error: <cause>. Fix: <what to do>`` (:func:`error_line`), with the traceback only under
``--debug`` or ``STPC_DEBUG=1``.

``--model`` is one of
  * a zoo name (``stpc.frontend.models.CONFIGS``: gpt-tiny, llama2-7b, ...);
  * ``package.module:factory``: a callable returning ``(model, example_inputs)`` (a tuple of
    positional inputs, or a dict of keyword inputs), the model on any device (``meta`` plans
    without allocating). It is called with those of ``batch``, ``seq`` and ``layers`` that
    were given on the command line; each must be a parameter it takes;
  * a path to a Hugging Face ``config.json`` (or a folder holding one): the model is
    ``transformers.AutoModelForCausalLM.from_config(...)`` built on ``meta`` (random weights,
    nothing downloaded), called as ``model(input_ids=..., labels=...)`` on ``batch x seq``.
Anything else raises :class:`UnknownModel`, which the verbs turn into a one-line usage
error (exit code 2).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import inspect
import json
import math
import os
import re
import sys
import traceback
from dataclasses import dataclass, replace

import torch

from stpc.cli._progress import Status
from stpc.compile import trace
from stpc.cost_models import CLUSTERS
from stpc.frontend import TracedGraph, models
from stpc.planner import HintUnsatisfiable, InfeasibleBudget
from stpc.runtime.launch import SpawnError, SpawnTimeout

# Planning defaults, the same for every model unless --batch/--seq are given.
DEFAULT_BATCH = 8
DEFAULT_SEQ = 2048
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODEL_HELP = ("a zoo name (" + ", ".join(sorted(models.CONFIGS)) + "), package.module:factory (a callable "
              "returning (model, example_inputs)), or a path to a Hugging Face config.json")
ZOO_HELP = "a zoo name (" + ", ".join(sorted(models.CONFIGS)) + ")"
_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
DEBUG_HINT = "rerun with --debug (or STPC_DEBUG=1) for the traceback"


class UsageError(ValueError):
    """A command line stpc cannot act on: a bad flag or flag value, an unknown model, verb
    or cluster. One line on stderr, exit code 2. ``fix`` says what to give instead."""

    def __init__(self, cause: str, fix: str | None = None):
        self.cause, self.fix = cause, fix
        super().__init__(cause if fix is None else f"{cause}. Fix: {fix}")


class Failure(RuntimeError):
    """A verb could not do its job for a reason it can name (exit code 1), with the fix."""

    def __init__(self, cause: str, fix: str):
        self.cause, self.fix = cause, fix
        super().__init__(f"{cause}. Fix: {fix}")


class UnknownModel(UsageError):
    """``--model`` names nothing stpc can build: a usage error (exit code 2)."""


# ----------------------------------------------------------------------------- errors


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _first_line(text: str) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def error_line(e: BaseException) -> str:
    """``<cause>. Fix: <what to do>`` for ``e``, on one line: stpc's own messages carry
    their fix (kept whole, newlines folded); a few errors get theirs here; anything else
    is its type and first line, and the fix is to look at the traceback."""
    if isinstance(e, (UsageError, Failure)):
        return _one_line(e)
    if isinstance(e, InfeasibleBudget):
        need = e.min_budget / 2**30
        step = 10.0 ** (math.floor(math.log10(need)) - 2) if need > 0 else 1.0
        up = math.ceil(need / step) * step  # three significant digits, rounded up
        least = (f"is {need:.4g} GiB" if e.lower >= e.min_budget else
                 f"is between {e.lower / 2**30:.4g} and {need:.4g} GiB (the solver did not narrow it further within "
                 "its time limit)")
        return (f"InfeasibleBudget: no plan fits the memory budget of {e.budget / 2**30:.4g} GiB per device; the "
                f"smallest feasible budget {least}. Fix: --budget-gib {up:.3g} or more, more devices "
                f"(--mesh), or a smaller --batch / --seq")
    if isinstance(e, SpawnError):
        # the root rank's own last line: ``remote_traceback`` ends with the note on the
        # ranks that failed after it, which says nothing of why
        own = e.failures.get(e.rank, e.remote_traceback)
        last = [line for line in own.strip().splitlines() if line.strip()]
        cause = f"rank {e.rank} failed: {last[-1].strip() if last else 'it exited without a result'}"
        after = sorted(set(e.failures) - {e.rank})
        if after:
            cause += f" (ranks {after} failed after it)"
        return _one_line(cause) if "Fix:" in cause else f"{_one_line(cause)}. Fix: {DEBUG_HINT} of every rank"
    if isinstance(e, SpawnTimeout):
        return f"{_one_line(e)}. Fix: raise --timeout, or give the ranks less to do (--steps, a smaller model)"
    text = _one_line(e) if "Fix:" in str(e) else _first_line(e.args[0] if isinstance(e, KeyError) and e.args
                                                                 else e).rstrip(".")
    name = type(e).__name__
    text = f"{name}: {text}" if text else name
    if "Fix:" in text:
        return text
    if isinstance(e, HintUnsatisfiable):
        return f"{text}. Fix: change --hints, or --mesh to a shape the hints can use"
    if isinstance(e, ImportError) and e.name:
        return f"{text}. Fix: pip install {e.name.split('.')[0]}"
    if isinstance(e, OSError):
        return f"{text}. Fix: check that the path exists and can be written"
    return f"{text}. Fix: {DEBUG_HINT}"


def _debugging(argv) -> bool:
    return "--debug" in argv or os.environ.get("STPC_DEBUG", "") not in ("", "0")


def run_guarded(fn, argv, *args, **kwargs) -> int:
    """``fn(argv, ...)`` as a command: its exit code; any exception is one line on stderr
    (traceback first under --debug / STPC_DEBUG=1) and exit code 2 (usage) or 1."""
    try:
        code = fn(argv, *args, **kwargs)
    except SystemExit as e:  # argparse's --help (0)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if _debugging(argv):
            traceback.print_exc()
        print(f"error: {error_line(e)}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    return 0 if code is None else code


def verb(fn):
    """Decorate a verb's ``main_<verb>(argv, ...)``: it returns an exit code and never
    raises (:func:`run_guarded`), whether ``python -m stpc`` or a test calls it."""
    @functools.wraps(fn)
    def run(argv, *args, **kwargs) -> int:
        return run_guarded(fn, argv, *args, **kwargs)
    return run


# ----------------------------------------------------------------------------- flags


class Parser(argparse.ArgumentParser):
    """argparse with stpc's conventions: the description printed as written, ``--quiet``
    and ``--debug`` on every verb, and a usage error raised as :class:`UsageError` (one
    line, exit code 2) instead of argparse's usage block."""

    def __init__(self, prog: str, description: str | None = None, **kwargs):
        super().__init__(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                         **kwargs)
        self._output = False

    def parse_args(self, args=None, namespace=None):
        if not self._output:  # added last, so --help lists them after the verb's own flags
            self._output = True
            out = self.add_argument_group("output (every verb)")
            out.add_argument("-q", "--quiet", action="store_true",
                             help="print only the result (no progress, no 'wrote' lines); errors still go to stderr")
            out.add_argument("--debug", action="store_true",
                             help="on a failure, print the traceback too (or set STPC_DEBUG=1)")
        return super().parse_args(args, namespace)

    def error(self, message: str):
        raise UsageError(message) if "Fix:" in message else UsageError(message, f"see `{self.prog} --help`")


def _whole(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def mesh_arg(text: str) -> str:
    """``--mesh``: N, or a shape like 4x8 (kept as text: ``search`` parses it)."""
    try:
        parts = [int(x) for x in text.lower().split("x")]
    except ValueError:
        parts = []
    if not parts or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device count N or a mesh shape like 4x8. Fix: give e.g. "
                                         "--mesh 8 (the planner picks the shape) or --mesh 2x4")
    return text


def cluster_arg(text: str) -> str:
    """``--cluster``: a preset name, or the path of a calibration profile."""
    if text in CLUSTERS or os.path.isfile(text):
        return text
    raise argparse.ArgumentTypeError(f"unknown cluster {text!r}: not a preset nor a profile file. Fix: give one of "
                                     f"{', '.join(CLUSTERS)}, or the .json that `python -m stpc calibrate` wrote")


def check_mesh_fits(mesh: str, cluster) -> None:
    """A usage error if ``--mesh`` asks for more devices than ``--cluster`` has."""
    n = math.prod(int(x) for x in str(mesh).lower().split("x"))
    if n > cluster.num_devices:
        bigger = [name for name, c in CLUSTERS.items() if c.num_devices >= n]
        raise UsageError(f"--mesh {mesh} needs {n} devices but cluster {cluster.name!r} has {cluster.num_devices}",
                         f"a --mesh of at most {cluster.num_devices} devices, or a --cluster with {n} or more"
                         + (f" (e.g. {', '.join(bigger)})" if bigger else ""))


def zoo_model(text: str) -> str:
    """``--model`` of the verbs that build and train a zoo model."""
    if text in models.CONFIGS:
        return text
    raise argparse.ArgumentTypeError(f"unknown model {text!r}; known: {', '.join(sorted(models.CONFIGS))}. Fix: "
                                     "give one of those (this verb builds and runs the model, so zoo models only)")


# name -> (option strings, argparse keywords, help)
FLAGS = {
    "model": (("--model",), {"metavar": "MODEL"}, "the model: {model_help}"),
    "layers": (("--layers",), {"type": _whole, "metavar": "N"}, "build the model N layers deep"),
    "batch": (("--batch",), {"type": _whole, "metavar": "N"}, "global batch size"),
    "seq": (("--seq",), {"type": _whole, "metavar": "N"}, "sequence length"),
    "mesh": (("--mesh",), {"type": mesh_arg, "metavar": "MESH"},
             "devices: N (the planner picks the mesh shape) or a fixed shape like 4x8"),
    "cluster": (("--cluster",), {"type": cluster_arg, "metavar": "CLUSTER"},
                "what plans are costed on: a preset (" + ", ".join(CLUSTERS) + ") or a `python -m stpc calibrate` "
                "profile .json"),
    "dtype": (("--dtype",), {"choices": list(TORCH_DTYPES)},
              "fp32 (AdamW: 16 B/param) or bf16 / fp16 mixed precision (16-bit weights and activations, fp32 "
              "master weights and Adam state: 18 B/param)"),
    "budget-gib": (("--budget-gib",), {"type": _positive, "metavar": "GIB"}, "per-device memory budget in GiB"),
    "json": (("--json",), {"metavar": "PATH"}, "write the result as JSON to PATH"),
    "ranks": (("--ranks",), {"type": _whole, "metavar": "N"}, "local processes to spawn, one per device"),
    "steps": (("--steps",), {"type": _whole, "metavar": "N"}, "training steps to run"),
    "timeout": (("--timeout",), {"type": _positive, "metavar": "SECONDS"},
                "hard limit for the spawned ranks; past it every rank is killed"),
}


def add_flags(p: argparse.ArgumentParser, flags: dict) -> None:
    """Add the shared flags ``flags`` (name -> its setting on this verb: a dict with any of
    ``default``, ``shown`` (the default as --help says it; else the default itself),
    ``required``, ``note`` (appended to the help), ``zoo`` (--model: zoo names only),
    ``aliases`` (hidden old names)) to ``p``, in the one order every verb lists them in."""
    unknown = set(flags) - set(FLAGS)
    if unknown:
        raise ValueError(f"no shared flag {sorted(unknown)}; the shared flags are {', '.join(FLAGS)}")
    group = p.add_argument_group("shared flags (the same on every verb that takes them)")
    for name in (n for n in FLAGS if n in flags):
        how = flags[name]
        names, kwargs, text = FLAGS[name]
        kwargs = dict(kwargs)
        default = how.get("default")
        shown = how.get("shown", default)
        model_help = (ZOO_HELP + "; this verb builds and runs it, so zoo models only") if how.get("zoo") else MODEL_HELP
        if name == "model" and how.get("zoo"):
            kwargs["type"] = zoo_model
        text = text.format(model_help=model_help) + (f"; {how['note']}" if how.get("note") else "")
        if how.get("required"):
            kwargs["required"] = True
            text += " (required)"
        else:
            text += f" (default: {shown})"
        group.add_argument(*names, default=default, help=text.replace("%", "%%"), **kwargs)
        for alias in how.get("aliases", ()):
            group.add_argument(alias, dest=name.replace("-", "_"), default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                               **{k: v for k, v in kwargs.items() if k != "required"})


def write_json(path: str, obj, sort_keys: bool = False) -> None:
    """``--json``: ``obj`` as JSON at ``path`` (its folder made if missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=sort_keys)


def check_layers(layers: int | None) -> None:
    if layers is not None and layers < 1:
        raise UsageError(f"--layers must be at least 1 (got {layers})", "give --layers 1 or more")


@dataclass
class ModelSpec:
    """A model ready to trace: the module, its example inputs, a name, and the batch and
    sequence length its inputs have (None where the inputs do not say)."""

    model: torch.nn.Module
    args: tuple
    kwargs: dict
    name: str
    batch: int | None
    seq: int | None


def load_model(spec: str, batch: int | None = None, seq: int | None = None, dtype: str = "fp32",
               layers: int | None = None) -> ModelSpec:
    """Build ``spec`` (module docstring) in ``dtype``, on ``meta`` where stpc builds it."""
    check_layers(layers)
    if spec in models.CONFIGS:
        return _zoo(spec, batch, seq, dtype, layers)
    if spec.endswith(".json") or os.path.isdir(spec):
        return _hugging_face(spec, batch, seq, dtype, layers)
    if _FACTORY.fullmatch(spec):
        return _factory(spec, batch, seq, dtype, layers)
    raise UnknownModel(f"unknown model {spec!r}", f"give {MODEL_HELP}")


def meta_trace(spec: str, batch: int | None = None, seq: int | None = None, dtype: str = "fp32",
               layers: int | None = None, progress: bool = False) -> tuple[TracedGraph, int | None, int | None]:
    """Trace (and analyse) ``spec`` (a zoo name, factory or Hugging Face config; see
    :func:`load_model`) in ``dtype``: (graph, batch, seq), with the defaults filled in and
    ``seq`` capped at the model's position table. ``progress``: a status line on stderr
    while it runs (``stpc.cli._progress``)."""
    with Status(f"trace {spec}", progress) as status:
        status.set("building on meta")
        m = load_model(spec, batch, seq, dtype, layers)
        status.set(f"batch {m.batch} x seq {m.seq}: torch.export + annotation")
        with _quiet_transformers():
            return trace(m.model, m.args, name=m.name, example_kwargs=m.kwargs or None), m.batch, m.seq


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' warnings about a small random config (token ids, loss type) are noise
    to a planner: errors only while it builds and traces, if it is imported at all."""
    tf = sys.modules.get("transformers")
    if tf is None:
        yield
        return
    verbosity = tf.logging.get_verbosity()
    tf.logging.set_verbosity_error()
    try:
        yield
    finally:
        tf.logging.set_verbosity(verbosity)


def _layers_name(name: str, layers: int | None) -> str:
    return name if layers is None else f"{name} (n_layers={layers})"


def _zoo(name, batch, seq, dtype, layers) -> ModelSpec:
    cfg = models.get_config(name)
    if layers is not None:
        cfg = replace(cfg, n_layers=layers)
    seq = min(seq or DEFAULT_SEQ, cfg.max_seq)
    batch = batch or DEFAULT_BATCH
    with torch.device("meta"):
        model = models.build(cfg).to(TORCH_DTYPES[dtype])
    return ModelSpec(model, models.example_inputs(cfg, batch, seq, device="meta"), {}, _layers_name(name, layers),
                     batch, seq)


def _hugging_face(spec, batch, seq, dtype, layers) -> ModelSpec:
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise UnknownModel(f"unknown model {spec!r}: no such Hugging Face config file ({path})", f"give {MODEL_HELP}")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise UnknownModel(f"cannot read {path} as a Hugging Face config: {e}",
                           "give the config.json of a Hugging Face model") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise UnknownModel(f"{path} is not a Hugging Face config.json (it has no \"model_type\")",
                           "give the config.json of a Hugging Face model")
    try:
        import transformers  # lazy: seconds to import, and only a Hugging Face config needs it
    except ImportError:
        raise UnknownModel(f"{path} is a Hugging Face config, but transformers is not installed",
                           "pip install transformers") from None
    try:
        cfg = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    except (ValueError, KeyError) as e:
        raise UnknownModel(f"{path}: transformers cannot build this config: {_first_line(e)}",
                           "give a config transformers' AutoConfig knows") from None
    cfg.use_cache = False
    if layers is not None:
        cfg.num_hidden_layers = layers
    limit = getattr(cfg, "max_position_embeddings", None)
    seq = min(seq or DEFAULT_SEQ, limit) if limit else (seq or DEFAULT_SEQ)
    batch = batch or DEFAULT_BATCH
    with torch.device("meta"), _quiet_transformers():
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model = model.to(TORCH_DTYPES[dtype])
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
    stem = folder if os.path.basename(path) == "config.json" else os.path.basename(path).removesuffix(".json")
    return ModelSpec(model, (), {"input_ids": ids, "labels": torch.empty_like(ids)},
                     _layers_name(f"{cfg.model_type}:{stem}", layers), batch, seq)


def _factory(spec, batch, seq, dtype, layers) -> ModelSpec:
    mod_name, attr = spec.split(":", 1)
    try:
        obj = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name and mod_name.startswith(e.name):  # the module itself, not one it imports
            raise UnknownModel(f"unknown model {spec!r}: no module {mod_name!r}",
                               f"put it on PYTHONPATH, or give {MODEL_HELP}") from None
        raise
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UnknownModel(f"unknown model {spec!r}: module {mod_name!r} has no {attr!r}",
                               "give package.module:factory naming a callable the module defines")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UnknownModel(f"{spec} is not callable", "give a callable returning (model, example_inputs)")
    given = {k: v for k, v in (("batch", batch), ("seq", seq), ("layers", layers)) if v is not None}
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [k for k in given if k not in params and not takes_any]
    if missing:
        raise UnknownModel(f"factory {spec} takes no {', '.join(missing)} parameter",
                           "drop " + ", ".join(f"--{k}" for k in missing) + " or add the parameter")
    got = obj(**given)
    if not (isinstance(got, tuple) and len(got) in (2, 3) and isinstance(got[0], torch.nn.Module)):
        raise UnknownModel(f"factory {spec} returned {type(got).__name__}",
                           "make it return (model, example_inputs)")
    model, inputs = got[0], got[1]
    kwargs = dict(got[2]) if len(got) == 3 else {}
    if isinstance(inputs, dict):
        args, kwargs = (), {**inputs, **kwargs}
    elif isinstance(inputs, torch.Tensor):
        args = (inputs,)
    else:
        args = tuple(inputs)
    if dtype != "fp32":
        model = model.to(TORCH_DTYPES[dtype])
    first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    shape = tuple(first.shape[:2]) if first is not None else (batch, seq)
    return ModelSpec(model, args, kwargs, _layers_name(spec, layers), *shape)
