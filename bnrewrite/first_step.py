"""`bnrewrite run --verify` / `enable(verify=True)`: the first real step of each synchronized
graph, checked layer by layer (bnrewrite.stepcheck) as it runs.

The check ops are added to the session's shadow graph (never to the script's); the step is the
first `run` whose fetches and targets reach every synced batch-norm op, and it runs once, with
the check's fetches added to the script's own. Moving statistics are read in read-only runs
just before and just after it. Nothing is trained twice and no variable is written by the
check. Invariant: a graph is checked at most once, on a run the script made anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FirstStep:
    """What to fetch around the first step of one shadow graph, and how to tell that step."""

    check: Any  # bnrewrite.stepcheck.StepCheck
    graph: Any  # the shadow tf.Graph, holding the check's ops
    sites: frozenset[str]
    inputs: dict[str, list[str]]  # node -> the nodes it reads (data and control) in the rewritten graph
    decided: dict[frozenset[str], bool] = field(default_factory=dict)

    @classmethod
    def build(cls, graph: Any, result: Any) -> "FirstStep":
        from bnrewrite import stepcheck

        check = stepcheck.build(graph, result.report)
        inputs = {node.name: [name.lstrip("^").split(":")[0] for name in node.input] for node in result.graph_def.node}
        sites = frozenset(site for layer in check.layers for site in layer.row.sites)  # the layers it can see
        return cls(check, graph, sites, inputs)

    def covers(self, names: Iterable[str]) -> bool:
        """Whether running `names` runs every synced batch-norm op (one walk per new set of names)."""
        key = frozenset(names)
        if key not in self.decided:
            unseen, stack, visited = set(self.sites), list(key), set(key)
            while stack and unseen:
                node = stack.pop()
                unseen.discard(node)
                for source in self.inputs.get(node, ()):
                    if source not in visited:
                        visited.add(source)
                        stack.append(source)
            self.decided[key] = not unseen
        return self.decided[key]

    def run(self, session: Any, step: Callable[[list[Any], dict[Any, Any]], list[Any]]) -> tuple[list[Any], Any]:
        """Read `before`, run `step` with the check's outputs appended to its fetches and the
        check's feeds added (it returns all values, the script's first), read `after`; the
        script's values and the Verdict (evaluate raises PassError on a failed check)."""
        before = _read(session, self._outputs(self.check.before))
        feeds = {self.graph.get_tensor_by_name(name)._as_tf_output(): value
                 for name, value in self.check.feed(before).items()}
        values = step(self._outputs(self.check.step), feeds)
        extra = len(self.check.step)
        script, checked = (values[:-extra], values[-extra:]) if extra else (values, [])
        after = _read(session, self._outputs(self.check.after))
        return script, self.check.evaluate(before, checked, after)

    def _outputs(self, names: list[str]) -> list[Any]:
        return [self.graph.get_tensor_by_name(name)._as_tf_output() for name in names]


def _read(session: Any, outputs: list[Any]) -> list[Any]:
    """A read-only run of `outputs` in `session` (TensorFlow's own run, by C outputs)."""
    if not outputs:
        return []

    def run() -> list[Any]:
        session._extend_graph()
        return session._call_tf_sessionrun(None, {}, outputs, [], None)

    return session._do_call(run)
