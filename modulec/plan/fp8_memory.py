"""The bytes the GPU step's FP8 recipe holds beside the memory plan (decisions.md, "FP8
on the GPU", "What the FP8 buffers cost"), counted from the IR: the program's
`metadata.precision` section (which matmuls are covered, each operand's role) and the
graph's shapes. The runtime (runtime/cuda/fp8_step.py `Casts`, runtime/fp8_gemm.py)
allocates them outside the activation arena; the planners count them as a fixed term
(`fixed`: `make_problem(precision=...)`, so the budget planner, `modulec plan` and
`TrainStep.predicted_peak` see the same bytes).

- weights: each covered weight's fp8 copies, in every layout the matmuls of its function
  and of its backward read it in (forward `x W^T` reads W, the dgrad W^T), kept to the
  step's end: one byte a parameter a layout, every layer's at once from the forward's end.
- held: the wgrad's x^T of every covered forward input that the backward reads
  transposed as the forward's saved value, cast in the forward and kept to that backward
  (`Casts.keep_transposed`; off in a step that recomputes or swaps, and under any
  memory budget): one byte an element of each such input, every layer's at the forward's
  end.
- transient: the most bytes of activation and gradient fp8 copies live at once within
  one function (a copy lives from its first covered reader to its last; one byte an
  element a layout).
- scales: the amax histories, pending amaxes and window (fp32, one row per operand key
  at most, rows allocated in blocks of 8 doubled as they grow).

The layout rules (which operand a `torch._scaled_mm` reads row- or column-major) live here
so the runtime's casts and this count are the same rules (runtime/fp8_gemm.py imports
them). Counted as one constant added to the plan's peak: the weights and the held x^T
peak together at the forward's end, the largest cast buffers early in the backward, so
the sum is at most a few hundred MiB above the step's real peak of these bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

TARGETS = ("matmul", "matmul_backward")
FP8_FIXED = "fp8_buffers"  # the key of the planner problem's fixed bytes
SCALE_ROWS = 8  # ScaleState's first row block


# ====================================================================== layouts
def first_layout(flag: str) -> tuple[bool, bool]:
    """(plain, transposed) of an operand that is op(q) row-major (K contiguous):
    _scaled_mm's first operand."""
    return (flag == "N", flag == "T")


def second_layout(flag: str) -> tuple[bool, bool]:
    """... that is op(q) column-major (K contiguous): _scaled_mm's second operand."""
    return (flag == "T", flag == "N")


# (d_A, d_B) as (x, y, mode) products over (g, a, b) = (d_C, A, B): runtime/kernels/linalg.py
GRADIENTS = {"NN": ((0, 2, "NT"), (1, 0, "TN")), "NT": ((0, 2, "NN"), (0, 1, "TN")),
             "TN": ((2, 0, "NT"), (1, 0, "NN")), "TT": ((2, 0, "TT"), (0, 1, "TT"))}


def forward_layouts(transpose: str) -> list:
    """(plain, transposed) of A and B that C = op(A) @ op(B) reads."""
    return [first_layout(transpose[0]), second_layout(transpose[1])]


def backward_layouts(transpose: str, wanted=(True, True)) -> list:
    """(plain, transposed) of d_C, A and B that the wanted gradients read."""
    layouts = [(False, False)] * 3
    for want, (x, y, mode) in zip(wanted, GRADIENTS[transpose]):
        for i, need in ((x, first_layout(mode[0])), (y, second_layout(mode[1]))):
            layouts[i] = tuple(a or (want and b) for a, b in zip(layouts[i], need))
    return layouts


def node_layouts(node) -> list:
    """(plain, transposed) per input of covered `node`."""
    transpose = node.attr("transpose") or "NN"
    if node.target == "matmul":
        return forward_layouts(transpose)
    return backward_layouts(transpose, tuple(bool(o) for o in node.outputs))


def _either(a: tuple, b: tuple) -> tuple:
    return tuple(x or y for x, y in zip(a, b))


# ====================================================================== the count
@dataclass(frozen=True)
class Fp8Memory:
    weights: int = 0
    held: int = 0
    transient: int = 0  # with the wgrad's x^T held (the backward does not cast it)
    scales: int = 0
    transient_recast: int = 0  # without: the backward casts x^T from the saved x

    def outside_plan(self, held: bool) -> int:
        """What the step holds beside the plan at its peak; `held`: the wgrad's x^T is
        kept from the forward (the step's `keep_transposed`)."""
        if held:
            return self.weights + self.held + self.transient + self.scales
        return self.weights + self.transient_recast + self.scales

    def summary(self, held: bool) -> dict:
        return {"weights_bytes": self.weights, "held_transposed_bytes": self.held if held else 0,
                "transient_bytes": self.transient if held else self.transient_recast,
                "scales_bytes": self.scales, "total_bytes": self.outside_plan(held)}


def fp8_memory(graph, section: dict | None) -> Fp8Memory:
    """The FP8 buffers of a step of `graph` under metadata `precision` `section` (the
    module doc); all zero without one. ShapeUnknown where a dim is not sized."""
    if not section or not section.get("matmuls"):
        return Fp8Memory()
    from modulec.plan.from_graph import _invocations

    count = _Count(graph, {(m["function"], m["op"]) for m in section["matmuls"]})
    invocations = _invocations(graph)
    weights = held = transient = recast = 0
    for root in graph.functions:
        if root.gradient_of:
            continue
        times = invocations.get(root.name, 0)
        weights += times * count.weight_bytes(root)
        held += times * count.held_bytes(root)
    for function in graph.functions:
        if invocations.get(function.name, 0):
            transient = max(transient, count.transient_bytes(function, True))
            recast = max(recast, count.transient_bytes(function, False))
    return Fp8Memory(weights, held, transient, _scale_bytes(graph, section, invocations),
                     recast)


class _Count:
    """Per function: the covered nodes' readers and layouts (fp8_step.Casts's rules)."""

    def __init__(self, graph, sites: set):
        self.graph, self.sites = graph, sites
        self._readers: dict = {}

    def covered(self, function) -> list:
        return [n for n in function.nodes if n.target in TARGETS and any(n.outputs)
                and (function.name, n.id) in self.sites]

    def readers(self, function) -> dict:
        """{value: (covered readers, (plain, transposed) they read)} of `function`."""
        if function.name not in self._readers:
            found: dict = {}
            for node in self.covered(function):
                for value, need in zip(node.inputs, node_layouts(node)):
                    if value:
                        count, have = found.get(value, (0, (False, False)))
                        found[value] = (count + 1, _either(have, need))
            self._readers[function.name] = found
        return self._readers[function.name]

    def family(self, root) -> list:
        return [root] + [g for g in self.graph.functions if g.gradient_of == root.name]

    def elements(self, function, value: str) -> int:
        from modulec.plan.from_graph import _elements

        info = function.value(value)
        if info is None and function.gradient_of:  # a saved value: the forward's
            info = self.graph.function(function.gradient_of).value(value)
        return _elements(info) if info is not None else 0

    def weight_bytes(self, root) -> int:
        """One run of `root`'s covered weights: every layout its family reads them in."""
        layouts: dict = {}
        where: dict = {}
        for function in self.family(root):
            for value, (_, need) in self.readers(function).items():
                if value.startswith("param:"):
                    layouts[value] = _either(layouts.get(value, (False, False)), need)
                    where.setdefault(value, function)
        return sum(self.elements(where[v], v) * sum(need) for v, need in layouts.items())

    def held_values(self, root) -> set:
        """Inputs of `root`'s covered nodes that a backward of it reads transposed as the
        forward's saved value (fp8_step.Casts._holds)."""
        forward = {v for v in self.readers(root) if not v.startswith("param:")}
        held = set()
        for g in self.family(root)[1:]:
            made = {o for n in g.nodes for o in n.outputs if o}
            for value, (_, (_, transposed)) in self.readers(g).items():
                if transposed and value in set(g.saved) and value not in made \
                        and value in forward:
                    held.add(value)
        return held

    def held_bytes(self, root) -> int:
        return sum(self.elements(root, v) for v in self.held_values(root))

    def transient_bytes(self, function, kept: bool) -> int:
        """The most bytes of activation / gradient fp8 copies live at once in one run of
        `function`; `kept`: the wgrad's x^T held from the forward (`held` counts it, the
        forward casts it with x and the backward does not cast it again)."""
        nodes = self.covered(function)
        root = self.graph.function(function.gradient_of) if function.gradient_of \
            else function
        held = self.held_values(root) if kept else set()
        spans: dict = {}
        for i, node in enumerate(nodes):
            for value in node.inputs:
                if value and not value.startswith("param:"):
                    first, _ = spans.get(value, (i, i))
                    spans[value] = (first, i)
        sizes = {}
        for value, (_, (plain, transposed)) in self.readers(function).items():
            if value in spans:
                layouts = plain + (transposed and value not in held)
                sizes[value] = self.elements(function, value) * layouts
        return max((sum(sizes[v] for v, (a, b) in spans.items() if a <= i <= b)
                    for i in range(len(nodes))), default=0)


def _scale_bytes(graph, section: dict, invocations: dict) -> int:
    """The amax histories' device state at most: a row per operand key (a derived
    backward's A and B share their forward's keys), history_len + pending + window fp32."""
    rows = 0
    for m in section["matmuls"]:
        node = next((n for n in graph.function(m["function"]).nodes if n.id == m["op"]), None)
        own = 1 if node is not None and node.target == "matmul_backward" else \
            len(m.get("operands", ())) or 2
        rows += own * invocations.get(m["function"], 0)
    capacity = SCALE_ROWS
    while capacity < rows:
        capacity *= 2
    history = int(section["recipe"].get("scaling", {}).get("history_len", 1))
    return capacity * (history + 2) * 4


def fixed(graph, section: dict | None, held: bool = False) -> dict:
    """The planner problem's fixed bytes for the FP8 buffers ({} without a recipe)."""
    total = fp8_memory(graph, section).outside_plan(held)
    return {FP8_FIXED: total} if total else {}
