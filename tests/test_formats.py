"""bnrewrite.io: formats told from content, clear errors for anything else, consistent
MetaGraphs, SavedModels that load and train, and all-or-nothing writes."""

from __future__ import annotations

import gzip
import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import text_format
from model_files import cached_models, train_meta, train_saved_model, tree_digest
from models import build_reference, make_batches, max_rel_error, train

from bnrewrite import (
    BnRewriteError,
    GraphValidationError,
    InferenceOnlyError,
    InputFormatError,
    OutputError,
    io,
)

STEPS = 3
TOLERANCE = 2e-4
UNSYNCED_AT_LEAST = 1e-2


@pytest.fixture(scope="module")
def files():
    return cached_models()


@pytest.fixture(scope="module")
def oracle(files):
    """The data and what one device fed all K*B examples gets from it."""
    data = make_batches(files.spec, STEPS)
    ref = build_reference(files.spec)
    return data, train(ref.graph, ref, data, num_devices=1)


def _write(model, path):
    with io.Outputs() as outputs:
        io.stage_model(outputs, model, path)
        outputs.commit()


# ---------------------------------------------------------------------------
# Telling formats apart
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("source,name,expected", [
    ("pb", "model.pbtxt", "pb"),
    ("pbtxt", "model.pb", "pbtxt"),
    ("meta", "graph.pb", "meta"),
    ("metatxt", "graph.txt", "metatxt"),
    ("pb", "no_extension", "pb"),
])
def test_format_is_told_from_content_not_extension(files, tmp_path, source, name, expected):
    target = tmp_path / name
    shutil.copy(getattr(files, source), target)
    model = io.load(str(target))
    assert model.format == expected
    assert len(model.entries) == 1 and len(model.entries[0].graph_def.node) > 100


def test_saved_model_directory(files):
    model = io.load(files.saved)
    assert model.format == "savedmodel"
    assert [e.tags for e in model.entries] == [("train",), ("serve",)]


def test_message_types_are_not_confused(files):
    """A SavedModel proto, a MetaGraphDef and a GraphDef each parse as what they are, binary and text."""
    saved = open(os.path.join(files.saved, "saved_model.pb"), "rb").read()
    for data, expected in [
        (saved, "savedmodel"),
        (open(files.meta, "rb").read(), "meta"),
        (open(files.pb, "rb").read(), "pb"),
        (open(files.pbtxt, "rb").read(), "pbtxt"),
        (open(files.metatxt, "rb").read(), "metatxt"),
    ]:
        assert io.parse_bytes(data)[0] == expected


def test_saved_model_graph_file_points_at_its_directory(files):
    with pytest.raises(InputFormatError, match="pass its directory"):
        io.load(os.path.join(files.saved, "saved_model.pb"))


def _nameless_graph() -> bytes:
    gd = tf.compat.v1.GraphDef()
    gd.node.add(op="Const")
    return gd.SerializeToString()


BAD_BYTES = [
    ("empty", b"", "is empty"),
    ("whitespace", b"  \n\n ", "is empty"),
    ("jpeg", b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01", "JPEG image"),
    ("png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00", "PNG image"),
    ("hdf5", b"\x89HDF\r\n\x1a\n\x00\x00\x00\x00\x00\x08\x08\x00", "HDF5"),
    ("zip", b"PK\x03\x04\x14\x00\x00\x00\x08\x00\xb7\xac", "zip archive"),
    ("gzip", gzip.compress(b"node {}"), "gzip"),
    ("json", json.dumps({"class_name": "Sequential", "config": {}}).encode(), "JSON"),
    ("prose", b"these are my notes about the model\nnothing to see\n", "text file but not"),
    ("random", bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)), "not a GraphDef"),
    ("nameless", _nameless_graph(), "a node has no name"),
]


@pytest.mark.parametrize("name,data,message", BAD_BYTES, ids=[b[0] for b in BAD_BYTES])
def test_not_a_model(tmp_path, name, data, message):
    path = tmp_path / f"{name}.pb"
    path.write_bytes(data)
    with pytest.raises(InputFormatError, match=message) as info:
        io.load(str(path))
    assert "\n" not in str(info.value)


def test_truncated_binary_and_text(files, tmp_path):
    data = open(files.pb, "rb").read()
    for cut in (7, len(data) // 3, len(data) - 2):
        path = tmp_path / f"cut{cut}.pb"
        path.write_bytes(data[:cut])
        with pytest.raises((InputFormatError, GraphValidationError)):
            io.load(str(path))
    text = open(files.pbtxt, "rb").read()
    path = tmp_path / "cut.pbtxt"
    path.write_bytes(text[: len(text) // 2])
    with pytest.raises(InputFormatError, match="is it truncated"):
        io.load(str(path))


def test_truncation_at_a_node_boundary_is_a_smaller_valid_graph_or_an_error(files, tmp_path):
    """A GraphDef has no length or checksum: a cut between nodes leaves a well-formed prefix.
    Loading must then fail on what is missing (dangling inputs) or load the prefix as it is."""
    gd = io.load(files.pb).entries[0].graph_def
    prefix = tf.compat.v1.GraphDef()
    prefix.node.extend(gd.node[: len(gd.node) // 2])
    path = tmp_path / "prefix.pb"
    path.write_bytes(prefix.SerializeToString())
    try:
        model = io.load(str(path))
    except BnRewriteError:
        return
    assert len(model.entries[0].graph_def.node) == len(gd.node) // 2


def test_directory_that_is_not_a_saved_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(InputFormatError, match="not a SavedModel"):
        io.load(str(tmp_path))


def test_missing_input(tmp_path):
    with pytest.raises(InputFormatError, match="does not exist"):
        io.load(str(tmp_path / "nope.pb"))


def test_dangling_input_is_a_graph_error(files, tmp_path):
    gd = io.load(files.pb).entries[0].graph_def
    gd.node[-1].input.append("no_such_node")
    path = tmp_path / "dangling.pb"
    path.write_bytes(gd.SerializeToString())
    with pytest.raises(GraphValidationError, match="no_such_node"):
        io.load(str(path))


# ---------------------------------------------------------------------------
# MetaGraphDef: collections, restore and train
# ---------------------------------------------------------------------------


def test_meta_collections_stay_consistent(files):
    model = io.load(files.meta)
    rewrite = io.rewrite(model)
    before, after = model.entries[0].meta_graph, rewrite.model.entries[0].meta_graph
    removed = {r["node"] for r in rewrite.outcomes[0].report.removed}
    assert removed
    names = {n.name for n in after.graph_def.node}
    assert before.collection_def.keys() == after.collection_def.keys()
    for key, collection in before.collection_def.items():
        new = after.collection_def[key]
        if collection.WhichOneof("kind") == "node_list":
            expected = [v for v in collection.node_list.value if v.split(":")[0] not in removed]
            assert list(new.node_list.value) == expected, key
            assert all(v.split(":")[0] in names for v in new.node_list.value), key
        else:
            assert new == collection, key
    update_ops = before.collection_def[tf.compat.v1.GraphKeys.UPDATE_OPS].node_list.value
    assert len(after.collection_def[tf.compat.v1.GraphKeys.UPDATE_OPS].node_list.value) == len(update_ops) // 2
    assert after.saver_def == before.saver_def
    assert after.meta_info_def == before.meta_info_def


def test_rewritten_meta_restores_checkpoint_and_trains_like_one_device(files, oracle, tmp_path):
    data, expected = oracle
    rewrite = io.rewrite(io.load(files.meta))
    out = str(tmp_path / "synced.meta")
    _write(rewrite.model, out)
    synced = train_meta(out, files.ckpt, files.built, data, num_devices=files.spec.towers)
    unsynced = train_meta(files.meta, files.ckpt, files.built, data, num_devices=files.spec.towers)
    assert max_rel_error(unsynced, expected) > UNSYNCED_AT_LEAST, "the un-rewritten graph matched: the oracle cannot fail"
    assert max_rel_error(synced, expected) <= TOLERANCE


# ---------------------------------------------------------------------------
# SavedModel
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_out(files, tmp_path_factory):
    before = tree_digest(files.saved)
    rewrite = io.rewrite(io.load(files.saved))
    out = str(tmp_path_factory.mktemp("saved") / "synced")
    _write(rewrite.model, out)
    assert tree_digest(files.saved) == before
    return out, rewrite


def test_saved_model_rewrites_training_graph_and_keeps_the_rest(files, saved_out):
    out, rewrite = saved_out
    kinds = {o.entry.tags: ("rewritten" if o.report else "kept") for o in rewrite.outcomes}
    assert kinds == {("train",): "rewritten", ("serve",): "kept"}
    original, result = io.load(files.saved), io.load(out)
    assert result.saved_model.meta_graphs[1] == original.saved_model.meta_graphs[1]
    assert result.saved_model.saved_model_schema_version == original.saved_model.saved_model_schema_version
    digests_in, digests_out = tree_digest(files.saved), tree_digest(out)
    for name, digest in digests_in.items():
        if name.startswith(("variables", "assets")):
            assert digests_out[name] == digest, name
    train_meta_out = result.saved_model.meta_graphs[0]
    names = {n.name for n in train_meta_out.graph_def.node}
    assert train_meta_out.signature_def.keys() == original.saved_model.meta_graphs[0].signature_def.keys()
    for what, node in io.meta_references(train_meta_out):
        assert node in names, what


def test_saved_model_loads_and_trains_like_one_device(files, oracle, saved_out):
    data, expected = oracle
    out, _ = saved_out
    synced = train_saved_model(out, ["train"], files.built, data, num_devices=files.spec.towers)
    unsynced = train_saved_model(files.saved, ["train"], files.built, data, num_devices=files.spec.towers)
    assert max_rel_error(unsynced, expected) > UNSYNCED_AT_LEAST
    assert max_rel_error(synced, expected) <= TOLERANCE


def test_saved_model_serving_graph_still_loads(files, saved_out):
    out, _ = saved_out
    graph = tf.Graph()
    with tf.compat.v1.Session(graph=graph) as sess:
        meta = tf.compat.v1.saved_model.loader.load(sess, ["serve"], out)
        signature = meta.signature_def["serving_default"]
        images = np.zeros([files.spec.batch, files.spec.image, files.spec.image, files.spec.channels], np.float32)
        logits = sess.run(signature.outputs["logits"].name, {signature.inputs["images"].name: images})
    assert logits.shape == (files.spec.batch, 4)


def test_saved_model_tags(files):
    model = io.load(files.saved)
    only_train = io.rewrite(model, io.parse_tags(["train"]))
    assert [o.entry.tags for o in only_train.outcomes] == [("train",)]
    assert only_train.model.saved_model.meta_graphs[1] == model.saved_model.meta_graphs[1]
    with pytest.raises(InputFormatError, match=r"no MetaGraph tagged \[nope\].*\[train\], \[serve\]"):
        io.rewrite(model, io.parse_tags(["nope"]))
    with pytest.raises(InferenceOnlyError, match="inference mode"):
        io.rewrite(model, io.parse_tags(["serve"]))
    with pytest.raises(BnRewriteError, match="--tags applies to SavedModels"):
        io.rewrite(io.load(files.pb), io.parse_tags(["train"]))


def test_text_saved_model_stays_text(files, tmp_path):
    source = tmp_path / "text_saved"
    shutil.copytree(files.saved, source)
    proto = io.load(str(source)).saved_model
    os.remove(source / "saved_model.pb")
    (source / "saved_model.pbtxt").write_text(text_format.MessageToString(proto))
    rewrite = io.rewrite(io.load(str(source)), io.parse_tags(["train"]))
    _write(rewrite.model, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path / "out")) == ["assets", "saved_model.pbtxt", "variables"]
    assert io.load(str(tmp_path / "out")).format == "savedmodel"


# ---------------------------------------------------------------------------
# Output formats
# ---------------------------------------------------------------------------


def test_format_conversions(files, tmp_path):
    saved = io.rewrite(io.load(files.saved), io.parse_tags(["train"]))
    meta = io.as_format(saved.model, "meta", [o.entry for o in saved.outcomes])
    assert meta.format == "meta" and meta.entries[0].meta_graph.signature_def
    with pytest.raises(BnRewriteError, match="pick one with --tags"):
        io.as_format(io.load(files.saved), "pb")
    with pytest.raises(BnRewriteError, match="needs variables"):
        io.as_format(io.load(files.pb), "savedmodel")
    for source, fmt in [("meta", "pb"), ("pb", "meta"), ("pb", "pbtxt"), ("meta", "metatxt")]:
        converted = io.as_format(io.load(getattr(files, source)), fmt)
        path = str(tmp_path / f"{source}.{fmt}")
        _write(converted, path)
        assert io.load(path).format == fmt


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def test_check_output(files, tmp_path):
    existing = tmp_path / "exists.pb"
    existing.write_bytes(b"x")
    (tmp_path / "afile").write_bytes(b"x")
    cases = [
        (files.pb, False, "is the input"),
        (os.path.join(files.saved, "variables", "out"), True, "overlaps the input"),
        (str(existing), False, "already exists"),
        (str(tmp_path / "missing_dir" / "out.pb"), False, "does not exist"),
        (str(tmp_path / "afile" / "out.pb"), False, "is not a directory"),
    ]
    for path, force, message in cases:
        with pytest.raises(OutputError, match=message):
            io.check_output(path, [files.pb, files.saved], force)
    io.check_output(str(existing), [files.pb], force=True)


def test_failed_write_leaves_nothing(tmp_path):
    target = tmp_path / "out"
    existing = tmp_path / "existing.pb"
    existing.write_bytes(b"old")

    def explode(directory):
        (open(os.path.join(directory, "half"), "wb")).write(b"partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OutputError, match="No space left"), io.Outputs(force=True) as outputs:
        outputs.stage_bytes(str(existing), b"new")
        outputs.stage_dir(str(target), explode)
        outputs.commit()
    assert sorted(os.listdir(tmp_path)) == ["existing.pb"]
    assert existing.read_bytes() == b"old"


def test_force_replaces_only_what_bnrewrite_writes(tmp_path):
    """A file replaces a file, a SavedModel a SavedModel (with force); a file never a directory."""
    target = tmp_path / "out"
    target.mkdir()
    (target / "saved_model.pb").write_text("old")
    with pytest.raises(OutputError, match=r"is a SavedModel directory; bnrewrite replaces only a regular file"), \
            io.Outputs(force=True) as outputs:
        outputs.stage_bytes(str(target), b"file now")
    with io.Outputs(force=True) as outputs:
        outputs.stage_dir(str(target), lambda d: open(os.path.join(d, "new.txt"), "w").write("new"))
        outputs.commit()
    assert os.listdir(target) == ["new.txt"]
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_signature_naming_a_removed_op_is_an_error(files):
    """Signatures must still resolve: one that names a duplicate update the rewrite removes fails."""
    model = io.load(files.saved)
    meta = model.saved_model.meta_graphs[0]
    removed = "tower_1/net/bn1/AssignMovingAvg/ReadVariableOp"
    assert removed in {n.name for n in meta.graph_def.node}
    meta.signature_def["train"].outputs["stale"].name = removed + ":0"  # entries[0] holds this same message
    with pytest.raises(GraphValidationError, match=rf"removed {removed}, which signature 'train' output 'stale'"):
        io.rewrite(model, io.parse_tags(["train"]))
