"""What `convert` may write and replace (docs/outputs.md), and that its outputs commit all
together or not at all: the path rule for OUT, --report, --dot and --tensorboard, SavedModel
links, fault injection at every step of the commit (tests/commit_faults.py, in a subprocess)
and real signals while the outputs are written."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from model_files import cached_models, tree_snapshot
import zygote

from bnrewrite import cli, io
from bnrewrite.errors import GraphValidationError, InputFormatError, OutputError, PassError
from bnrewrite.io import staging
from bnrewrite.io.staging import OLD_PREFIX, TEMP_PREFIX

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]),
       "TF_CPP_MIN_LOG_LEVEL": "3"}


@pytest.fixture(scope="module")
def files():
    return cached_models()


def convert(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["convert", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _put(path, data: bytes = b"precious") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _leftovers(directory) -> list[str]:
    return [n for n in os.listdir(directory) if n.startswith((TEMP_PREFIX, OLD_PREFIX))]


# ---------------------------------------------------------------------------
# The rule: what is at a path decides whether it may be replaced
# ---------------------------------------------------------------------------


def _setup_rule_case(name: str, tmp, files) -> tuple[list[str], int, str]:
    """Make what case `name` finds on disk; (convert's arguments, exit code, message)."""
    pb, out = files.pb, str(tmp / "o.pb")
    if name == "report_is_a_directory":
        _put(tmp / "v" / "sub" / "d.txt")
        return [pb, out, "--report", str(tmp / "v")], 10, r"--report \S+/v is a directory of 1 entry \(sub\); bnrewrite replaces only a regular file"
    if name == "dot_is_a_directory_even_with_force":
        _put(tmp / "v.dot" / "d.txt")
        return [pb, out, "--dot", str(tmp / "v.dot"), "--force"], 10, r"--dot \S+ is a directory of 1 entry \(d.txt\)"
    if name == "tensorboard_is_another_directory":
        _put(tmp / "logs" / "my_run" / "events.out.tfevents.1.host")
        return [pb, out, "--tensorboard", str(tmp / "logs"), "--force"], 10, r"--tensorboard \S+ is a directory of 1 entry \(my_run\); bnrewrite replaces only a TensorBoard directory"
    if name == "tensorboard_own_without_force":
        _put(tmp / "logs" / "before" / "events.out.tfevents.1.old")
        return [pb, out, "--tensorboard", str(tmp / "logs")], 10, r"already exists \(a directory of 1 entry \(before\)\); pass --force"
    if name == "out_is_a_directory_even_with_force":
        _put(tmp / "d" / "x" / "y")
        return [files.saved, str(tmp / "d"), "--force"], 10, r"OUT \S+/d is a directory of 1 entry \(x\); bnrewrite replaces only a SavedModel directory"
    if name == "out_is_a_fifo":
        os.mkfifo(tmp / "f.pb")
        return [pb, str(tmp / "f.pb"), "--force"], 10, r"OUT \S+ is a FIFO; bnrewrite replaces only a regular file"
    if name == "out_is_a_symlink":
        _put(tmp / "elsewhere.pb")
        os.symlink("elsewhere.pb", tmp / "link.pb")
        return [pb, str(tmp / "link.pb"), "--force"], 10, r"OUT \S+ is a symbolic link to elsewhere.pb; bnrewrite replaces only a regular file"
    if name == "report_exists_without_force":
        _put(tmp / "r.json")
        return [pb, out, "--report", str(tmp / "r.json")], 10, r"--report \S+ already exists \(a regular file\); pass --force"
    if name == "report_and_dot_are_one_path":
        return [pb, out, "--report", str(tmp / "x.dot"), "--dot", str(tmp / "x.dot")], 10, r"--dot \S+ overlaps --report"
    if name == "format_pb_from_two_metagraphs":
        return [files.saved, out, "--format", "pb"], 1, r"--format pb writes one GraphDef, but 2 MetaGraphs are selected \(\[train\], \[serve\]\); pick one with --tags"
    raise AssertionError(name)


RULE_CASES = [
    "report_is_a_directory", "dot_is_a_directory_even_with_force", "tensorboard_is_another_directory",
    "tensorboard_own_without_force", "out_is_a_directory_even_with_force", "out_is_a_fifo", "out_is_a_symlink",
    "report_exists_without_force", "report_and_dot_are_one_path", "format_pb_from_two_metagraphs",
]


@pytest.mark.parametrize("name", RULE_CASES)
def test_refused_and_nothing_touched(files, tmp_path, capsys, name):
    args, code, message = _setup_rule_case(name, tmp_path, files)
    before = tree_snapshot(str(tmp_path))
    got, out, err = convert(capsys, *args)
    lines = err.splitlines()
    assert got == code and len(lines) == 1 and re.search(message, lines[0]), (got, err)
    assert out == "" and "[" not in lines[0].replace("[train]", "").replace("[serve]", "")
    assert tree_snapshot(str(tmp_path)) == before, "something was written, replaced or deleted"


def test_force_replaces_what_bnrewrite_writes(files, tmp_path, capsys):
    """With --force: a file over a file, a SavedModel over a SavedModel, TensorBoard runs over
    the runs bnrewrite wrote; without it the same paths are refused (above)."""
    shutil.copytree(files.saved, tmp_path / "out")
    _put(tmp_path / "out" / "old.txt")
    _put(tmp_path / "r.json", b"old")
    _put(tmp_path / "d.dot", b"old")
    for run in ("before", "after"):
        _put(tmp_path / "tb" / run / "train" / "events.out.tfevents.1.old")
    code, _, err = convert(capsys, files.saved, str(tmp_path / "out"), "--tags", "train", "--force",
                           "--report", str(tmp_path / "r.json"), "--dot", str(tmp_path / "d.dot"),
                           "--tensorboard", str(tmp_path / "tb"))
    assert code == 0, err
    assert sorted(os.listdir(tmp_path / "out")) == ["assets", "saved_model.pb", "variables"]
    assert json.loads((tmp_path / "r.json").read_text())["output"]["written"] is True
    assert (tmp_path / "d.dot").read_text().startswith("digraph")
    for run in ("before", "after"):
        (events,) = os.listdir(tmp_path / "tb" / run / "train")
        assert events.startswith("events.out.tfevents.") and not events.endswith(".old")
    assert _leftovers(tmp_path) == []


# ---------------------------------------------------------------------------
# SavedModel links: inside ones kept (relative), outside ones refused
# ---------------------------------------------------------------------------


@pytest.fixture
def model_copy(files, tmp_path):
    shutil.copytree(files.saved, tmp_path / "model")
    return tmp_path / "model"


@pytest.mark.parametrize("link,target,message", [
    ("assets/ext", "../../outside", r"assets/ext is a link to \.\./\.\./outside, outside the model directory"),
    ("parent", "..", r"parent is a link to \.\., outside the model directory"),  # OUT's parent: no recursion
    ("assets/gone.txt", "nothing_here.txt", r"assets/gone.txt is a broken link"),
])
def test_saved_model_links_that_leave_it_are_refused(model_copy, tmp_path, capsys, link, target, message):
    _put(tmp_path / "outside" / "secret.txt")
    os.symlink(target, model_copy / link)
    before = tree_snapshot(str(tmp_path))
    code, out, err = convert(capsys, str(model_copy), str(tmp_path / "out"), "--tags", "train")
    assert code == 3 and re.search(message, err), err
    assert tree_snapshot(str(tmp_path)) == before


@pytest.mark.parametrize("moved,link,target", [
    ("saved_model.pb", "saved_model.pb", "../outside/saved_model.pb"),
    ("saved_model.pb", "saved_model.pb", "ABSOLUTE"),
    ("variables", "variables", "../outside/variables"),
    ("variables/variables.index", "variables/variables.index", "../../outside/variables.index"),
])
def test_saved_model_graph_file_and_variables_through_links_that_leave_it_are_refused(
        model_copy, tmp_path, capsys, moved, link, target):
    """What bnrewrite reads (the graph file) and what it copies unchanged (variables/) are held
    to the same rule as every other link: refused before anything is read or written, by the
    API (io.load) and by convert (exit 3), whatever the output format, and by inspect."""
    outside = tmp_path / "outside" / os.path.basename(moved)
    outside.parent.mkdir()
    shutil.move(str(model_copy / moved), str(outside))
    os.symlink(str(outside) if target == "ABSOLUTE" else target, model_copy / link)
    shown_target = re.escape(str(outside) if target == "ABSOLUTE" else target)
    message = rf"^SavedModel \S+: {re.escape(link)} is a link to {shown_target}, outside the model directory; .*replace the link"
    with pytest.raises(InputFormatError, match=message):
        io.load(str(model_copy))
    before = tree_snapshot(str(tmp_path))
    for extra in ([], ["--format", "meta"]):
        code, out, err = convert(capsys, str(model_copy), str(tmp_path / "out"), "--tags", "train", *extra)
        assert code == 3 and re.search(message[1:], err) and len(err.strip().splitlines()) == 1 and not out, err
    assert cli.main(["inspect", str(model_copy)]) == 3
    assert re.search(message[1:], capsys.readouterr().err)
    assert tree_snapshot(str(tmp_path)) == before


def test_saved_model_links_inside_it_stay_links(model_copy, tmp_path, capsys):
    os.symlink("vocab.txt", model_copy / "assets" / "alias.txt")
    os.symlink("../variables", model_copy / "assets" / "vars")
    os.symlink(".", model_copy / "assets" / "self")
    os.symlink(str(model_copy / "assets" / "vocab.txt"), model_copy / "absolute.txt")
    code, _, err = convert(capsys, str(model_copy), str(tmp_path / "out"), "--tags", "train")
    assert code == 0, err
    out = tmp_path / "out"
    assert {name: os.readlink(out / name) for name in ("assets/alias.txt", "assets/vars", "assets/self", "absolute.txt")} == {
        "assets/alias.txt": "vocab.txt", "assets/vars": "../variables", "assets/self": ".", "absolute.txt": "assets/vocab.txt"}
    assert (out / "absolute.txt").read_bytes() == (model_copy / "assets" / "vocab.txt").read_bytes()
    assert sorted(os.listdir(out / "assets" / "vars")) == sorted(os.listdir(model_copy / "variables"))
    assert os.path.realpath(out / "assets" / "vars").startswith(str(out))


def test_special_file_inside_a_saved_model_is_an_input_error(model_copy, tmp_path, capsys):
    os.mkfifo(model_copy / "assets" / "pipe")
    code, _, err = convert(capsys, str(model_copy), str(tmp_path / "out"), "--tags", "train")
    assert code == 3 and re.search(r"SavedModel \S+ holds assets/pipe, a FIFO", err), err
    assert "[" not in err and not os.path.exists(tmp_path / "out") and _leftovers(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file_inside_a_saved_model_is_an_input_error(model_copy, tmp_path, capsys):
    locked = model_copy / "assets" / "vocab.txt"
    locked.chmod(0)
    try:
        code, _, err = convert(capsys, str(model_copy), str(tmp_path / "out"), "--tags", "train")
    finally:
        locked.chmod(0o644)
    assert code == 3 and re.search(r"cannot read \S+vocab.txt: Permission denied", err), err
    assert not os.path.exists(tmp_path / "out") and _leftovers(tmp_path) == []


# ---------------------------------------------------------------------------
# --verify names the graph that does not import
# ---------------------------------------------------------------------------


def test_verify_says_which_graph_fails(files):
    """An Add of shapes [2] and [3] beside the towers (TensorFlow's shape inference rejects it;
    the rewrite does not infer shapes there and would copy it): convert's rewrite refuses the
    input, naming TensorFlow's complaint. --verify tells a malformed input from a rewrite that
    broke the graph (PassError)."""
    import tensorflow as tf

    model = io.load(files.pb)
    graph_def = model.entries[0].graph_def
    for name, size in (("two", 2), ("three", 3)):
        const = graph_def.node.add(name=name, op="Const")
        const.attr["dtype"].type = tf.float32.as_datatype_enum
        const.attr["value"].tensor.CopyFrom(tf.make_tensor_proto([0.0] * size, tf.float32))
    stray = graph_def.node.add(name="stray", op="AddV2", input=["two", "three"])
    stray.attr["T"].type = tf.float32.as_datatype_enum
    with pytest.raises(GraphValidationError, match=r"the graph does not import into TensorFlow \(.*stray.*\); "
                                                   r"fix or re-export it"):
        io.rewrite(model)
    rewrite = io.Rewrite(model, [io.Outcome(model.entries[0], result=model.entries[0])])  # as if it had been rewritten
    with pytest.raises(GraphValidationError, match=r"the rewritten graph does not import into TensorFlow, and neither "
                                                   r"does the input graph itself \(.*stray.*\); fix or re-export the input"):
        io.verify(rewrite)
    fresh = io.rewrite(io.load(files.pb))  # the input imports; its rewrite, given a dangling input, does not
    fresh.outcomes[0].result.graph_def.node[0].input.append("no_such_node")
    with pytest.raises(PassError, match=r"the rewritten graph does not import into TensorFlow \(.*no_such_node"):
        io.verify(fresh)


# ---------------------------------------------------------------------------
# All or nothing: faults at every commit step, real signals while writing
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def all_or_nothing(files, tmp_path_factory):
    """The fault-injection run (commit_faults.py) and the signalled runs, side by side:
    (its JSON summary, [(signal, scene, exit code, stderr, before, after)])."""
    work = tmp_path_factory.mktemp("faults")
    faults = subprocess.Popen([sys.executable, os.path.join(TESTS, "commit_faults.py"), files.root, str(work / "commit")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        signalled = _signalled_runs(files, work / "signals")
        out, err = faults.communicate(timeout=300)
    finally:
        faults.kill()
    assert faults.returncode == 0, err[-3000:]
    return json.loads(out), signalled


def test_every_fault_at_every_commit_step(all_or_nothing):
    summary, _ = all_or_nothing
    assert summary["bad"] == [], "\n".join(summary["bad"][:10])
    steps = summary["steps"]
    # The scenes' commits: each of 4 (2) old outputs moved aside, each new one moved in, old copies removed.
    assert steps["scene_saved_model"]["os.rename"] >= 4 and steps["scene_graph_file"]["os.link"] == 2
    assert summary["trials"] == 5 * sum(sum(s.values()) for s in steps.values()) >= 90
    assert summary["outcomes"]["before"] > 0 and summary["outcomes"]["new"] > 0
    assert summary["inputs_untouched"]


def _signalled_run(source: str, scene: str, signum: int, delay: float) -> tuple[int, str, dict, dict]:
    """convert `source` into `scene` (old outputs there, --force); send `signum` `delay`
    seconds after the first staged name appears. (exit code, stderr, before, after). A run that
    finished before the signal reached it (a loaded machine can miss the whole window) tested
    nothing: it is run again, up to 5 times, from the outputs it left."""
    for _ in range(5):
        before = tree_snapshot(scene)
        argv = [sys.executable, "-m", "bnrewrite", "convert", source, os.path.join(scene, "out"), "--tags", "train",
                "--force", "--report", os.path.join(scene, "r.json")]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if any(n.startswith(TEMP_PREFIX) for n in os.listdir(scene)):
                time.sleep(delay)
                proc.send_signal(signum)
                break
            time.sleep(0.002)
        _, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            break
    return proc.returncode, err, before, tree_snapshot(scene)


def _signalled_runs(files, work) -> list[tuple]:
    """SIGINT and SIGTERM while a SavedModel with 3,000 asset files is being copied."""
    source = work / "model"
    shutil.copytree(files.saved, source)
    for k in range(3000):
        _put(source / "assets" / "many" / f"{k}.txt", os.urandom(256))
    scenes = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        scene = work / signal.Signals(signum).name
        shutil.copytree(files.saved, scene / "out")
        _put(scene / "r.json", b"old report")
        scenes.append((str(source), str(scene), signum, 0.0 if signum == signal.SIGINT else 0.02))
    with zygote.interruptible(), ThreadPoolExecutor(len(scenes)) as pool:  # SIGINT reaches them as at a terminal
        results = list(pool.map(lambda a: _signalled_run(*a), scenes))
    return [(signum, *result) for (_, _, signum, _), result in zip(scenes, results)]


def test_real_signals_while_writing(all_or_nothing):
    """The process unwinds, says nothing was written, and every path is as it was, no temporary
    left. (SIGHUP takes SIGTERM's path; commit_faults.py sends all three at every commit step.)"""
    _, signalled = all_or_nothing
    for signum, code, err, before, after in signalled:
        name = signal.Signals(signum).name
        assert code == 128 + signum, (name, code, err)
        assert err.splitlines() == [f"bnrewrite: error: {'interrupted' if signum == signal.SIGINT else 'stopped by ' + name}; "
                                    "nothing was written"], err
        assert after == before, f"{name}: {sorted(set(after.items()) ^ set(before.items()))[:5]}"


# ---------------------------------------------------------------------------
# After a killed run (SIGKILL, power loss): what it left beside the outputs
# ---------------------------------------------------------------------------


def _dead_pid() -> int:
    """The id of a process that has finished (and been waited for)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_a_dead_run_are_told_apart(tmp_path):
    """Only names of the exact pattern whose process is gone count: another run's (alive),
    look-alikes and another target's are left alone; temporary names and hard-linked old
    copies are removed; an old copy with the target missing is refused with the mv to undo it."""
    dead, alive = _dead_pid(), os.getpid()
    out = tmp_path / "o.pb"
    _put(out, b"new graph")
    names = {
        f"{TEMP_PREFIX}o.pb-{dead}-abc_1234": "removed",
        f"{OLD_PREFIX}o.pb-{dead}-xyz98765": "hard link",
        f"{OLD_PREFIX}o.pb-{dead}-qqqqqqqq": "kept",
        f"{TEMP_PREFIX}o.pb-{alive}-abcd1234": "alive",
        f"{TEMP_PREFIX}o.pb-{dead}-abc": "look-alike",
        f"{TEMP_PREFIX}o.pb-x{dead}-abcd1234": "look-alike",
        f"{TEMP_PREFIX}other.pb-{dead}-abcd1234": "another target",
        f"{TEMP_PREFIX}o.pb-1-{dead}-abcd1234": "another target",  # of a file named "o.pb-1"
    }
    for name, role in names.items():
        if role == "hard link":
            os.link(out, tmp_path / name)
        else:
            _put(tmp_path / name, role.encode())
    (tmp_path / f"{TEMP_PREFIX}o.pb-{dead}-dir_5678").mkdir()  # a staged directory
    _put(tmp_path / f"{TEMP_PREFIX}o.pb-{dead}-dir_5678" / "saved_model.pb")
    notes = staging.clear_leftovers(str(out), "OUT")
    assert notes[0].startswith(f"removed 3 leftover(s) of OUT {out} from a killed bnrewrite run: "), notes
    assert notes[1] == (f"a killed bnrewrite run replaced OUT {out} but left its earlier content at "
                        f"{tmp_path / (OLD_PREFIX + f'o.pb-{dead}-qqqqqqqq')}; delete it if you do not need it")
    left = {n for n in os.listdir(tmp_path)}
    assert left == {"o.pb", *(n for n, role in names.items() if role not in ("removed", "hard link"))}
    assert out.read_bytes() == b"new graph"

    out.unlink()  # the killed run had moved the earlier content aside and not yet put the new one in
    before = tree_snapshot(str(tmp_path))
    aside = tmp_path / f"{OLD_PREFIX}o.pb-{dead}-qqqqqqqq"
    with pytest.raises(OutputError, match=re.escape(
            f"a previous bnrewrite run was killed while replacing OUT {out}: its earlier content is at {aside}; "
            f"restore it with `mv {aside} {out}` (or delete it), then run again; nothing was written")):
        staging.clear_leftovers(str(out), "OUT")
    assert tree_snapshot(str(tmp_path)) == before


def test_second_run_after_a_commit_killed_at_every_step(files, tmp_path, capsys):
    """killed_commit.py commits a SavedModel OUT and a --report with --force and dies (os._exit,
    as SIGKILL) before each file operation of the commit in turn; then `convert` runs again
    on the same paths: refused, with the mv that restores OUT, when the kill left OUT moved
    aside (nothing changed by the refusal; after the mv, the run succeeds); otherwise it removes
    the dead run's temporary names, says so on stderr, and writes both outputs. Paths that
    are not the dead run's own (another run's, alive) are untouched."""
    script = os.path.join(TESTS, "killed_commit.py")

    def killed(scene, k: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, script, str(scene / "out"), str(scene / "r.json"), str(k)],
                              capture_output=True, text=True, env=ENV, timeout=60)

    def scene_at(k: int):
        scene = tmp_path / f"k{k}"
        shutil.copytree(files.saved, scene / "out")
        _put(scene / "r.json", b"old report")
        _put(scene / f"{TEMP_PREFIX}r.json-{os.getpid()}-live_123", b"another run's")
        return scene, killed(scene, k)

    _, clean = scene_at(0)
    steps = int(clean.stdout)
    assert steps == 6, clean  # out moved aside, moved in; r.json linked aside, replaced; both old copies removed
    outcomes = []
    for k in range(1, steps + 1):
        scene, run = scene_at(k)
        assert run.returncode == 9, run.stderr
        argv = [files.saved, str(scene / "out"), "--tags", "train", "--force", "--report", str(scene / "r.json")]
        if not (scene / "out").exists():
            before = tree_snapshot(str(scene))
            code, _, err = convert(capsys, *argv)
            aside = next(scene / n for n in os.listdir(scene) if n.startswith(OLD_PREFIX + "out-"))
            assert code == OutputError.exit_code and err.splitlines() == [
                f"bnrewrite: error: a previous bnrewrite run was killed while replacing OUT {scene / 'out'}: its earlier "
                f"content is at {aside}; restore it with `mv {aside} {scene / 'out'}` (or delete it), then run again; "
                "nothing was written"], err
            assert tree_snapshot(str(scene)) == before
            os.rename(aside, scene / "out")  # what the message says to do
            outcomes.append("refused")
        temps = [n for n in _leftovers(scene) if n.startswith(TEMP_PREFIX) and "live_123" not in n]
        code, _, err = convert(capsys, *argv)
        assert code == 0, err
        notes = [line for line in err.splitlines() if line.startswith("bnrewrite: note: removed")]
        assert len(notes) == (1 if any(n.startswith(TEMP_PREFIX + "out-") for n in temps) else 0) + (
            1 if any(n.startswith(TEMP_PREFIX + "r.json-") for n in temps) else 0), (k, err, temps)
        assert json.loads((scene / "r.json").read_text())["command"] == "convert"
        left = _leftovers(scene)
        assert [n for n in left if n.startswith(TEMP_PREFIX)] == [f"{TEMP_PREFIX}r.json-{os.getpid()}-live_123"], (k, left)
        for old in (n for n in left if n.startswith(OLD_PREFIX)):  # earlier content kept only where said
            assert f"left its earlier content at {scene / old}" in err, (k, err)
        outcomes.append("removed" if notes else "clean")
    assert outcomes == ["removed", "refused", "removed", "removed", "removed", "clean", "clean"], outcomes
