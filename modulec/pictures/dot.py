"""Graph IR as graphviz DOT text: `modulec graph --format dot`.

One cluster per function shown (a forward function, its derived backward, or both). A node
of the IR is a box: forward ops blue, backward ops red, recompute ops purple and dashed (a
run of consecutive recompute ops is a "recompute segment" cluster inside its function); a
call is a 3-D box naming its callee, with `x N` when it repeats. Function inputs and outputs
are ellipses. A saved value (a forward value the backward reads) is an orange cylinder
between the two clusters, fed by its forward producer and read by backward ops, with
dashed orange edges. Edges carry the value's source name (or its id) and shape; parameters
are not drawn (each function's cluster counts them).

The text is deterministic (IR order, no hashing), so it can be diffed and tested.
"""

from __future__ import annotations

from modulec.ir.graph import Function, Graph, Node, ValueInfo
from modulec.pictures.select import Selection

FONT = "Helvetica"
STYLE = {  # phase -> (fill, border)
    "forward": ("#d6e6f5", "#3f6f9f"),
    "backward": ("#f7d9d6", "#b0413e"),
    "recompute": ("#e6d9f2", "#7b4fa8"),
}
CLUSTER = {"forward": ("#f5f9fd", "#3f6f9f"), "backward": ("#fdf5f4", "#b0413e")}
SAVED = ("#ffe2bf", "#e07b00")
IO = ("#ffffff", "#666666")
GRADS = ("#fff7d6", "#9c7a00")


def graph_to_dot(graph: Graph, selection: Selection) -> str:
    writer = _Dot(graph, selection)
    return writer.text()


class _Dot:
    def __init__(self, graph: Graph, selection: Selection) -> None:
        self.graph = graph
        self.selection = selection
        self.lines: list[str] = []
        forward = selection.forward
        backward = selection.backward
        if backward is None and forward is not None:
            backward_of = next((f for f in graph.functions if f.gradient_of == forward.name),
                               None)
            self.saved = backward_of.saved if backward_of else ()
        else:
            self.saved = backward.saved if backward else ()
        self.producer: dict[tuple[str, str], str] = {}  # (function, value) -> dot node id

    # ------------------------------------------------------------------ the document
    def text(self) -> str:
        sel = self.selection
        title = f"{self.graph.model}, {sel.title}"
        phases = " and ".join(p for p, f in (("forward", sel.forward),
                                             ("backward", sel.backward)) if f)
        self.emit(f"digraph {q(self.graph.model)} {{")
        self.emit(f"  graph [rankdir=TB, newrank=true, nodesep=0.3, ranksep=0.35, "
                  f"fontname={q(FONT)}, fontsize=14, labelloc=t, "
                  f"label={q(f'{title}: {phases}')}];")
        self.emit(f"  node [fontname={q(FONT)}, fontsize=10, shape=box, "
                  f"style=\"rounded,filled\", margin=\"0.12,0.04\", height=0.3];")
        self.emit(f"  edge [fontname={q(FONT)}, fontsize=8, color=\"#555555\", "
                  f"fontcolor=\"#444444\", arrowsize=0.6];")
        if sel.forward is not None:
            self.function(sel.forward, "forward")
        if self.saved and (sel.forward is not None or sel.backward is not None):
            self.saved_values()
        if sel.backward is not None:
            self.function(sel.backward, "backward")
        self.legend()
        self.emit("}")
        return "\n".join(self.lines) + "\n"

    def emit(self, line: str) -> None:
        self.lines.append(line)

    # ------------------------------------------------------------------ one function
    def function(self, function: Function, phase: str) -> None:
        fill, border = CLUSTER[phase]
        name = function.name
        label = f"{phase}: {name}"
        if function.scope and function.scope != function.module:
            label += f"  [{function.scope}]"
        if function.params:
            label += f"  ({len(function.params)} parameters)"
        self.emit(f"  subgraph {q('cluster_' + phase)} {{")
        self.emit(f"    label={q(label)}; style=\"rounded,filled\"; fillcolor={q(fill)}; "
                  f"color={q(border)}; fontcolor={q(border)};")
        for value in function.inputs:
            self.io_node(function, value, "in")
        edges: list[str] = []
        segment: list[Node] = []
        segments = 0
        for node in function.nodes:
            if node.phase == "recompute":
                segment.append(node)
                continue
            if segment:
                segments += 1
                self.segment(function, segment, segments, edges)
                segment = []
            self.node(function, node, "    ", edges)
        if segment:
            segments += 1
            self.segment(function, segment, segments, edges)
        self.outputs(function, edges)
        self.emit("  }")
        self.lines.extend(edges)

    def segment(self, function: Function, nodes: list[Node], number: int, edges) -> None:
        fill, border = STYLE["recompute"]
        self.emit(f"    subgraph {q(f'cluster_{function.name}_recompute_{number}')} {{")
        self.emit(f"      label={q(f'recompute segment {number}')}; style=\"rounded,dashed\"; "
                  f"color={q(border)}; fontcolor={q(border)};")
        for node in nodes:
            self.node(function, node, "      ", edges)
        self.emit("    }")

    def node(self, function: Function, node: Node, indent: str, edges: list[str]) -> None:
        ident = f"{function.name}/{node.id}"
        fill, border = STYLE.get(node.phase, STYLE["forward"])
        style = "rounded,filled" + (",dashed" if node.phase == "recompute" else "")
        if node.kind == "call":
            repeat = f" x{node.repeat}" if str(node.repeat) != "1" else ""
            label = f"{node.id}: call {node.target}{repeat}"
            shape = ", shape=box3d"
            style = "filled" + (",dashed" if node.phase == "recompute" else "")
        else:
            label = f"{node.id}: {node.target}"
            shape = ""
        outputs = [o for o in node.outputs if o and o != "_"]
        tooltip = f"{node.phase} {node.kind} {node.target}: " + ", ".join(
            self.describe(function, o) for o in outputs)
        forward_node = node.attr("forward_node")
        if forward_node:
            tooltip += f" (gradient of {forward_node})"
        self.emit(f"{indent}{q(ident)} [label={q(label)}{shape}, style={q(style)}, "
                  f"fillcolor={q(fill)}, color={q(border)}, tooltip={q(tooltip)}];")
        for value in node.inputs:
            source = self.source(function, value)
            if source is None:
                continue
            saved = source.startswith("saved/")
            label = self.edge_label(function, value)
            attrs = [f"label={q(label.split(chr(10))[0] if saved else label)}"]
            if saved:  # the cylinder shows its shape
                attrs += [f"color={q(SAVED[1])}", "style=dashed"]
            edges.append(f"  {q(source)} -> {q(ident)} [{', '.join(attrs)}];")
        for value in outputs:
            self.producer[(function.name, value)] = ident

    def io_node(self, function: Function, value: ValueInfo, kind: str) -> None:
        ident = f"{function.name}/{kind}/{value.id}"
        label = f"{kind} {value.name or value.id}\n{shape_text(value)}"
        fill, border = IO
        self.emit(f"    {q(ident)} [label={q(label)}, shape=ellipse, style=filled, "
                  f"fillcolor={q(fill)}, color={q(border)}];")
        self.producer[(function.name, value.id)] = ident

    def outputs(self, function: Function, edges: list[str]) -> None:
        fill, border = IO
        for value in function.outputs:
            source = self.producer.get((function.name, value))
            if not value or value == "_" or source is None:
                continue
            ident = f"{function.name}/out/{value}"
            info = function.value(value)
            label = f"out {value}" + (f"\n{shape_text(info)}" if info else "")
            self.emit(f"    {q(ident)} [label={q(label)}, shape=ellipse, style=filled, "
                      f"fillcolor={q(fill)}, color={q(border)}];")
            edges.append(f"  {q(source)} -> {q(ident)};")
        grads = [(p, g) for p, g in function.param_grads
                 if (function.name, g) in self.producer]
        if grads:
            ident = f"{function.name}/param_grads"
            label = "parameter gradients\n" + "\n".join(f"d {p} = {g}" for p, g in grads)
            fill, border = GRADS
            self.emit(f"    {q(ident)} [label={q(label)}, shape=note, style=filled, "
                      f"fillcolor={q(fill)}, color={q(border)}];")
            for param, value in grads:
                edges.append(f"  {q(self.producer[(function.name, value)])} -> {q(ident)} "
                             f"[label={q(param)}, color={q(border)}];")

    # ------------------------------------------------------------------ saved values
    def saved_values(self) -> None:
        fill, border = SAVED
        forward = self.selection.forward or (
            self.graph.function(self.selection.backward.gradient_of)
            if self.selection.backward and self.selection.backward.gradient_of else None)
        for value in self.saved:
            info = forward.value(value) if forward else None
            label = f"saved {info.name or value if info else value}"
            if info:
                label += f"\n{shape_text(info)}"
            ident = f"saved/{value}"
            self.emit(f"  {q(ident)} [label={q(label)}, shape=cylinder, style=filled, "
                      f"fillcolor={q(fill)}, color={q(border)}, penwidth=1.5];")
            if self.selection.forward is not None:
                source = self.producer.get((self.selection.forward.name, value))
                if source is not None:
                    self.emit(f"  {q(source)} -> {q(ident)} [color={q(border)}, "
                              f"style=dashed];")

    # ------------------------------------------------------------------ helpers
    def source(self, function: Function, value: str) -> str | None:
        """The DOT node a value comes from; None for parameters and absent inputs."""
        if not value or value == "_" or value.startswith("param:"):
            return None
        found = self.producer.get((function.name, value))
        if found is not None:
            return found
        if value in self.saved and function.gradient_of:
            return f"saved/{value}"
        ident = f"{function.name}/ext/{value}"  # read from elsewhere: an outer value
        self.emit(f"    {q(ident)} [label={q(value)}, shape=ellipse, style=dashed];")
        self.producer[(function.name, value)] = ident
        return ident

    def edge_label(self, function: Function, value: str) -> str:
        info = function.value(value)
        if info is None and function.gradient_of:
            info = self.graph.function(function.gradient_of).value(value)
        if info is None:
            return value
        return f"{info.name or value}\n{shape_text(info)}"

    def describe(self, function: Function, value: str) -> str:
        info = function.value(value)
        return f"{value} {shape_text(info)}" if info else value

    def legend(self) -> None:
        rows = [("forward op", *STYLE["forward"]), ("backward op", *STYLE["backward"]),
                ("recompute op", *STYLE["recompute"]), ("saved value", *SAVED),
                ("call (box3d), x N: repeated", "#eeeeee", "#666666")]
        cells = "".join(f"<tr><td bgcolor=\"{fill}\" color=\"{border}\">{text}</td></tr>"
                        for text, fill, border in rows)
        self.emit("  legend [shape=plaintext, style=\"\", margin=0, label=<<table border=\"0\" "
                  "cellborder=\"1\" cellspacing=\"3\" cellpadding=\"4\">"
                  f"<tr><td border=\"0\"><b>legend</b></td></tr>{cells}</table>>];")


def shape_text(value: ValueInfo) -> str:
    return f"[{', '.join(value.shape)}] {value.dtype}"


def q(text: str) -> str:
    """A DOT quoted string."""
    escaped = str(text).replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")
    return f"\"{escaped}\""
