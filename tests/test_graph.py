"""The graph model: edits, the incremental indexes, and validation after every pass.

Validation after an edit only looks where the edit touched the graph, and the consumer index
and topological numbering are carried over from the base graph instead of rebuilt; these
tests hold both to what a check of the whole graph from scratch says.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

from bnrewrite.errors import GraphValidationError, PassError
from bnrewrite.graph import Graph, _consumer_index, parse_input
from bnrewrite.passes import run_passes
from bnrewrite.passes.record import PassRecord
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
        editor = g.edit()
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
