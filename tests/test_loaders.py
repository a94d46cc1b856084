"""Every output loads with TensorFlow's own loader (issue 34): each batch-norm form the README
lists, written as a GraphDef, a .meta (with its checkpoint) and a SavedModel, converted by
`bnrewrite convert`, loaded with import_graph_def / import_meta_graph + restore /
saved_model.loader.load and trained like one device fed K*B examples (the un-rewritten
towers do not). The v1 control-flow contexts (cond_context, while_context) keep naming only
nodes that remain, and convert refuses a result the loader would reject.
"""

from __future__ import annotations

import pytest
import tensorflow as tf
from model_files import FormFiles, train_meta, train_saved_model, tree_snapshot, write_formats
from models import Result, Spec, assert_synced, make_batches, one_device_run, train

from bnrewrite import PassError, rewrite_graph
from bnrewrite.cli import main
from bnrewrite.rewrite import collections_def
from bnrewrite.rewrite.collections_def import CONTEXT_COLLECTIONS, drop_removed

STEPS = 2
TOLERANCE = 2e-4

#: Every form of the README's table that is rewritten, K=2.
FORMS = {
    "fused_layer": Spec(layer="legacy"),
    "fused_op": Spec(layer="fused_op"),
    "moments": Spec(layer="legacy_unfused"),
    "renorm": Spec(layer="legacy_unfused", renorm=True),
    "cond_v1": Spec(layer="legacy_cond_v1"),
    "renorm_cond_v1": Spec(layer="legacy_cond_v1", renorm=True),
    "moments_cond_v1": Spec(layer="moments_cond_v1"),
    "cond_v2": Spec(layer="legacy_cond_v2"),
    "moments_cond_v2": Spec(layer="moments_cond_v2"),
}
FORMATS = ("pb", "meta", "saved")
#: The forms whose towers hold v1 cond contexts.
V1_FORMS = ("cond_v1", "renorm_cond_v1", "moments_cond_v1")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Each form's files, written once per module on first use."""
    cache: dict[str, FormFiles] = {}

    def get(form: str) -> FormFiles:
        if form not in cache:
            cache[form] = write_formats(str(tmp_path_factory.mktemp(form)), FORMS[form])
        return cache[form]

    return get


@pytest.fixture(scope="module")
def unsynced(written):
    """Each form's GraphDef as written, not rewritten, trained: the oracle's must-not-match side."""
    cache: dict[str, Result] = {}

    def get(form: str) -> Result:
        if form not in cache:
            files, spec = written(form), FORMS[form]
            cache[form] = train(files.pb, files.built, make_batches(spec, STEPS), num_devices=spec.towers)
        return cache[form]

    return get


def _loaded_and_trained(files: FormFiles, fmt: str, out: str, spec: Spec) -> Result:
    """Train what `convert` wrote at `out` (format `fmt`) after TensorFlow's loader loaded it."""
    data = make_batches(spec, STEPS)
    if fmt == "pb":
        return train(out, files.built, data, num_devices=spec.towers)  # import_graph_def, then the initializer
    if fmt == "meta":
        return train_meta(out, files.ckpt, files.built, data, spec.towers)
    return train_saved_model(out, ["train"], files.built, data, spec.towers)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("form", FORMS)
def test_converted_output_loads_and_trains_like_one_device(written, unsynced, tmp_path, form, fmt):
    files, spec = written(form), FORMS[form]
    out = str(tmp_path / ("synced" if fmt == "saved" else f"synced.{fmt}"))
    assert main(["convert", getattr(files, fmt), out, "-q"]) == 0
    synced = _loaded_and_trained(files, fmt, out, spec)
    assert_synced(f"{form} {fmt}", synced, unsynced(form), one_device_run(spec, STEPS), TOLERANCE)


def _contexts(meta) -> dict[str, object]:
    """The MetaGraphDef's v1 cond contexts (top level) by name."""
    proto = CONTEXT_COLLECTIONS["cond_context"]
    return {c.context_name: c for c in map(proto.FromString, meta.collection_def["cond_context"].bytes_list.value)}


@pytest.mark.parametrize("form", V1_FORMS)
def test_to_graph_imports_and_contexts_name_only_nodes_that_remain(written, form):
    """rewrite_graph(tf.Graph).to_graph() imports the MetaGraphDef (a KeyError on a removed
    update's switch_t before): a context whose pivot went is dropped, the others lose exactly
    the removed names."""
    files = written(form)
    result = rewrite_graph(files.built.graph)
    gone = {row["node"] for row in result.report.removed}
    removed = lambda name: name.split(":")[0] in gone  # noqa: E731
    with files.built.graph.as_default():
        before = _contexts(tf.compat.v1.train.export_meta_graph(graph=files.built.graph))
    after = _contexts(result.meta_graph_def)
    dropped = {name for name, c in before.items() if removed(c.pivot_name) or removed(c.pred_name)}
    assert after.keys() == before.keys() - dropped
    assert bool(dropped) == (form != "moments_cond_v1")  # per-tower statistics: no update is removed
    for name, context in after.items():
        old = before[name]
        stale = old.values_def.external_values.keys() - context.values_def.external_values.keys()
        assert set(context.values_def.values) == {v for v in old.values_def.values if not removed(v)} - stale, name
        assert not any(removed(k) or removed(v) for k, v in context.values_def.external_values.items()), name
    graph = result.to_graph()
    assert len(graph.get_collection("cond_context")) == len(after)
    train_op, loss = result.find(graph, (files.built.train_op, files.built.loss))
    assert train_op.type == "NoOp" and loss.dtype == tf.float32


def test_convert_refuses_what_the_loader_rejects(written, tmp_path, monkeypatch, capsys):
    """With the contexts left naming the removed nodes (as before issue 34), convert and inspect
    fail with PassError (exit 12) in one line and write nothing; the input is untouched."""
    files = written("cond_v1")
    monkeypatch.setattr(collections_def, "prune_context", lambda context, removed: collections_def.INTACT)
    for fmt in ("meta", "saved"):
        source, out = getattr(files, fmt), tmp_path / fmt
        before = tree_snapshot(source)
        for command in (["convert", source, str(out)], ["inspect", source]):
            assert main(command) == PassError.exit_code, command
            err = capsys.readouterr().err.strip()
            assert "\n" not in err and "does not import into TensorFlow" in err and "cond_1/switch_t:0" in err, err
        assert not out.exists() and tree_snapshot(source) == before


def _v1_loops() -> tf.Graph:
    """Control flow v1: loop a (whose body holds an unused Identity and an unused tf.cond) and,
    in scope b, a tf.cond holding a loop."""
    from tensorflow.python.ops import control_flow_util

    v2, control_flow_util.ENABLE_CONTROL_FLOW_V2 = control_flow_util.ENABLE_CONTROL_FLOW_V2, False
    graph = tf.Graph()
    try:
        with graph.as_default():
            x = tf.compat.v1.placeholder_with_default(5, [], name="x")
            pred = tf.compat.v1.placeholder_with_default(True, [], name="pred")

            def body(i):
                tf.identity(i, name="extra")
                tf.compat.v1.cond(i > 1, lambda: i * 2, lambda: i * 3, name="side")
                return i + 1

            with tf.name_scope("a"):
                tf.identity(tf.compat.v1.while_loop(lambda i: i < 3, body, [0]), name="out")
            with tf.name_scope("b"):
                tf.compat.v1.cond(pred, lambda: tf.compat.v1.while_loop(lambda i: i < x, lambda i: i + 1, [0]), lambda: x)
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = v2
    return graph


def test_while_and_nested_contexts_keep_only_nodes_that_remain():
    """Nodes removed with all their consumers (an unused op in a loop body, a cond nested in the
    loop, a cond holding a loop): the MetaGraphDef imports with `drop_removed` and not without,
    the loop keeps its context, minus the nested cond, and still runs."""
    graph = _v1_loops()
    with graph.as_default():
        meta = tf.compat.v1.train.export_meta_graph(graph=graph)
    removed = {n.name for n in meta.graph_def.node
               if n.name.startswith(("b/", "a/while/side/")) or n.name == "a/while/extra"}
    kept = [n for n in meta.graph_def.node if n.name not in removed]
    del meta.graph_def.node[:]
    meta.graph_def.node.extend(kept)
    with pytest.raises(KeyError), tf.Graph().as_default():
        tf.compat.v1.train.import_meta_graph(meta)
    log: list = []
    drop_removed(meta, removed, log)
    assert {id(values) for values, _ in log} == {id(meta.collection_def[k].bytes_list.value) for k in CONTEXT_COLLECTIONS}
    loops = [CONTEXT_COLLECTIONS["while_context"].FromString(d) for d in meta.collection_def["while_context"].bytes_list.value]
    assert [loop.context_name for loop in loops] == ["a/while/while_context"] and not loops[0].nested_contexts
    assert not meta.collection_def["cond_context"].bytes_list.value  # a's inner cond nested in its loop, b's dropped
    with tf.Graph().as_default() as imported:
        tf.compat.v1.train.import_meta_graph(meta)
        with tf.compat.v1.Session() as sess:
            assert sess.run("a/out:0") == 3
    assert imported.get_operation_by_name("a/while/add")._get_control_flow_context().name == "a/while/while_context"


def test_input_whose_collections_do_not_load_is_refused(written, tmp_path, capsys):
    """A .meta whose own collection names a node it lacks: the loader rejects the input too, so
    convert says the input is at fault (GraphValidationError, exit 11) and writes nothing."""
    from bnrewrite import GraphValidationError

    meta = tf.compat.v1.MetaGraphDef.FromString(open(written("cond_v1").meta, "rb").read())
    meta.collection_def["train_op"].node_list.value.append("no_such_op")
    source, out = tmp_path / "stale.meta", tmp_path / "out.meta"
    source.write_bytes(meta.SerializeToString())
    assert main(["convert", str(source), str(out)]) == GraphValidationError.exit_code
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "neither does the input graph itself" in err and "no_such_op" in err, err
    assert not out.exists()
