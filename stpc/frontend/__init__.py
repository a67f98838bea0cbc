"""frontend: model -> annotated aten graph. In: an nn.Module (real or on meta) and example
inputs. Out: a TracedGraph whose every node carries its FakeTensor, FLOPs, bytes and source line.

trace (torch.export, training IR; positional and keyword inputs), normalize (tuple-valued
split views become slices), annotate (FLOPs, bytes, parameter, module, source), module_calls (the values each
submodule call took and returned, tagged on their nodes),
models (the zoo of GPT / Llama / OPT / BLOOM configs), dump (graph tables and DOT), graph_diff
(what a pass changed between two snapshots of a graph: structured, as text and as highlighted HTML).
"""
from stpc.frontend import models
from stpc.frontend.annotate import annotate, source_of
from stpc.frontend.dump import dump
from stpc.frontend.trace import TracedGraph, trace

__all__ = ["trace", "TracedGraph", "annotate", "source_of", "dump", "models"]
