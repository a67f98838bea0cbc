"""What the verbs share: planning defaults, and turning ``--model`` into a traced graph.

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

import contextlib
import importlib
import inspect
import json
import os
import re
import sys
from dataclasses import dataclass, replace

import torch

from stpc.compile import trace
from stpc.frontend import TracedGraph, models

# Planning defaults, the same for every model unless --batch/--seq are given.
DEFAULT_BATCH = 8
DEFAULT_SEQ = 2048
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODEL_HELP = ("a zoo name (" + ", ".join(sorted(models.CONFIGS)) + "), package.module:factory (a callable "
              "returning (model, example_inputs)), or a path to a Hugging Face config.json")
_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


class UnknownModel(ValueError):
    """``--model`` names nothing stpc can build: a usage error (exit code 2)."""


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
    if layers is not None and layers < 1:
        raise UnknownModel(f"--layers must be at least 1 (got {layers})")
    if spec in models.CONFIGS:
        return _zoo(spec, batch, seq, dtype, layers)
    if spec.endswith(".json") or os.path.isdir(spec):
        return _hugging_face(spec, batch, seq, dtype, layers)
    if _FACTORY.fullmatch(spec):
        return _factory(spec, batch, seq, dtype, layers)
    raise UnknownModel(f"unknown model {spec!r}: give {MODEL_HELP}")


def meta_trace(spec: str, batch: int | None = None, seq: int | None = None, dtype: str = "fp32",
               layers: int | None = None) -> tuple[TracedGraph, int | None, int | None]:
    """Trace (and analyse) ``spec`` (a zoo name, factory or Hugging Face config; see
    :func:`load_model`) in ``dtype``: (graph, batch, seq), with the defaults filled in and
    ``seq`` capped at the model's position table."""
    m = load_model(spec, batch, seq, dtype, layers)
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
        raise UnknownModel(f"unknown model {spec!r}: no such Hugging Face config file ({path}); give {MODEL_HELP}")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise UnknownModel(f"cannot read {path} as a Hugging Face config: {e}") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise UnknownModel(f"{path} is not a Hugging Face config.json (it has no \"model_type\")")
    try:
        import transformers  # lazy: seconds to import, and only a Hugging Face config needs it
    except ImportError:
        raise UnknownModel(f"{path} is a Hugging Face config, but transformers is not installed "
                           "(pip install transformers)") from None
    try:
        cfg = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    except (ValueError, KeyError) as e:
        raise UnknownModel(f"{path}: transformers cannot build this config: {e}") from None
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
            raise UnknownModel(f"unknown model {spec!r}: no module {mod_name!r} (is it on PYTHONPATH?); "
                               f"give {MODEL_HELP}") from None
        raise
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UnknownModel(f"unknown model {spec!r}: module {mod_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UnknownModel(f"{spec} is not callable: a factory returns (model, example_inputs)")
    given = {k: v for k, v in (("batch", batch), ("seq", seq), ("layers", layers)) if v is not None}
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [k for k in given if k not in params and not takes_any]
    if missing:
        raise UnknownModel(f"factory {spec} takes no {', '.join(missing)} parameter: drop "
                           + ", ".join(f"--{k}" for k in missing) + " or add the parameter")
    got = obj(**given)
    if not (isinstance(got, tuple) and len(got) in (2, 3) and isinstance(got[0], torch.nn.Module)):
        raise UnknownModel(f"factory {spec} must return (model, example_inputs), got {type(got).__name__}")
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
