"""The GPU step's FP8 recipe (decisions.md, "FP8 on the GPU"): the program's
`metadata.precision` run as FP8 GEMMs (runtime/fp8_gemm.py) on the matmuls it lists.

`StepFp8` holds the recipe's sites and the device `ScaleState` (amax histories: training
state, saved in checkpoints as the CPU emulation's are); the step's interpreter asks
`run_op` for each covered matmul / matmul_backward node, with the emulation's operand keys
(runtime.fp8.covered), so a GPU run and a CPU run of one program keep the same histories.
What the GPU cannot run yet is refused when the step is made (runtime.fp8.refuse_on_gpu).

Within a training step (`begin_step` .. `end_step`) `Casts` quantizes each tensor once:
the emulation quantizes an operand at every use, under the use's own key, but a tensor
read by several covered matmuls (a weight by its forward and its dgrad, a gradient by
the dgrad and the wgrad, an activation by its forward and its wgrad) has the same amax at
each, so the same scale wherever the keys' histories are equal (`ScaleState.share`: the
keys then share one history row). Its first use takes the amax and scale and casts, in one
pass, every layout the matmuls of its function that read it ask for (a weight: also those
of its backward); later uses take them as they are, or cast a layout not made yet. An
activation's fp8 copies are dropped after the last reader in the function that made them,
except x^T where the backward's wgrad reads the same saved x: cast in the forward's pass
and kept to that backward (`KEEP_TRANSPOSED`; one read of x less a linear). A weight's
fp8 copies (both layouts) are kept to the step's end: each weight is cast once a step,
however many micro-batches read it (one byte a covered parameter per layout beyond the
memory plan). The planners count these buffers from the IR (modulec.plan.fp8_memory:
weights, held x^T, cast buffers, scales), so TrainStep.predicted_peak and a memory budget
see them; a change here to what is kept, or for how long, changes that count too.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from runtime import fp8_gemm
from runtime.fp8 import covered, refuse_on_gpu

TARGETS = ("matmul", "matmul_backward")


class StepFp8:
    def __init__(self, section: dict, device="cuda", graph=None):
        self.recipe = section["recipe"]
        self.sites = {(m["function"], m["op"]): m for m in section["matmuls"]}
        self.scales = fp8_gemm.ScaleState(self.recipe, device)
        self.casts = Casts(self, graph)

    def covers(self, function: str, op: str) -> bool:
        return (function, op) in self.sites

    def run_op(self, node, frame, forward, inputs: list, attrs: dict) -> list:
        """The outputs of covered `node` (inputs read, attrs the node's) in FP8."""
        plan = covered(self.sites, self.recipe, node, frame, forward)
        where = f"{frame.function.name}/{node.id} (recipe `{self.recipe['name']}`)"
        if node.target == "matmul":
            A, B = self._operands(node, frame, inputs, plan, forward)
            fast = fp8_gemm.FAST_ACCUM["forward"] and not frame.function.gradient_of
            return [fp8_gemm.matmul(self.scales, A, B, where=where, fast=fast, **attrs)]
        d_C, A, B = inputs
        wanted = attrs.pop("wanted_outputs", (True, True))
        if d_C is None:  # no gradient reached C: none leaves either
            return [B.new_zeros(A.shape) if wanted[0] else None,
                    B.new_zeros(B.shape) if wanted[1] else None]
        d_C, A, B = self._operands(node, frame, inputs, plan, forward)
        return fp8_gemm.matmul_backward(self.scales, d_C, A, B, wanted=wanted, where=where,
                                        **attrs)

    def _operands(self, node, frame, inputs: list, plan: list, forward=None) -> list:
        return [fp8_gemm.Operand(v, fmt, key, self.casts.quantize(v, fmt, key, weight, node, i,
                                                                  frame, forward))
                for i, (v, (fmt, key, weight)) in enumerate(zip(inputs, plan))]

    # the step's calls
    def begin_step(self) -> None:
        self.casts.clear()
        self.scales.begin_step()
        self.scales.recording = True

    def end_step(self) -> None:
        self.scales.recording = False
        self.scales.end_step()
        self.casts.clear()

    def state_dict(self) -> dict:
        return self.scales.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scales.load_state_dict(state)


def node_layouts(node) -> list:
    """(plain, transposed) per input of covered `node` (fp8_gemm's layout rules, which
    the planners' count of these buffers shares: modulec.plan.fp8_memory)."""
    from modulec.plan.fp8_memory import node_layouts as layouts

    return layouts(node)


@dataclass
class _Cast:
    """One tensor's quantization this step: its scale's row, the scale, and its fp8
    copies (`q`, while a reader in frame `frame` is still to come, or a weight's)."""
    ref: weakref.ref
    fmt: str
    row: int
    scale: object
    inv_scale: object
    q: fp8_gemm.Quantized | None = None
    frame: int = 0
    left: int = 0
    held: int | None = None  # id of the forward frame whose backward reads the kept x^T


# An activation that the backward of the function reading it reads transposed (the
# wgrad's x^T, a saved value): x^T is cast in the forward's pass with x and kept to the
# backward, where it was cast again from x (one read of x less a linear). TrainStep turns
# it off where its plan recomputes or swaps anything (`keep_transposed`).
KEEP_TRANSPOSED = True


class Casts:
    """A training step's quantized operands by tensor (see the module doc)."""

    def __init__(self, fp8: StepFp8, graph=None):
        self.fp8, self.graph = fp8, graph
        self.entries: dict[int, _Cast] = {}
        self._readers: dict[str, dict] = {}  # function -> value -> [readers, layouts]
        self._families: dict[str, set] = {}
        self._held_values: dict[str, frozenset] = {}
        self.keep_transposed = KEEP_TRANSPOSED
        # first uses, later uses; x^T cast in a forward and kept, and read by its backward
        self.counts = {"quantized": 0, "shared": 0, "held": 0, "held_read": 0}

    def clear(self) -> None:
        self.entries = {}

    def quantize(self, x, fmt: str, key: str, weight: bool, node, i: int, frame,
                 forward=None):
        """`x`, input `i` of covered `node` in `frame` (a backward's: `forward`, the run
        of its forward function), quantized (None outside a training step: fp8_gemm
        quantizes it at this use, as before)."""
        scales = self.fp8.scales
        if x is None or not scales.recording:
            return None
        function, value = frame.function.name, node.inputs[i]
        readers, layouts = self._reader(function, value, weight)
        layouts = tuple(a or b for a, b in zip(layouts, node_layouts(node)[i]))
        entry = self.entries.get(id(x))
        if entry is not None and (entry.ref() is not x or entry.fmt != fmt
                                  or not scales.share(key, entry.row)):
            entry = None
        if entry is None:
            held = not weight and forward is None and self._holds(function, value)
            entry = self.entries[id(x)] = self._first(x, fmt, key,
                                                      (layouts[0], layouts[1] or held))
            entry.frame, entry.left = id(frame), readers
            entry.held = id(frame) if held else None
            self.counts["quantized"] += 1
            self.counts["held"] += held
        else:
            self.counts["shared"] += 1
        if entry.frame != id(frame):  # its first reader in this run of the function
            # the backward of the run that cast x^T for it: that copy is read here
            reads_held = entry.held is not None and forward is not None \
                and id(forward) == entry.held and entry.q is not None
            entry.frame, entry.left, entry.held = id(frame), readers, None
            if not weight and not reads_held:
                entry.q = None
            self.counts["held_read"] += reads_held
        if entry.q is None:
            entry.q = fp8_gemm.Quantized(fp8_gemm._fold(x), fmt, entry.scale, entry.inv_scale)
        q = entry.q.prepare(layouts[0], layouts[1] or entry.held is not None)
        entry.left -= 1
        if entry.left <= 0 and not weight:
            if entry.held is None:
                entry.q = None  # its last reader here: the fp8 copies go with this use
            else:  # x^T stays for the backward (a new Quantized: this use's q keeps both)
                kept = fp8_gemm.Quantized(q.x, fmt, entry.scale, entry.inv_scale)
                kept._transposed = q._transposed
                entry.q = kept
        return q

    def _holds(self, function: str, value: str) -> bool:
        """Whether forward `function`'s `value` is one its backward functions' covered
        nodes read transposed as the forward's saved value (not one they make)."""
        if not self.keep_transposed or self.graph is None:
            return False
        if function not in self._held_values:
            held = set()
            for g in self.graph.functions:
                if g.gradient_of != function:
                    continue
                made = {o for n in g.nodes for o in n.outputs if o}
                for v, (_, (_, transposed)) in self._readers_of(g.name).items():
                    if transposed and v in set(g.saved) and v not in made:
                        held.add(v)
            self._held_values[function] = frozenset(held)
        return value in self._held_values[function]

    def _first(self, x, fmt: str, key: str, layouts: tuple) -> _Cast:
        """x's first use this step: its scale (its amax recorded) and, for delayed scaling
        on CUDA, its layouts cast in the same pass (ScaleState.cast_delayed)."""
        scales, folded = self.fp8.scales, fp8_gemm._fold(x)
        q = scales.cast_delayed(folded, fmt, key, *layouts)
        scale, inv = (q.scale, q.inv_scale) if q is not None else \
            scales.scales(folded, fmt, key)
        return _Cast(weakref.ref(x), fmt, scales.rows[key], scale, inv, q)

    def _reader(self, function: str, value: str, weight: bool) -> tuple:
        """(how many covered nodes of `function` read `value`, the layouts they read it
        in; a weight's: those of the function's forward / backward too)."""
        readers, layouts = self._readers_of(function).get(value, (1, (False, False)))
        if weight:
            for other in self._family(function) - {function}:
                layouts = tuple(a or b for a, b in zip(
                    layouts, self._readers_of(other).get(value, (0, (False, False)))[1]))
        return readers, layouts

    def _family(self, function: str) -> set:
        """`function` and its forward / backward functions."""
        if self.graph is None:
            return {function}
        if function not in self._families:
            f = self._function(function)
            root = (f.gradient_of if f is not None else None) or function
            self._families[function] = {g.name for g in self.graph.functions
                                        if g.name == root or g.gradient_of == root}
        return self._families[function]

    def _function(self, name: str):
        return next((f for f in self.graph.functions if f.name == name), None) \
            if self.graph is not None else None

    def _readers_of(self, function: str) -> dict:
        if function not in self._readers:
            found: dict = {}
            f = self._function(function)
            for node in f.nodes if f is not None else ():
                if node.target not in TARGETS or not self.fp8.covers(function, node.id) \
                        or not any(node.outputs):
                    continue
                for value, need in zip(node.inputs, node_layouts(node)):
                    if value:
                        count, have = found.get(value, (0, (False, False)))
                        found[value] = (count + 1, tuple(a or b for a, b in zip(have, need)))
            self._readers[function] = found
        return self._readers[function]


def step_fp8(program, dist=None, device="cuda", graph=None) -> StepFp8 | None:
    """The program's recipe on the GPU step (None without one); refused when it holds
    what the GPU cannot run. Under data / tensor parallel (`dist`) each rank scales by its
    own amaxes and keeps its own histories (not reduced across ranks: `modulec train`
    refuses a recipe under torchrun, its checkpoint would hold one rank's). `graph`: the
    graph the step runs (its function names: `Casts`'s readers), the program's if None."""
    section = program.metadata.get("precision")
    if not section:
        return None
    refuse_on_gpu(program.metadata)
    if not section["matmuls"]:
        return None
    return StepFp8(section, device, graph if graph is not None else getattr(program, "graph",
                                                                             None))


def head_covered(fp8: StepFp8 | None, graph) -> bool:
    """The recipe covers the model's LM head (its `high_precision` leaves it out): the
    step then runs it as an FP8 GEMM, not through the fused bf16 head."""
    if fp8 is None:
        return False
    entry = graph.function(graph.entry)
    last = entry.nodes[-1] if entry.nodes else None
    return last is not None and fp8.covers(entry.name, last.id)
