"""`--dot` pictures: rendered to SVG/PNG by the graphviz-pure dependency when no system Graphviz
is installed (the README's install brings no `dot`), found without PATH (the SVG by a real
`python -m bnrewrite`, the PNG through main() in process); bad targets fail
before the rewrite with one line; the layer's neighbourhood stays bounded in a deep net."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from model_files import cached_models
from tensorflow.core.framework.node_def_pb2 import NodeDef
from test_cli import ENV, assert_one_error_line
from test_cli import bnrewrite as in_process

from bnrewrite.errors import OutputError
from bnrewrite.io import visualize

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def files():
    return cached_models()


@pytest.fixture(scope="module")
def no_path(tmp_path_factory) -> dict[str, str]:
    """An environment whose PATH is one empty directory: no `dot`, and no graphviz-pure either
    (a venv's or a --user install's scripts directory need not be on PATH)."""
    empty = str(tmp_path_factory.mktemp("empty-path"))
    assert shutil.which("dot", path=empty) is None and shutil.which(visualize._BUNDLED, path=empty) is None
    return {**ENV, "PATH": empty}


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bnrewrite", *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.fixture(scope="module")
def rendered(files, no_path, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, str]]:
    """`convert model.pb out.pb --dot layer.svg` and `.png` without a system dot: the SVG in a
    process of its own, the PNG meanwhile through main() in this one, with the same PATH."""
    out = str(tmp_path_factory.mktemp("rendered"))
    args = {ext: ["convert", files.pb, os.path.join(out, f"out_{ext}.pb"), "--dot", os.path.join(out, f"layer.{ext}")]
            for ext in ("svg", "png")}
    with ThreadPoolExecutor(1) as pool:
        svg = pool.submit(run, args["svg"], no_path)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PATH", no_path["PATH"])
            png = in_process(*args["png"])
        return {"svg": (svg.result(), args["svg"][-1]), "png": (png, args["png"][-1])}


def test_svg_without_system_dot(rendered):
    proc, path = rendered["svg"]
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert f"note: {path}: layer net/bn1 before/after" in proc.stdout
    svg = open(path, encoding="utf-8").read()
    assert svg.startswith("<?xml") and "<svg" in svg and svg.rstrip().endswith("</svg>")
    for name in ("tower_0/net/bn1/FusedBatchNormV3", "tower_1/net/bn1/FusedBatchNormV3", "all_reduce/sum",
                 "removed: duplicate update", "legend"):
        assert name in svg, name


def test_png_without_system_dot(rendered):
    proc, path = rendered["png"]
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    assert width > 1000 and height > 500, (width, height)


@pytest.mark.parametrize("target,message", [
    ("layer.txt", r"--dot .*layer\.txt: unknown picture format '\.txt'; use \.dot or \.gv .*\.svg or \.png"),
    ("layer", r"unknown picture format '\(no extension\)'"),
    ("missing/layer.svg", r"cannot write .*layer\.svg: .*missing does not exist; create the directory first"),
    ("a_file/layer.svg", r"cannot write .*layer\.svg: .*a_file is not a directory"),
    ("layer.pdf", r"nothing here renders PDF; install Graphviz \(its dot writes PDF\), or write .*layer\.dot"),
])
def test_bad_target_is_one_line_and_writes_nothing(files, no_path, tmp_path, target, message):
    (tmp_path / "a_file").write_text("not a directory")
    before = sorted(os.listdir(tmp_path))
    proc = run(["convert", files.pb, str(tmp_path / "out.pb"), "--dot", str(tmp_path / target)], no_path)
    assert_one_error_line(proc, OutputError.exit_code, message)
    assert sorted(os.listdir(tmp_path)) == before


def test_no_renderer_at_all(files, tmp_path, monkeypatch, capsys):
    """Moved here from test_cli.py: with neither dot nor graphviz-pure, SVG fails before the rewrite."""
    from bnrewrite import cli

    monkeypatch.setattr(visualize.shutil, "which", lambda name: None)
    monkeypatch.setattr(visualize, "_bundled", lambda: None)
    assert cli.main(["convert", files.pb, str(tmp_path / "out.pb"), "--dot", str(tmp_path / "layer.svg")]) == 10
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "nothing here renders SVG" in err[0] and "layer.dot" in err[0], err
    assert os.listdir(tmp_path) == []


def test_system_dot_comes_first(monkeypatch):
    monkeypatch.setattr(visualize.shutil, "which", lambda name: "/opt/graphviz/dot" if name == "dot" else None)
    assert visualize._program("layer.png") == "/opt/graphviz/dot"


def test_renderer_failure_is_one_line(files, tmp_path, monkeypatch, capsys):
    from bnrewrite import cli

    failing = tmp_path / "bin" / "dot"
    failing.parent.mkdir()
    failing.write_text("#!/bin/sh\necho 'Warning: something' >&2\necho 'Error: syntax error in line 3' >&2\nexit 1\n")
    failing.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(visualize, "_program", lambda path: str(failing))
    assert cli.main(["convert", files.pb, str(out / "out.pb"), "--dot", str(out / "layer.svg")]) == 10
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "dot could not render" in err[0] and "(Error: syntax error in line 3)" in err[0], err
    assert os.listdir(out) == []


def test_shared_constant_does_not_pull_in_every_consumer():
    """A constant the rewrite shares across layers is drawn with its own layer's consumers first,
    and the rest as one '... more consumers' node, so the picture does not grow with the net."""
    nodes = {"net/bn1/axes": NodeDef(name="net/bn1/axes", op="Const")}
    consumers = ["net/bn1/sum"] + [f"net/bn{k}/sum" for k in range(2, 12)]
    for name in reversed(consumers):  # the own layer's consumer last in graph order
        nodes[name] = NodeDef(name=name, op="Sum", input=["net/bn1/axes"])
    lines = visualize._cluster("after", "t", nodes, ["net/bn1/axes"], removed={}, status=lambda n: "added")
    drawn = [n for n in consumers if any(line.startswith(f'    "after:{n}" [') for line in lines)]
    assert len(drawn) == visualize._CONSUMERS_SHOWN and "net/bn1/sum" in drawn
    hidden = len(consumers) - visualize._CONSUMERS_SHOWN
    assert any(f'label="{hidden} more consumers"' in line for line in lines)
