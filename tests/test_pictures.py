"""Pictures (issue 7): `modulec graph` (Graph IR as DOT / SVG / PNG) and the memory plan
drawn by `modulec.pictures.memory.draw_memory_plan` (`modulec plan --picture`).

graphviz's `dot` and Pillow are part of the development setup (`make setup`): the tests
that need them fail, and say so, when they are missing; they are never skipped."""

import io
import re
import shutil
import sys
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

from modulec.cli.main import modulec
from modulec.ir.graph import Function, Graph, Node, ValueInfo
from modulec.lower.build import BuildRequest, build
from modulec.paths import REPO_DIR
from modulec.pictures import PictureError
from modulec.pictures.dot import STYLE, graph_to_dot
from modulec.pictures.memory import (
    CALL_COLORS, LOWER_BOUND_COLOR, REGION_COLORS, draw_memory_plan, function_plans,
    memory_picture,
)
from modulec.pictures.select import select
from modulec.plan.from_graph import plan_step
from modulec.plan.memory import SAVED, TRANSIENT

LLAMA = REPO_DIR / "std" / "models" / "llama.module"
SMALL = {"d_model": "256", "num_heads": "4", "num_kv_heads": "2", "d_ff": "512",
         "vocab_size": "1000", "n_layers": "3"}
SMALL_ARGS = [a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")] + \
    ["--shape", "B=2", "--shape", "T=64"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SETUP = "run `make setup` (it installs graphviz and Pillow)"


@pytest.fixture(scope="module")
def graph():
    result = build(BuildRequest(LLAMA, settings=dict(SMALL), shapes={"B": 2, "T": 64}))
    assert result.graph is not None, [d.message for d in result.diagnostics]
    return result.graph


def run(*args):
    return CliRunner().invoke(modulec, [str(a) for a in args])


def require_dot():
    if shutil.which("dot") is None:
        pytest.fail(f"graphviz's `dot` is not installed: {SETUP}")


def require_pillow():
    try:
        import PIL  # noqa: F401
    except ImportError:
        pytest.fail(f"Pillow is not installed: {SETUP}")


def nodes_of(dot: str) -> dict[str, str]:
    """DOT node id -> its attribute text."""
    return dict(re.findall(r'^\s*"([^"]+)" \[(.*)\];$', dot, re.M))


def edges_of(dot: str) -> list[tuple[str, str, str]]:
    return re.findall(r'^\s*"([^"]+)" -> "([^"]+)"(?: \[(.*)\])?;$', dot, re.M)


# ====================================================================== DOT
def test_dot_draws_forward_and_backward_distinguished(graph):
    dot = graph_to_dot(graph, select(graph))
    nodes = nodes_of(dot)
    entry, backward = graph.function(graph.entry), graph.function(graph.backward)
    assert dot.startswith(f'digraph "{graph.model}" {{') and dot.rstrip().endswith("}")
    assert 'subgraph "cluster_forward"' in dot and 'subgraph "cluster_backward"' in dot
    for node in entry.nodes:
        attrs = nodes[f"{entry.name}/{node.id}"]
        assert f'fillcolor="{STYLE["forward"][0]}"' in attrs, attrs
    for node in backward.nodes:
        attrs = nodes[f"{backward.name}/{node.id}"]
        assert f'fillcolor="{STYLE["backward"][0]}"' in attrs, attrs
    assert STYLE["forward"][0] != STYLE["backward"][0]


def test_dot_shows_calls_as_boxes_with_their_repeat(graph):
    dot = graph_to_dot(graph, select(graph))
    calls = [(k, v) for k, v in nodes_of(dot).items() if "shape=box3d" in v]
    labels = " ".join(v for _, v in calls)
    assert "call DenseTransformerBlock#1 x3" in labels
    assert "call DenseTransformerBlock#1.backward x3" in labels


def test_dot_edges_follow_the_values(graph):
    entry = graph.function(graph.entry)
    dot = graph_to_dot(graph, select(graph))
    edges = {(a, b) for a, b, _ in edges_of(dot)}
    producer = {o: n.id for n in entry.nodes for o in n.outputs}
    expected = {(f"{entry.name}/{producer[i]}", f"{entry.name}/{n.id}")
                for n in entry.nodes for i in n.inputs if i in producer}
    assert expected and expected <= edges
    for value in entry.inputs:
        assert any(a == f"{entry.name}/in/{value.id}" for a, _ in edges)
    for value in entry.outputs:
        assert (f"{entry.name}/{producer[value]}", f"{entry.name}/out/{value}") in edges


def test_dot_marks_saved_values_between_forward_and_backward(graph):
    attention = select(graph, "blocks[*].attention")
    dot = graph_to_dot(graph, attention)
    nodes = nodes_of(dot)
    saved = attention.backward.saved
    assert saved
    for value in saved:
        assert "shape=cylinder" in nodes[f"saved/{value}"]
    edges = edges_of(dot)
    into = {a for a, _, _ in edges if a.startswith("saved/")}
    assert into == {f"saved/{v}" for v in saved}  # each saved value is read by the backward
    fed = {b for _, b, _ in edges if b.startswith("saved/")}
    assert fed == {f"saved/{v}" for v in saved}  # ... and written by the forward
    assert all("style=dashed" in attrs for a, b, attrs in edges
               if a.startswith("saved/") or b.startswith("saved/"))


def test_dot_is_deterministic(graph):
    again = build(BuildRequest(LLAMA, settings=dict(SMALL), shapes={"B": 2, "T": 64})).graph
    assert graph_to_dot(graph, select(graph)) == graph_to_dot(again, select(again))


def test_recompute_segments_are_marked():
    value = lambda i: ValueInfo(i, ("4",), "fp32", i)  # noqa: E731
    forward = Function("F#1", "F", "F", (), (), (value("x"),), ("%2",),
                       (value("%1"), value("%2")),
                       (Node("f0", "op", "exp", ("x",), ("%1",)),
                        Node("f1", "op", "relu", ("%1",), ("%2",))))
    backward = Function(
        "F#1.backward", "F", "F", (), (), (value("d:%2"),), ("%g3",),
        (value("%r1"), value("%g1"), value("%g2"), value("%g3")),
        (Node("b0", "op", "exp", ("x",), ("%r1",), phase="recompute"),
         Node("b1", "op", "relu_backward", ("d:%2", "%r1"), ("%g1",), phase="backward"),
         Node("b2", "op", "exp_backward", ("%g1", "%r1"), ("%g2",), phase="backward"),
         Node("b3", "op", "scale", ("%g2",), ("%g3",), phase="recompute")),
        saved=("x",), gradient_of="F#1")
    graph = Graph("M", "F#1", "F#1.backward", (forward, backward))
    dot = graph_to_dot(graph, select(graph))
    assert dot.count("recompute segment") == 2
    assert 'subgraph "cluster_F#1.backward_recompute_1"' in dot
    nodes = nodes_of(dot)
    for ident in ("F#1.backward/b0", "F#1.backward/b3"):
        assert f'fillcolor="{STYLE["recompute"][0]}"' in nodes[ident]
        assert "dashed" in nodes[ident]
    assert f'fillcolor="{STYLE["backward"][0]}"' in nodes["F#1.backward/b1"]
    assert ("saved/x", "F#1.backward/b0") in {(a, b) for a, b, _ in edges_of(dot)}


# ====================================================================== choosing a function
def test_scope_selects_by_name_scope_or_module(graph):
    by_scope = select(graph, "blocks[*].attention")
    assert by_scope.forward.name == "CausalSelfAttention#1"
    assert by_scope.backward.name == "CausalSelfAttention#1.backward"
    assert select(graph, "blocks[2].attention") == by_scope
    assert select(graph, "CausalSelfAttention#1") == by_scope
    assert select(graph, "CausalSelfAttention") == by_scope
    only = select(graph, "CausalSelfAttention#1.backward")
    assert only.forward is None and only.backward.name == "CausalSelfAttention#1.backward"
    assert select(graph, None, "forward").backward is None


def test_unknown_scope_lists_the_functions(graph):
    with pytest.raises(PictureError, match=r"no function `blocks\[\*\]\.nope`.*"
                                           r"CausalSelfAttention#1 \(blocks\[\*\]\.attention\)"):
        select(graph, "blocks[*].nope")


# ====================================================================== modulec graph
def test_graph_command_writes_dot_to_stdout():
    result = run("graph", LLAMA, *SMALL_ARGS)
    assert result.exit_code == 0, result.output
    assert result.output.startswith('digraph "Llama"')
    assert "cluster_backward" in result.output


@pytest.mark.parametrize("fmt", ["svg", "png"])
def test_graph_command_renders_with_graphviz(tmp_path, fmt):
    require_dot()
    out = tmp_path / f"graph.{fmt}"
    result = run("graph", LLAMA, *SMALL_ARGS, "--scope", "blocks[*].attention", "-o", out)
    assert result.exit_code == 0, result.output
    data = out.read_bytes()
    assert len(data) > 10_000  # a real drawing, not an empty page
    if fmt == "png":
        require_pillow()
        from PIL import Image

        assert data.startswith(PNG_SIGNATURE)
        image = Image.open(io.BytesIO(data))
        assert image.width > 400 and image.height > 400
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
        assert len(colors) > 20
    else:
        root = ET.fromstring(data)
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
        text = data.decode("utf-8")
        for word in ("flash_attention", "flash_attention_backward", "saved", "legend"):
            assert word in text
        assert STYLE["forward"][0] in text and STYLE["backward"][0] in text


def test_graph_format_follows_the_suffix_unless_given(tmp_path):
    require_dot()
    out = tmp_path / "graph.svg"
    assert run("graph", LLAMA, *SMALL_ARGS, "-o", out).exit_code == 0
    assert out.read_bytes().lstrip().startswith(b"<?xml")
    out = tmp_path / "graph.txt"
    assert run("graph", LLAMA, *SMALL_ARGS, "--format", "dot", "-o", out).exit_code == 0
    assert out.read_text().startswith("digraph")


def test_graph_without_dot_is_a_clear_usage_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` here
    result = run("graph", LLAMA, *SMALL_ARGS, "--format", "svg", "-o", tmp_path / "g.svg")
    assert result.exit_code == 2
    assert "needs graphviz's `dot` program" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "g.svg").exists()
    # DOT text needs no graphviz
    assert run("graph", LLAMA, *SMALL_ARGS, "--format", "dot").exit_code == 0


def test_graph_usage_errors(tmp_path):
    assert run("graph", LLAMA, *SMALL_ARGS, "--format", "png").exit_code == 2  # no -o
    result = run("graph", LLAMA, *SMALL_ARGS, "--scope", "nope")
    assert result.exit_code == 2 and "no function `nope`" in result.output
    assert run("graph", LLAMA, *SMALL_ARGS, "-o", tmp_path / "missing" / "g.dot") \
        .exit_code == 2


# ====================================================================== the memory plan
def test_function_plans_are_the_plans_plan_step_totals(graph):
    plans = function_plans(graph)
    step = plan_step(graph).summary()
    transient = next(r for r in step["regions"] if r["region"] == TRANSIENT)
    assert transient["arena_bytes"] == max(
        plans[name].regions[TRANSIENT].arena_bytes for name in (graph.entry, graph.backward))


def test_memory_png_has_rectangles_in_region_colors(graph, tmp_path):
    require_pillow()
    from PIL import Image

    path = draw_memory_plan(graph, tmp_path / "mem.png", "blocks[*].attention")
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    image = Image.open(path).convert("RGB")
    assert image.width >= 1000 and image.height >= 600
    counts = {"#%02x%02x%02x" % rgb: n for n, rgb in image.getcolors(maxcolors=1 << 20)}
    assert len(counts) > 8
    for color in (*REGION_COLORS[TRANSIENT][:2], *REGION_COLORS[SAVED][:2], LOWER_BOUND_COLOR):
        assert counts.get(color, 0) > 50, color  # each region's rectangles, the lower bound


def test_memory_picture_of_the_step_draws_every_block(graph, tmp_path):
    canvas = memory_picture(graph)
    svg = canvas.to_svg()
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    plans = function_plans(graph)
    blocks = sum(len(region.blocks) for name in (graph.entry, graph.backward)
                 for region in plans[name].regions.values())
    drawn = svg.count("bytes at offset")  # one tooltip per storage rectangle
    assert drawn == blocks > 3
    assert f'fill="{CALL_COLORS[0]}"' in svg or f'fill="{CALL_COLORS[1]}"' in svg  # a call
    assert "lower bound (peak live bytes)" in svg and LOWER_BOUND_COLOR in svg
    assert "DenseTransformerBlock#1" in svg
    assert draw_memory_plan(graph, tmp_path / "m.svg").read_text() == svg  # deterministic


def test_memory_png_without_pillow_is_a_picture_error(graph, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(PictureError, match="needs Pillow"):
        draw_memory_plan(graph, tmp_path / "mem.png")
    assert not (tmp_path / "mem.png").exists()


def test_plan_picture_option_writes_a_png(tmp_path):
    from click.testing import CliRunner

    from modulec.cli.main import modulec
    from modulec.paths import REPO_DIR

    out = tmp_path / "m.png"
    result = CliRunner().invoke(modulec, ["plan", str(REPO_DIR / "std/models/llama.module"),
                                          "--set", "n_layers=2", "--set", "d_model=256",
                                          "--set", "num_heads=4", "--set", "num_kv_heads=2",
                                          "--set", "d_ff=512", "--set", "vocab_size=1000",
                                          "--shape", "B=2", "--shape", "T=64",
                                          "--picture", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
