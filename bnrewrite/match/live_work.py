"""Only live work is a tower: batch norms that no training step runs are not rewritten.

A Keras functional model is built by calling its layers on its own `Input` placeholder; that
call stays in the graph beside the per-tower calls, with no device, no gradient and nothing that
trains reading it (its moving-average updates are never run). Likewise an unused branch or a
dead copy. Taken for a tower, such a copy is one that "does not line up"; synchronized, it would
wait forever for a member that never runs.

A site is live when it runs before something a gradient step runs: the nodes downstream (data
or control edges) of any batch-norm gradient are the step's work (apply ops, the train op's
group), and a live site is upstream of one of them. A graph without gradients gives no such
evidence (forward-only graphs): every site counts as live there.

A live site is also only ever synchronized with sites the same training step runs. The steps
are the ends of what the variable writes downstream of a gradient (apply ops, assigns) lead to:
the train op's group, a fetch that waits on it. Each step runs the sites upstream of it; a step
that runs the batch norms of some towers but not of the others (Keras' template model fitted on
one device after the multi-tower fit) would wait in every all-reduce for the towers it does not
run (`trained_alone`).

Invariant: a site with a gradient of its own is always live. Walks over the graph, linear: one
down from the gradients, one up per step, shared by both (`Walks`).
"""

from __future__ import annotations

from collections.abc import Mapping

from bnrewrite.graph.index import Graph
from bnrewrite.graph.nodes import BODY_MARK, outer_node
from bnrewrite.match.census import Site, Skip
from bnrewrite.match.updates import writes

NOT_RUN = ("no training step runs it (nothing downstream of a gradient depends on it: e.g. the call that built a "
           "Keras model on its own Input, an unused branch or copy); not a tower, left as it is")


class Walks:
    """The walks `not_run` and `steps` share over one graph, each taken once: the work downstream of
    a set of gradients, the steps that work ends in, and what each step reads (upstream). Each
    step's reads are read by everything upstream of it: the live nodes start from their union."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self._work: dict[frozenset[str], tuple[set[str], list[str]]] = {}
        self._above: dict[str, set[str]] = {}

    def work(self, grads: set[str]) -> tuple[set[str], list[str]]:
        """The nodes downstream of `grads` and, in name order, the steps among what their variable
        writes lead to: nodes nothing reads, of the main graph."""
        key = frozenset(grads)
        if key not in self._work:
            graph = self.graph
            work = graph.downstream(grads)
            ends = graph.downstream({name for name in work if writes(graph.node(name).op)})
            consumers = graph.consumers
            self._work[key] = work, sorted(n for n in ends if not consumers.get(n) and outer_node(n) == n)
        return self._work[key]

    def above(self, end: str) -> set[str]:
        """`end` and every node it reads (shared: never change it)."""
        if end not in self._above:
            self._above[end] = self.graph.upstream((end,))
        return self._above[end]


def not_run(graph: Graph, sites: list[Site], walks: Walks | None = None) -> list[Skip]:
    """The sites no gradient step runs, each with why (empty when the graph has no gradients)."""
    grads = {outer_node(g) for s in sites for g in (*s.grads, *s.variance_grads)}
    if not grads:
        return []
    walks = walks or Walks(graph)
    work, ends = walks.work(grads)
    read = set().union(*map(walks.above, ends))  # the steps are in `work`: all they read is live
    live = graph.upstream(work - read, read)
    return [Skip(s.name, NOT_RUN) for s in sites if outer_node(s.name) not in live]


def steps(graph: Graph, sites: list[Site], callers: Mapping[str, str],
          walks: Walks | None = None) -> dict[str, frozenset[str]]:
    """Each training step -> the sites it runs. A step is a node downstream of a variable write that
    reads a batch-norm gradient and that nothing reads (the train op, a fetch waiting on it). A node
    inside a flattened branch function counts as the If that calls it (`callers`: body prefix -> If;
    a gradient body's is the gradient If, whose outputs feed the optimizer, not the moving
    averages). Empty without such writes."""
    walks = walks or Walks(graph)
    _, ends = walks.work(gradient_callers(sites, callers))
    found = {}
    for end in ends:
        above = walks.above(end)
        found[end] = frozenset(s.name for s in sites if outer_node(s.name) in above)
    return found


def gradient_callers(sites: list[Site], callers: Mapping[str, str]) -> set[str]:
    """The nodes of the main graph that run the sites' gradients (a gradient If for those in branch bodies)."""
    return {_caller(g, callers) for s in sites for g in (*s.grads, *s.variance_grads)}


def _caller(name: str, callers: Mapping[str, str]) -> str:
    """The node of the main graph that runs `name`: itself, or the If calling its branch body."""
    start = name.find(BODY_MARK)
    if start < 0:
        return name
    end = name.find("/", start + len(BODY_MARK))
    return callers.get(name[:end] if end >= 0 else name, name[:start])


def _main_step(tower: Mapping[str, str], runs: Mapping[str, frozenset[str]]) -> tuple[dict[str, frozenset[str]], str]:
    """Each step -> the sites of `tower` it runs (steps running none left out), and the step that runs
    most towers: "" when none runs several (separate models, each its own step: no all-reduce to guard)."""
    runs = {step: sites & tower.keys() for step, sites in runs.items()}
    runs = {step: sites for step, sites in runs.items() if sites}
    main = max(runs, key=lambda step: len({tower[s] for s in runs[step]}), default="")
    return runs, main if main and len({tower[s] for s in runs[main]}) >= 2 else ""


def one_tower_steps(tower: Mapping[str, str], runs: Mapping[str, frozenset[str]]) -> dict[str, frozenset[str]]:
    """The steps that share sites with the main step (the one running most towers) but run the sites
    of one of its towers only (a fine-tuning op on tower 0 after the multi-tower train op): python
    trains one device there, which bnrewrite.rewrite.step_copies gives a forward pass of its own.
    `tower`: site -> its tower (the sites to consider); `runs`: step -> the sites it runs."""
    runs, main = _main_step(tower, runs)
    if not main:
        return {}
    return {step: sites for step, sites in runs.items()
            if not sites.isdisjoint(runs[main]) and len({tower[s] for s in sites}) == 1}


def trained_alone(tower: Mapping[str, str], runs: Mapping[str, frozenset[str]]) -> tuple[list[Skip], str]:
    """The sites that only steps sharing no site with the main step (the one running most towers)
    run: such a step trains one device (Keras' template model fitted on its own after the
    multi-tower fit), so its sites are set aside and it runs as it is. With why the graph cannot be
    synchronized ("" if it can): a step sharing sites with the main step that runs no site of some
    of its towers.
    `tower`: site -> its tower (the sites to consider); `runs`: step -> the sites it runs."""
    runs, main = _main_step(tower, runs)
    if not main:
        return [], ""
    every = {tower[s] for s in runs[main]}
    apart = {step: sites for step, sites in runs.items() if sites.isdisjoint(runs[main])}
    for step, sites in runs.items():
        lacks = every - {tower[s] for s in sites}
        if step not in apart and lacks:
            return [], (f"training step {step} runs batch norm {min(sites & runs[main])} but no batch norm of tower(s) "
                        f"{_towers(lacks)}, which step {main} trains with it: their all-reduces would wait forever in "
                        f"{step}; train every tower in one step, or a single tower in a graph of its own")
    together = set().union(*(sites for step, sites in runs.items() if step not in apart))
    alone: dict[str, str] = {}
    for step, sites in apart.items():
        if len({tower[s] for s in sites}) == 1:  # several towers: a second model's, synchronized as its own
            alone.update((s, step) for s in sites if s not in together)
    return [Skip(s, f"only training step {step} runs it, which runs no batch norm of the other towers: it trains "
                    "one device, as it is (e.g. a Keras template model fitted on its own after the multi-tower fit); "
                    "not a tower") for s, step in alone.items()], ""


def partial_step(members: list[list[str]], runs: Mapping[str, frozenset[str]]) -> str:
    """Why a step would wait forever ("" if none would): it runs some of the sites that one
    all-reduce joins but not all. `members`: each all-reduce's sites, in tower order."""
    for sites in members:
        for step, ran in runs.items():
            taken = [s for s in sites if s in ran]
            if taken and len(taken) < len(sites):
                missing = [s for s in sites if s not in ran]
                return (f"training step {step} runs batch norm {taken[0]} but not {missing[0]}, which it is synchronized "
                        f"with: their all-reduce would wait forever in {step}; train every tower in one step, or a "
                        "single tower in a graph of its own")
    return ""


def _towers(towers: set[str]) -> str:
    return ", ".join(sorted(t or "(no device)" for t in towers))
