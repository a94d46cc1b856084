"""A later training step that runs ONE tower of a multi-tower step gets a forward pass of its own.

A fine-tuning op on tower 0 alone (`opt2.minimize(tower_0_loss)` after the `train_op` over every
tower) shares tower 0's batch norms with the multi-tower step. Synchronized, those would wait in
every all-reduce for the towers the step does not run; python trains one device there. So the
forward pass from those batch norms down that the step shares with the other steps (batch norms,
losses, moving-average updates), and what no step runs (a loss fetched with it), is copied under
`COPY_SCOPE`, and the step's own nodes (its gradients, its optimizer) read the copies: the step runs
exactly what python runs, and the copies, trained by that step alone, are set aside as one
device's (live_work.trained_alone).

Invariant: no node of the input changes but the step's own, which read copies of the same ops
with the same inputs; every copy has its original's name under COPY_SCOPE (`copies`, which a
session on the result uses for what the script fetches with that step). A stateful random op
(dropout) among them draws from its own state (same seed): the same distribution, other numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tensorflow.core.framework import function_pb2, node_def_pb2

from bnrewrite.graph.edit import Editor
from bnrewrite.graph.index import Graph
from bnrewrite.graph.names import parse_input
from bnrewrite.graph.nodes import outer_node

COPY_SCOPE = "bnrewrite_alone"
IF_OPS = ("If", "StatelessIf")
#: Ops a copy could not run as its original does (a loop and its frame).
NOT_COPIED = ("Enter", "Exit", "NextIteration", "LoopCond", "While", "StatelessWhile")


@dataclass
class StepCopies:
    """The graph with the copies, each step's (node -> its copy), and the nodes only a step runs
    (-> that step's copies): its gradients, which name in their scope the original they differentiate."""

    graph: Graph
    copies: dict[str, dict[str, str]] = field(default_factory=dict)
    own: dict[str, dict[str, str]] = field(default_factory=dict)
    why: str = ""  # why a step could not be given copies ("" if all were)


def copy_steps(graph: Graph, alone: Mapping[str, frozenset[str]], steps: Mapping[str, frozenset[str]],
               grads: set[str]) -> StepCopies:
    """The graph where each step of `alone` (step -> the sites of one tower it runs, shared with the
    multi-tower step) runs copies of those sites and of the forward pass below them (but what only
    the other steps run: `grads`, the batch-norm gradients, and all below them are the backward
    pass). The copies also cover what no step runs (a loss fetched with the step)."""
    editor, found = Editor(graph), StepCopies(graph)
    library = function_pb2.FunctionDefLibrary()
    if graph.library is not None:
        library.CopyFrom(graph.library)
    backward = graph.downstream(grads)
    for number, (step, sites) in enumerate(sorted(alone.items())):
        others = graph.upstream(end for end in steps if end != step)
        ran = graph.upstream((step,))
        shared = graph.downstream({outer_node(site) for site in sites}) - backward - (ran ^ others)
        bad = next((name for name in sorted(shared) if graph.node(name).op in NOT_COPIED), "")
        if bad:
            return StepCopies(graph, why=f"training step {step} runs tower {_tower(sites)} alone through {bad} "
                               f"({graph.node(bad).op}), which a copy would not run as python does")
        scope = f"{COPY_SCOPE}_{number}" if number else COPY_SCOPE
        renamed = {name: f"{scope}/{name}" for name in shared}
        for name in sorted(shared):
            node = node_def_pb2.NodeDef()
            node.CopyFrom(graph.node(name))
            node.name = renamed[name]
            _read_copies(node, renamed)
            for key in (k for k in ("then_branch", "else_branch") if node.op in IF_OPS):
                node.attr[key].func.name = _copy_function(library, node.attr[key].func.name, scope)
            editor.add(node)
        for name in ran - others:
            found.own[name] = renamed
            if any(parse_input(spec)[0] in renamed for spec in graph.node(name).input):
                _read_copies(editor.mutable(name), renamed)
        found.copies[step] = renamed
    if graph.library is not None:
        editor.library = library
    found.graph = editor.finish()
    return found


def _read_copies(node: node_def_pb2.NodeDef, renamed: Mapping[str, str]) -> None:
    for i, spec in enumerate(node.input):
        source = parse_input(spec)[0]
        if source in renamed:
            node.input[i] = spec.replace(source, renamed[source], 1)


def _copy_function(library: function_pb2.FunctionDefLibrary, name: str, scope: str) -> str:
    """A copy of function `name` named for `scope` (branch functions are flattened only when called
    once), added to `library`; its name."""
    copied = f"{name}_{scope}"
    if not any(f.signature.name == copied for f in library.function):
        function = next(f for f in library.function if f.signature.name == name)
        new = library.function.add()
        new.CopyFrom(function)
        new.signature.name = copied
    return copied


def _tower(sites: frozenset[str]) -> str:
    return min(sites).split("/", 1)[0]
