"""The graph model: edits, the incremental indexes, and validation after every pass.

Validation after an edit only looks where the edit touched the graph, and the consumer index
and topological numbering are carried over from the base graph instead of rebuilt; these
tests hold both to what a check of the whole graph from scratch says.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

from bnrewrite.errors import GraphValidationError, PassError
from bnrewrite.graph.edit import Editor
from bnrewrite.graph.index import Graph, _consumer_index
from bnrewrite.graph.names import parse_input
from bnrewrite.rewrite.passes import run_passes
from bnrewrite.rewrite.passes.record import PassRecord
from ticks import run_ticked


def _small_graph() -> Graph:
    """x -> a -> b -> c, with a Const read twice and a control edge."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2], name="x")
        two = tf.constant(2.0, name="two")
        a = tf.multiply(x, two, name="a")
        b = tf.add(a, two, name="b")
        with tf.control_dependencies([a]):
            tf.identity(b, name="c")
    graph = Graph.from_graph_def(g.as_graph_def())
    graph.validate()
    return graph


def _node(editor, name: str, op: str, inputs: list[str]):
    return editor.new_node(name=name, op=op, input=inputs)


def _scratch_index(graph: Graph) -> dict:
    return _consumer_index(((n.name, map(parse_input, n.input)) for n in graph), {})


def _assert_numbering_orders_edges(graph: Graph) -> None:
    order = {name: i for i, name in enumerate(graph.sorted_topologically(graph.names()))}
    for node in graph:
        for spec in node.input:
            assert order[parse_input(spec)[0]] < order[node.name], (spec, node.name)


def _run(graph: Graph, edit) -> Graph:
    def broken_or_not(g: Graph, plan: object) -> tuple[Graph, PassRecord]:
        editor = Editor(g)
        edit(editor)
        return editor.finish(), PassRecord("test_pass")

    result, _ = run_passes(graph, None, (broken_or_not,))  # type: ignore[arg-type]
    return result


def test_a_valid_edit_keeps_exact_indexes():
    graph = _small_graph()

    def edit(editor):
        editor.add(_node(editor, "d", "Neg", ["b"]))
        editor.add(_node(editor, "e", "AddV2", ["d", "two"]))
        editor.mutable("c").input[0] = "e"  # a base node now reads new ones

    result = _run(graph, edit)
    assert result.consumers == _scratch_index(result)
    _assert_numbering_orders_edges(result)
    assert result._numbering is not None and "e" in result._numbering  # carried over, not re-sorted


def test_a_node_that_now_waits_on_a_later_one_is_numbered_up_not_re_sorted(monkeypatch):
    """As dedupe makes a tower's group of updates wait on the kept updates, numbered after it:
    the node and what reads it are numbered up past their inputs, without sorting the graph."""
    graph = _small_graph()
    first, second = sorted(["x", "two"], key=graph._numbering.__getitem__)  # type: ignore[union-attr]

    def edit(editor):
        editor.add(_node(editor, "later", "Neg", [second]))
        editor.mutable(first).input.append("^later")

    monkeypatch.setattr(Graph, "_full_numbering", lambda self: pytest.fail("the whole graph was sorted again"))
    result = _run(graph, edit)
    assert result._numbering["later"] < result._numbering[first]  # type: ignore[index]
    _assert_numbering_orders_edges(result)


def test_new_nodes_added_before_their_inputs_are_numbered_without_a_sort(monkeypatch):
    """The passes add a node, then the shared constant it reads (one per value and device)."""
    graph = _small_graph()

    def edit(editor):
        editor.add(_node(editor, "e", "AddV2", ["d", "two"]))
        editor.add(_node(editor, "d", "Neg", ["b"]))
        editor.mutable("c").input[0] = "e"

    monkeypatch.setattr(Graph, "_full_numbering", lambda self: pytest.fail("the whole graph was sorted again"))
    _assert_numbering_orders_edges(_run(graph, edit))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda e: e.add(_node(e, "d", "Neg", ["missing"])), "reads 'missing'"),
        (lambda e: e.remove("a"), "reads 'a'"),  # b and c (control) still read it
        (lambda e: e.mutable("x").input.append("^c"), "cycle"),
        (lambda e: (e.add(_node(e, "d", "Neg", ["c"])), e.mutable("a").input.append("^d")), "cycle"),
    ],
    ids=["dangling-new", "removed-but-read", "cycle-in-base", "cycle-through-new"],
)
def test_a_broken_pass_is_named(edit, message):
    with pytest.raises(PassError, match=rf"pass test_pass produced an invalid graph: .*{message}"):
        _run(_small_graph(), edit)


def test_an_invalid_input_is_caught_before_any_pass():
    graph_def = tf.compat.v1.GraphDef()
    graph_def.node.add(name="a", op="Neg", input=["nowhere"])
    with pytest.raises(GraphValidationError, match="reads 'nowhere'"):
        Graph.from_graph_def(graph_def).validate()


def test_removing_what_nothing_reads_is_valid():
    graph = _small_graph()
    result = _run(graph, lambda e: e.remove("c"))
    assert "c" not in result and result.consumers == _scratch_index(result)
    _assert_numbering_orders_edges(result)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # generators the exception closes
def test_in_place_assembly_is_undone_from_any_bytecode():
    """An exception at each bytecode of `to_graph_def` in place (every trace event: the sort's
    key calls, the cut, the library), as a signal handler's would be: `undo_in_place` and
    dropping what the edits appended give back the input byte for byte. Uninterrupted, the
    result is the copying assembly's (so is it when the exception is lost: one raised while a
    finished generator is closed is only printed)."""
    source = _small_graph().to_graph_def()
    source.library.function.add().signature.name = "old_fn"
    before = source.SerializeToString(deterministic=True)

    def edit(editor):
        editor.add(_node(editor, "d", "Neg", ["b"]))
        editor.replace(_node(editor, "b", "Sub", ["a", "two"]))
        editor.remove("c")
        editor.mutable("a").input[1] = "x"
        editor.library = type(source.library)()
        editor.library.function.add().signature.name = "new_fn"

    def assembled(n: int) -> tuple[bytes, int]:
        """The GraphDef's bytes after the assembly interrupted at tick n and undone (or not
        interrupted), and the ticks seen (0 when interrupted)."""
        graph_def = tf.compat.v1.GraphDef()
        graph_def.CopyFrom(source)
        graph = _run(Graph.from_graph_def(graph_def, storage=graph_def), edit)

        def stop() -> None:
            raise KeyboardInterrupt(f"tick {n}")

        try:
            seen = len(run_ticked(graph.to_graph_def, Graph.to_graph_def.__code__, Graph.to_graph_def.__code__, n, stop))
        except KeyboardInterrupt:
            graph.undo_in_place()
            del graph_def.node[len(source.node):]
            seen = 0
        return graph_def.SerializeToString(deterministic=True), seen

    done, total = assembled(0)
    expected = _run(Graph.from_graph_def(source), edit).to_graph_def().SerializeToString(deterministic=True)
    assert done == expected != before and total > 100
    outcomes = [assembled(n) for n in range(1, total + 1)]
    assert [n for n, (data, seen) in enumerate(outcomes, 1) if data != (expected if seen else before)] == []
    assert sum(not seen for _, seen in outcomes) >= 0.9 * total  # a few are lost closing generators, as gc runs


def test_an_edit_that_changes_nothing_returns_the_base():
    graph = _small_graph()
    assert _run(graph, lambda e: None) is graph


@pytest.mark.parametrize("in_place", [False, True])
def test_to_graph_def_puts_the_storage_in_graph_order(in_place):
    """Changed nodes where they were, removed and stale ones gone, new ones at the end; the
    source GraphDef is rewritten only when it is the storage."""
    source = _small_graph().to_graph_def()
    before = source.SerializeToString(deterministic=True)
    producer = source.versions.producer
    graph = Graph.from_graph_def(source, storage=source if in_place else None)

    def edit(editor):
        editor.add(_node(editor, "d", "Neg", ["b"]))
        editor.replace(_node(editor, "b", "Sub", ["a", "two"]))
        editor.remove("c")
        editor.mutable("a").input[1] = "x"

    out = _run(graph, edit).to_graph_def()
    assert [(n.name, n.op) for n in out.node] == [("x", "Placeholder"), ("two", "Const"), ("a", "Mul"), ("b", "Sub"), ("d", "Neg")]
    assert list(out.node[2].input) == ["x", "x"]
    assert producer > 0 and out.versions.producer == producer
    assert (out is source) == in_place
    assert (source.SerializeToString(deterministic=True) == before) != in_place


def _deep_net_graph() -> tuple[Graph, list[str]]:
    """deep_net's 2-tower, 2-layer training graph, synchronized, plus a v1 while loop (and the
    loop's node names)."""
    import os
    import sys

    from tensorflow.python.ops import control_flow_util

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import deep_net

    from bnrewrite import rewrite_graph

    graph_def = rewrite_graph(deep_net.build_graph_def(2, 2, updates="per_tower")).graph_def
    loop, v2 = tf.Graph(), control_flow_util.ENABLE_CONTROL_FLOW_V2
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = False
    try:
        with loop.as_default(), tf.name_scope("loop"):
            tf.compat.v1.while_loop(lambda i: i < 3, lambda i: i + 1, [tf.constant(0)])
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = v2
    graph_def.node.extend(loop.as_graph_def().node)
    graph = Graph.from_graph_def(graph_def)
    graph.validate()
    return graph, [node.name for node in loop.as_graph_def().node]


def test_ancestors_among_answers_depends_on_for_every_pair():
    """One sweep gives what a walk per pair gives, on a real synchronized graph (moving-average
    updates, all-reduces, a train op grouping per-tower groups) and a v1 while loop, but for the
    loop's Merge: depends_on follows its back-edge (the loop body "runs before" it), the sweep
    does not."""
    graph, loop = _deep_net_graph()
    names = list(graph.names())
    candidates, asked = names[::7] + loop, names[::5] + loop
    found = graph.ancestors_among(asked, candidates)
    assert found.keys() == set(asked)
    assert found["loop/while/Merge"] == {"loop/Const", "loop/while/Enter"}
    pairs = 0
    for name in (name for name in asked if name != "loop/while/Merge"):
        expected = {c for c in candidates if c != name and graph.depends_on(name, c)}
        assert found[name] == expected, name
        pairs += len(expected)
    assert pairs > 100  # the graph has chains enough for the comparison to mean something
