"""The command line end to end: every format, every command, and every kind of bad input (one
error line, its exit code, no traceback, nothing written, input untouched). Runs go through the
command line's main() in this process, its output and exit code captured as a subprocess's
would be (a TensorFlow import per run would cost more than the runs); `--help`, usage errors
and the README's `bnrewrite run` example run as `python -m bnrewrite` in a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from io import StringIO

import pytest
from model_files import cached_models, tree_digest

from bnrewrite import io
from bnrewrite.cli import EXIT_CODES, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def in_subprocess(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    """`python -m bnrewrite ARGS` in a process of its own."""
    return subprocess.run([sys.executable, "-m", "bnrewrite", *args], capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=300)


def bnrewrite(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    """`bnrewrite ARGS` run by the command line's main() in this process, in `cwd`: its exit
    code, stdout and stderr as a subprocess would give them."""
    out, err = StringIO(), StringIO()
    with contextlib.chdir(cwd or os.getcwd()), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse: --help, usage errors
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return subprocess.CompletedProcess(["bnrewrite", *args], code, out.getvalue(), err.getvalue())


def run_all(jobs: dict) -> dict:
    """{key: (args, cwd)} -> {key: CompletedProcess}."""
    return {key: bnrewrite(*args, cwd=cwd) for key, (args, cwd) in jobs.items()}


def assert_one_error_line(proc: subprocess.CompletedProcess, code: int, message: str = "") -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{proc.stderr}"
    assert lines[0].startswith("bnrewrite: error: "), lines[0]
    assert proc.returncode == code, (proc.returncode, lines[0])
    if message:
        assert re.search(message, lines[0]), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def files():
    return cached_models()


# ---------------------------------------------------------------------------
# --help
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", [[], ["convert"], ["inspect"], ["diff"]])
def test_help_has_examples(command):
    proc = in_subprocess(*command, "--help")
    assert proc.returncode == 0 and not proc.stderr
    assert "examples:" in proc.stdout
    if not command:
        for code, _, _ in EXIT_CODES:
            assert re.search(rf"^\s+{code}\s", proc.stdout, re.MULTILINE), code


def test_usage_errors_are_one_line():
    for args in (["convert"], ["frobnicate"], ["convert", "a.pb", "b.pb", "--backend", "tpu"], []):
        proc = in_subprocess(*args)
        assert_one_error_line(proc, 2)


def test_convert_to_nccl_for_gpus_this_machine_lacks_says_so(tmp_path, capsys):
    """Towers on /gpu:0..1 converted where fewer GPUs are: one note that the NCCL output runs only
    where those GPUs are, and how to get one that runs here (--backend local: no note)."""
    import tensorflow as tf
    from models import Spec, build_towers

    tf.io.write_graph(build_towers(Spec(device="gpu")).graph.as_graph_def(), str(tmp_path), "gpu.pb", as_text=False)
    gpus = len(tf.config.list_physical_devices("GPU"))
    assert main(["convert", str(tmp_path / "gpu.pb"), str(tmp_path / "nccl.pb")]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "NCCL" in line]
    assert notes == ([] if gpus >= 2 else [
        f"note: the output all-reduces by NCCL on /device:GPU:0..1, which this machine does not have ({gpus} GPU(s)): "
        "it runs only where those GPUs are; --backend local writes one that runs here too (soft placement puts the "
        "towers on the CPU, where collective would need a device per tower)"])
    assert main(["convert", "--backend", "local", str(tmp_path / "gpu.pb"), str(tmp_path / "local.pb")]) == 0
    assert "NCCL" not in capsys.readouterr().out


# ---------------------------------------------------------------------------
# Every format: inspect and convert
# ---------------------------------------------------------------------------

FORMATS = ["pb", "pbtxt", "meta", "metatxt", "saved"]


@dataclass
class Session:
    root: str
    runs: dict = field(default_factory=dict)
    before: dict = field(default_factory=dict)


@pytest.fixture(scope="module")
def session(files, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("cli"))
    s = Session(out, before=tree_digest(files.root))
    jobs = {}
    for fmt in FORMATS:
        source = getattr(files, fmt)
        target = os.path.join(out, f"synced_{fmt}")
        if fmt != "metatxt":
            jobs[("inspect", fmt)] = (["inspect", source] + (["--json"] if fmt == "meta" else []), None)
        extra = {
            "pb": ["--report", os.path.join(out, "pb.json"), "--dot", os.path.join(out, "layer.dot"),
                   "--tensorboard", os.path.join(out, "tb"), "--verify"],
            "pbtxt": ["-q"],
            "saved": ["--report", os.path.join(out, "saved.json"), "--verify"],
        }.get(fmt, [])
        jobs[("convert", fmt)] = (["convert", source, target, *extra], None)
    jobs[("dry-run", "saved-train-meta")] = (["convert", files.saved, os.path.join(out, "train.meta"), "--tags", "train",
                                              "--format", "meta", "--dry-run", "--report", os.path.join(out, "dry.json")], None)
    with open(os.path.join(out, "existing.pb"), "wb") as f:
        f.write(b"old")
    jobs[("convert", "force")] = (["convert", files.pb, os.path.join(out, "existing.pb"), "--force", "-q"], None)
    s.runs = run_all(jobs)
    later = {
        ("diff", "pb"): (["diff", files.pb, os.path.join(out, "synced_pb")], None),
        ("diff-json", "saved"): (["diff", files.saved, os.path.join(out, "synced_saved"), "--json"], None),
        ("inspect", "rewritten"): (["inspect", os.path.join(out, "synced_pb")], None),
    }
    s.runs.update(run_all(later))
    return s


@pytest.mark.parametrize("fmt", ["pb", "pbtxt", "saved"])
def test_inspect(session, fmt):
    proc = session.runs[("inspect", fmt)]
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    out = proc.stdout
    assert "towers (device): /device:CPU:0, /device:CPU:1" in out
    for tower in ("tower_0", "tower_1"):
        for layer in ("bn1", "bn2"):
            assert f"{tower}/net/{layer}/FusedBatchNormV3" in out
    assert "convert would:" in out and "convert would succeed" in out
    if fmt == "saved":
        assert "MetaGraph [serve]: nothing to do, kept unchanged" in out


@pytest.mark.parametrize("fmt", FORMATS)
def test_convert_keeps_the_format(session, files, fmt):
    proc = session.runs[("convert", fmt)]
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    out = os.path.join(session.root, f"synced_{fmt}")
    model = io.load(out)
    assert model.format == ("savedmodel" if fmt == "saved" else fmt)
    marked = [n for e in model.entries for n in e.graph_def.node if "_bnrewrite" in n.attr]
    assert marked
    if fmt == "pbtxt":
        assert proc.stdout == "", "-q prints nothing"
    else:
        assert "2 batch-norm layer(s) synchronized across 2 towers" in proc.stdout
        assert f"wrote {out}" in proc.stdout


def test_convert_outputs_report_dot_tensorboard(session):
    proc = session.runs[("convert", "pb")]
    assert "verified: 1 rewritten graph(s) import into TensorFlow" in proc.stdout
    report = json.load(open(os.path.join(session.root, "pb.json")))
    assert report["schema_version"] == 1 and report["command"] == "convert"
    assert report["input"]["format"] == "pb" and report["output"]["written"] is True
    (graph,) = report["graphs"]
    assert graph["status"] == "rewritten" and graph["reason"] is None
    body = graph["report"]
    assert body["totals"]["layers_synced"] == 2 and body["totals"]["collectives_added"] == 8
    assert [row["layer"] for row in body["layers"]] == ["net/bn1", "net/bn2"]
    dot = open(os.path.join(session.root, "layer.dot")).read()
    assert dot.startswith("digraph") and "removed:" in dot and "dashed" in dot
    assert "all_reduce/sum" in dot and 'label="all-reduce"' in dot  # the local sum and its members, linked
    for run in ("before", "after"):
        events = os.listdir(os.path.join(session.root, "tb", run))
        assert len(events) == 1 and events[0].startswith("events.out.tfevents")


def test_convert_saved_model_report(session):
    report = json.load(open(os.path.join(session.root, "saved.json")))
    assert [(g["tags"], g["status"]) for g in report["graphs"]] == [(["train"], "rewritten"), (["serve"], "kept")]
    assert report["graphs"][0]["reason"] is None and "inference mode" in report["graphs"][1]["reason"]
    assert report["verified"] is True


def test_dry_run_writes_only_the_report(session):
    """Also: a SavedModel's [train] MetaGraph as a .meta (--tags, --format)."""
    proc = session.runs[("dry-run", "saved-train-meta")]
    assert proc.returncode == 0, proc.stderr
    assert "dry run: nothing written to" in proc.stdout and "MetaGraphDef (binary)" in proc.stdout
    assert not os.path.exists(os.path.join(session.root, "train.meta"))
    report = json.load(open(os.path.join(session.root, "dry.json")))
    assert report["output"] == {"path": os.path.join(session.root, "train.meta"), "format": "meta", "written": False}
    assert [(g["tags"], g["status"]) for g in report["graphs"]] == [(["train"], "rewritten"), (["serve"], "unselected")]


def test_inspect_json(session):
    proc = session.runs[("inspect", "meta")]
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)
    assert document["command"] == "inspect" and document["output"] is None
    assert document["input"]["format"] == "meta"
    report = document["graphs"][0]["report"]
    assert report["towers"] == ["/device:CPU:0", "/device:CPU:1"]
    assert [len(row["sites"]) for row in report["layers"]] == [2, 2]


def test_force_overwrites(session):
    proc = session.runs[("convert", "force")]
    assert proc.returncode == 0, proc.stderr
    assert io.load(os.path.join(session.root, "existing.pb")).format == "pb"
    assert not [n for n in os.listdir(session.root) if n.startswith(".")], "temporary files left behind"


def test_inspect_of_a_rewritten_graph_says_so(session):
    proc = session.runs[("inspect", "rewritten")]
    assert "already rewritten" in proc.stdout
    assert_one_error_line(proc, 8, "already rewritten")


def test_diff(session):
    proc = session.runs[("diff", "pb")]
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    added = re.search(r"AddN\s+(\d+) -> (\d+)", out)  # one local sum per layer, the backward's (the forward gathers by a Pack)
    assert added and int(added[2]) - int(added[1]) == 2, out
    assert not re.search(r"^  Pad\s", out, re.MULTILINE), out  # no tower pads its rows under the local backend
    assert re.search(r"IdentityN\s+0 -> 4", out), out  # the gradient ops, one per layer and tower
    assert re.search(r"net/bn1: \d+ added, 4 replaced \(FusedBatchNormGradV3 x2, FusedBatchNormV3 x2\), 15 removed", out)
    document = json.loads(session.runs[("diff-json", "saved")].stdout)
    train, serve = document["graphs"]
    assert train["tags"] == ["train"] and train["op_counts"]["AddN"][1] - train["op_counts"]["AddN"][0] == 2
    assert train["layers"]["net/bn1"]["collectives"] == 4
    assert serve["tags"] == ["serve"] and serve["op_counts"] == {} and not serve["added"] and not serve["removed"]


def test_inputs_untouched(session, files):
    assert tree_digest(files.root) == session.before


# ---------------------------------------------------------------------------
# Bad input: one line, its exit code, nothing written, input untouched
# ---------------------------------------------------------------------------


def _bad_cases(files, work: str) -> dict:
    def put(name: str, data: bytes) -> str:
        path = os.path.join(work, "inputs", name)
        with open(path, "wb") as f:
            f.write(data)
        return path

    os.makedirs(os.path.join(work, "inputs", "not_a_saved_model"))
    put(os.path.join("not_a_saved_model", "notes.txt"), b"hello")
    graph = open(files.pb, "rb").read()
    corrupt = bytearray(graph)
    for i in range(100, len(corrupt), 997):
        corrupt[i] ^= 0xA5
    put("a_file", b"x")
    rewritten = io.rewrite(io.load(files.pb)).model
    with io.Outputs() as outputs:
        io.stage_model(outputs, rewritten, os.path.join(work, "inputs", "synced.pb"))
        outputs.commit()
    inputs = os.path.join(work, "inputs")
    return {
        # name: (args (OUT is {out}), exit code, message)
        "corrupt": ([put("corrupt.pb", bytes(corrupt)), "{out}"], 3, "corrupt"),
        "truncated": ([put("truncated.pb", graph[: len(graph) // 2]), "{out}"], 3, "truncated"),
        "empty": ([put("empty.pb", b""), "{out}"], 3, "is empty"),
        "jpeg": ([put("photo.jpg", b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01" + bytes(200)), "{out}"], 3, "JPEG"),
        "text": ([put("readme.txt", b"just some notes\n"), "{out}"], 3, "text file"),
        "not_a_saved_model": ([os.path.join(inputs, "not_a_saved_model"), "{out}"], 3, "not a SavedModel"),
        "missing": ([os.path.join(inputs, "nope.pb"), "{out}"], 3, "does not exist"),
        "no_batch_norm": ([files.no_bn, "{out}"], 4, "no batch-norm"),
        "inference_only": ([files.inference, "{out}"], 5, "inference mode"),
        "one_tower": ([files.one_tower, "{out}"], 6, "only one tower"),
        "towers_do_not_line_up": ([files.mismatch, "{out}"], 7, "lines up"),
        "already_rewritten": ([os.path.join(inputs, "synced.pb"), "{out}"], 8, "already rewritten"),
        "nccl_on_cpu": ([files.pb, "{out}", "--backend", "nccl"], 9, r"GPU.*; use --backend local \(or --backend collective across workers\)$"),
        "out_equals_in": ([files.pb, files.pb, "--force"], 10, "is the input"),
        "out_exists": ([files.pb, "{existing}"], 10, r"already exists \(a regular file\); pass --force"),
        "out_dir_unwritable": ([files.pb, os.path.join(inputs, "a_file", "out.pb")], 10, "not a directory"),
        "out_dir_missing": ([files.pb, os.path.join(work, "no", "such", "dir", "out.pb")], 10, "does not exist"),
        "tag_missing": ([files.saved, "{out}", "--tags", "nope"], 3, r"no MetaGraph tagged \[nope\]"),
        "tag_inference_only": ([files.saved, "{out}", "--tags", "serve"], 5, r"MetaGraph \[serve\]"),
        "bad_group_size": ([files.pb, "{out}", "--group-size", "3"], 1, "group size 3"),
    }


@pytest.fixture(scope="module")
def bad(files, tmp_path_factory):
    work = str(tmp_path_factory.mktemp("bad"))
    cases = _bad_cases(files, work)
    before_models = tree_digest(files.root)
    jobs, context = {}, {}
    for name, (args, code, message) in cases.items():
        case_dir = os.path.join(work, name)
        os.makedirs(case_dir)
        existing = os.path.join(case_dir, "existing.pb")
        shutil.copy(files.pb, existing)
        args = [a.format(out=os.path.join(case_dir, "out.pb"), existing=existing) for a in args]
        inputs = [a for a in args[:1] if os.path.exists(a)]
        context[name] = (case_dir, {p: tree_digest(p) for p in inputs}, tree_digest(case_dir), code, message)
        jobs[name] = (["convert", *args, "--report", os.path.join(case_dir, "report.json")], case_dir)
    results = run_all(jobs)
    return results, context, before_models


@pytest.mark.parametrize("name", [
    "corrupt", "truncated", "empty", "jpeg", "text", "not_a_saved_model", "missing", "no_batch_norm",
    "inference_only", "one_tower", "towers_do_not_line_up", "already_rewritten", "nccl_on_cpu", "out_equals_in",
    "out_exists", "out_dir_unwritable", "out_dir_missing", "tag_missing", "tag_inference_only", "bad_group_size",
])
def test_bad_input(bad, files, name):
    results, context, before_models = bad
    proc = results[name]
    case_dir, inputs_before, dir_before, code, message = context[name]
    assert_one_error_line(proc, code, message)
    assert proc.stdout == ""
    for path, digest in inputs_before.items():
        assert tree_digest(path) == digest, f"{path} changed"
    assert tree_digest(case_dir) == dir_before, "something was written (OUT, the report or a temporary file)"
    assert sorted(os.listdir(case_dir)) == ["existing.pb"]
    assert tree_digest(files.root) == before_models


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into a read-only directory")
def test_read_only_output_directory(files, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        proc = bnrewrite("convert", files.pb, str(locked / "out.pb"))
        assert_one_error_line(proc, 10, "not writable")
        assert os.listdir(locked) == []
    finally:
        locked.chmod(0o755)


# ---------------------------------------------------------------------------
# The README's examples
# ---------------------------------------------------------------------------


def readme_commands() -> list[tuple[str, list[str]]]:
    """(command, expected output lines) of every `$ bnrewrite ...` in README.md's console blocks."""
    text = open(os.path.join(ROOT, "README.md")).read()
    commands = []
    for block in re.findall(r"```console\n(.*?)```", text, re.DOTALL):
        current = None
        for line in block.splitlines():
            if line.startswith("$ "):
                current = (line[2:], [])
                commands.append(current)
            elif current is not None:
                current[1].append(line)
    return [c for c in commands if c[0].startswith("bnrewrite ")]


def test_readme_examples_run(files, tmp_path):
    commands = readme_commands()
    assert len(commands) >= 4, "README.md should show the command line in ```console blocks"
    shutil.copy(files.pb, tmp_path / "model.pb")
    shutil.copy(files.meta, tmp_path / "model.meta")
    shutil.copytree(files.saved, tmp_path / "saved_model")
    (tmp_path / "examples").mkdir()
    shutil.copy(os.path.join(ROOT, "examples", "multi_gpu_train.py"), tmp_path / "examples")
    for command, expected in commands:  # `run` in a process of its own, the others through main() here
        args = shlex.split(command)[1:]
        proc = (in_subprocess if args[0] == "run" else bnrewrite)(*args, cwd=str(tmp_path))
        errors = [line for line in expected if line.startswith("bnrewrite: error:")]
        if errors:
            assert proc.returncode != 0 and proc.stderr.strip() == errors[0].strip(), (command, proc.stderr)
        else:
            assert proc.returncode == 0, (command, proc.stderr)
            shown = [line for line in expected if line.strip() and not line.strip().startswith("...")]
            if shown:
                assert shown[0].strip() in proc.stdout + proc.stderr, (command, shown[0], proc.stdout[:500])


# ---------------------------------------------------------------------------
# In-process: the last-resort paths
# ---------------------------------------------------------------------------


def _raise(exc):
    def fail(*args, **kwargs):
        raise exc
    return fail


@pytest.mark.parametrize("exc,code,message", [
    (RuntimeError("boom"), 70, r"internal error: RuntimeError: boom \(a bnrewrite bug: please report it"),
    (KeyboardInterrupt(), 130, "interrupted; nothing was written"),
])
def test_unexpected_errors_are_one_line(files, tmp_path, monkeypatch, capsys, exc, code, message):
    from bnrewrite import cli

    monkeypatch.setattr(io, "rewrite", _raise(exc))
    assert cli.main(["convert", files.pb, str(tmp_path / "out.pb"), "--report", str(tmp_path / "r.json")]) == code
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err
    assert os.listdir(tmp_path) == []


def test_dot_layer_must_exist(files, tmp_path, capsys):
    from bnrewrite import cli

    code = cli.main(["convert", files.pb, str(tmp_path / "out.pb"), "--dot", str(tmp_path / "l.dot"), "--dot-layer", "net/bn9"])
    assert code == 1
    assert "choose one of net/bn1, net/bn2" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------
# What a new user ran into (issue 13)
# ---------------------------------------------------------------------------


def _tf2_saved_model(path: str, batch_norm: bool) -> str:
    """A TF2 SavedModel (tf.saved_model.save): a tf.function with an inference-mode
    FusedBatchNormV3, or without batch norm; its ops live in the function library."""
    import tensorflow as tf

    class Net(tf.Module):
        def __init__(self) -> None:
            self.v = [tf.Variable(tf.ones([2]) * k) for k in (1.0, 0.0, 0.0, 1.0)]

        @tf.function(input_signature=[tf.TensorSpec([None, 4, 4, 2])])
        def __call__(self, x):
            if not batch_norm:
                return x * self.v[0]
            return tf.raw_ops.FusedBatchNormV3(x=x, scale=self.v[0], offset=self.v[1], mean=self.v[2],
                                               variance=self.v[3], is_training=False).y

    tf.saved_model.save(Net(), path)
    return path


@pytest.fixture(scope="module")
def tf2(tmp_path_factory):
    """inspect, inspect --json and convert of TF2 SavedModels, with and without batch norm."""
    root = tmp_path_factory.mktemp("tf2")
    jobs = {}
    for name, bn in (("no_bn", False), ("bn", True)):
        model = _tf2_saved_model(str(root / name), bn)
        jobs[(name, "inspect")] = (["inspect", model], None)
        jobs[(name, "verbose")] = (["inspect", model, "-v"], None)
        jobs[(name, "json")] = (["inspect", model, "--json"], None)
        jobs[(name, "convert")] = (["convert", model, str(root / f"{name}_out"), "--report", str(root / f"{name}.json")], None)
    return run_all(jobs)


@pytest.mark.parametrize("name,code,error,message", [
    ("no_bn", 4, "NoBatchNormError", "no batch-norm op"),
    ("bn", 5, "InferenceOnlyError", "all 1 batch-norm ops are in inference mode"),
])
def test_tf2_saved_model_inspect_and_convert_agree(tf2, name, code, error, message):
    convert = assert_one_error_line(tf2[(name, "convert")], code, message)
    assert assert_one_error_line(tf2[(name, "inspect")], code, message) == convert
    document = json.loads(tf2[(name, "json")].stdout)
    assert document["error"]["class"] == error and document["error"]["exit_code"] == code
    assert tf2[(name, "json")].returncode == code


def test_inference_batch_norm_in_a_tf_function_is_counted(tf2):
    assert "batch-norm ops: 0 in training mode, 1 in inference mode" in tf2[("bn", "inspect")].stdout
    assert re.search(r"function __inference_\S+/FusedBatchNormV3 \(inference mode\)", tf2[("bn", "verbose")].stdout)
    assert "0 in training mode, 0 in inference mode" in tf2[("no_bn", "inspect")].stdout


@pytest.mark.parametrize("args,message", [
    (["--workers", "2"], r"--workers 2 needs --task-index I"),
    (["--task-index", "1"], r"--task-index 1 needs --workers N"),
    (["--workers", "2", "--task-index", "2"], r"--task-index 2 is not one of the 2 workers \(0\.\.1\)"),
])
def test_workers_need_a_task_index(files, tmp_path, args, message):
    proc = bnrewrite("convert", files.pb, str(tmp_path / "out.pb"), *args)
    assert_one_error_line(proc, 2, message)
    assert os.listdir(tmp_path) == []


def test_inspect_shows_the_plan_once(session):
    out = session.runs[("inspect", "pb")].stdout
    assert out.count("net/bn1: replace") == 1
    assert "synchronized across" not in out and "grads/tower" not in out, "convert's report printed again"
    assert out.count("totals: 2 layers") == 1


def _hand_written_updates(path: str) -> str:
    """Two towers of fused batch norm whose moving-average updates sit outside the layer's scope
    (`tower_k/AssignMovingAvg`), with gradients: the layer is `bn`, from its variables."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.training.moving_averages import assign_moving_average

    graph = tf.Graph()
    with graph.as_default():
        with tf.compat.v1.variable_scope("bn"):
            gamma, beta, mean, var = (tf.compat.v1.get_variable(n, initializer=np.full(2, v, np.float32), trainable=t)
                                      for n, v, t in (("gamma", 1, True), ("beta", 0, True),
                                                      ("moving_mean", 0, False), ("moving_variance", 1, False)))
        ops = []
        for k in range(2):
            with tf.device(f"/cpu:{k}"), tf.name_scope(f"tower_{k}"):
                x = tf.compat.v1.placeholder(tf.float32, [2, 3, 3, 2], name="x")
                y, m, v = tf.compat.v1.nn.fused_batch_norm(x, gamma, beta, is_training=True)
                ops += [assign_moving_average(mean, m, 0.9), assign_moving_average(var, v, 0.9)]
                ops += tf.gradients(tf.reduce_sum(tf.square(y)), [x, gamma, beta])
        tf.group(*ops, name="train_op")
    with open(path, "wb") as f:
        f.write(graph.as_graph_def().SerializeToString())
    return path


def test_diff_names_the_layer_of_hand_written_updates(tmp_path):
    model = _hand_written_updates(str(tmp_path / "hand.pb"))
    synced = str(tmp_path / "synced.pb")
    convert = bnrewrite("convert", model, synced, "--report", str(tmp_path / "r.json"))
    assert convert.returncode == 0, convert.stderr
    removed = json.load(open(tmp_path / "r.json"))["graphs"][0]["report"]["removed"]
    assert any(r["node"] == "tower_1/AssignMovingAvg" and "bn/moving_mean" in r["why"] for r in removed)
    diff = bnrewrite("diff", model, synced)
    assert diff.returncode == 0, diff.stderr
    assert re.search(rf"^  bn: \d+ added, 4 replaced .*, {len(removed)} removed,", diff.stdout, re.MULTILINE), diff.stdout
    assert not re.search(r"\(not in a layer\): \d+ added, [1-9]\d* removed", diff.stdout), diff.stdout
