"""The meaning check (bnrewrite/rewrite/meaning.py) catches a rewrite that changes what the graph does.

Each test breaks one invariant on purpose, by patching what the passes return, and shows
that rewrite_graph raises PassError naming it; unbroken, the same graphs rewrite cleanly.
"""

from __future__ import annotations

import functools
from typing import Callable

import pytest

from bnrewrite import rewrite_graph
from bnrewrite.errors import PassError
from bnrewrite.graph.edit import Editor
from bnrewrite.graph.index import Graph
from bnrewrite.rewrite import api
from bnrewrite.rewrite.passes import PIPELINE, dedupe_moving_averages, run_passes
from models import Spec, build_towers

K = 3


@functools.cache
def _towers(layer: str = "legacy", backend: str = "collective"):
    """A 3-tower graph (every tower's updates in the train op) and its clean rewrite."""
    built = build_towers(Spec(towers=K, layer=layer))
    return built, rewrite_graph(built.graph, backend=backend)


def _break(monkeypatch, edit: Callable[[Graph], Graph], passes=PIPELINE) -> None:
    """Make rewrite_graph's passes end with a broken one: `edit` of their result."""

    def broken(graph, plan, passes=passes):
        result, records = run_passes(graph, plan, passes)
        return edit(result), records

    monkeypatch.setattr(api, "run_passes", broken)


def _edited(graph: Graph, change: Callable) -> Graph:
    """`graph` with `change(editor)` applied, as a pass would."""
    editor = Editor(graph)
    change(editor)
    return editor.finish()


def _rewired(graph: Graph, readers: list[str], respec: Callable[[str], str | None]) -> Graph:
    """`graph` with each input of `readers` replaced by respec(input) (None drops it)."""

    def change(editor):
        for reader in readers:
            node = editor.mutable(reader)
            inputs = [new for new in map(respec, node.input) if new is not None]
            del node.input[:]
            node.input.extend(inputs)
    return _edited(graph, change)


def _kept_update(built) -> tuple[str, str]:
    """(the train op, one moving-average update it runs after the clean rewrite)."""
    _, result = _towers()
    update = result.report.layers[0].updates_kept[0]
    return built.train_op.split(":")[0], update


def test_clean_rewrite_passes_the_check():
    built, result = _towers()
    assert result.report.removed and result.report.layers


def test_a_target_that_loses_an_update_is_caught(monkeypatch):
    built, _ = _towers()
    train_op, update = _kept_update(built)

    _break(monkeypatch, lambda graph: _rewired(graph, [train_op], lambda spec: None if spec == f"^{update}" else spec))
    with pytest.raises(PassError, match=r"every target runs what it ran before.*train_op no longer runs"):
        rewrite_graph(built.graph, backend="collective")


def test_a_shared_statistic_updated_by_every_tower_is_caught(monkeypatch):
    built, _ = _towers()
    _break(monkeypatch, lambda graph: graph, passes=tuple(p for p in PIPELINE if p is not dedupe_moving_averages))
    with pytest.raises(PassError, match=rf"one update per shared moving average.*runs {K} of the towers' updates"):
        rewrite_graph(built.graph, backend="collective")


def test_a_target_that_runs_an_all_reduce_in_some_towers_only_is_caught(monkeypatch):
    built, _ = _towers()

    def bypass(graph: Graph) -> Graph:
        """Tower 1's readers of one forward all-reduce read its input instead and stop waiting
        on it: the train op still runs the other towers' members, which wait for tower 1's."""
        member = next(n.name for n in graph if n.op == "CollectiveReduceV2" and n.name.startswith("tower_1/"))
        source = graph.node(member).input[0]
        return _rewired(graph, graph.consumers[member],
                        lambda spec: source if spec == member else None if spec == f"^{member}" else spec)

    _break(monkeypatch, bypass)
    with pytest.raises(PassError, match=r"a step runs every tower's member of every all-reduce.*does not run tower_1/"):
        rewrite_graph(built.graph, backend="collective")


def test_a_gradient_held_behind_an_update_is_caught(monkeypatch):
    built, result = _towers()
    _, update = _kept_update(built)

    def wait(graph: Graph) -> Graph:
        grad = next(g for g in result.report.layers[0].gradients if g.startswith("tower_1/"))
        return _edited(graph, lambda editor: editor.mutable(grad).input.append(f"^{update}"))

    _break(monkeypatch, wait)
    with pytest.raises(PassError, match=r"gradient that waited on no update waits on none.*tower_1/"):
        rewrite_graph(built.graph, backend="collective")


def test_an_all_reduce_whose_members_disagree_on_its_group_is_caught(monkeypatch):
    built, _ = _towers()

    def resize(graph: Graph) -> Graph:
        """Tower 1's member of one all-reduce told the group has one member more."""
        member = next(n.name for n in graph if n.op == "CollectiveReduceV2" and n.name.startswith("tower_1/"))
        size = graph.producer(member, 1)[0]
        return _edited(graph, lambda editor: editor.mutable(size).attr["value"].tensor.int_val.__setitem__(0, K + 1))

    _break(monkeypatch, resize)
    with pytest.raises(PassError, match=rf"one member per tower of its group.*{K} member\(s\) here, for a group of {K} or {K + 1}"):
        rewrite_graph(built.graph, backend="collective")
