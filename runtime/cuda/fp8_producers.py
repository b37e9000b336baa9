"""Delayed scaling's FP8 cast fused into the kernel that produces the cast tensor
(decisions.md, "FP8 on the GPU: the cast in its producer"; opt-in, `FUSED`).

Under delayed scaling an operand's scale comes from its amax history, known before the
tensor exists. So where a forward's RMSNorm (rmsnorm, fused_residual_rmsnorm) or SwiGLU /
GeGLU output is read first by a covered FP8 matmul, the producing kernel writes the fp8
copy too and takes its amax, in the pass that writes the bf16 output: the separate cast
(fp8_amax.cu `fp8_cast_delayed`) would read that output back. The norm writes y in fp8
row-major and y^T comes from those bytes (fp8_amax.cu `launch_fp8_delayed_finish`: a
byte transpose, not a second read of the bf16 y: a norm block holds one row, too few for
a transposed tile); SwiGLU writes both layouts (its kernel is cut into 64 x 64 tiles).
The numbers are the separate cast's bit for bit (the same quantize and amax on the bf16
value as stored): tests/test_fp8_producers.py.

Which matmul reads the output first, and so which operand key (and amax history row)
scales it, is found from the graph: a covered matmul of the same function reading the
value, or of the function a call (not repeated) passes it to, as its first covered
reader there. Its layouts are those `Casts.quantize` would cast at that first use (x^T
too where kept for the backward). Anything else (current scaling, a key new this step,
shapes or dtypes the kernels do not take, hooks or a replay) runs as before: the plain
kernel, then the cast at the matmul.
"""

from __future__ import annotations

import weakref

import torch

from runtime import fp8_gemm
from runtime.cuda.fp8_step import Casts, _Cast, node_layouts
from runtime.fp8 import FORMATS, covered

# Opt-in until measured on a GPU (benchmarks/train_step.py's `fusedcast` variant): read
# when a step's interpreter first meets a producer.
FUSED = False

# producer -> (y's output index, the norm's fp8 copy is row-major first: plain needed)
PRODUCERS = {"rmsnorm": (0, True), "fused_residual_rmsnorm": (1, True),
             "swiglu": (0, False), "geglu": (0, False)}


class ProducedCasts(Casts):
    """`Casts` whose first use of a tensor takes the fp8 copies its producer made
    (`produced`), where that use's key scales by the row the producer used."""

    def __init__(self, fp8, graph=None):
        super().__init__(fp8, graph)
        self._made: dict[int, object] = {}  # id(x) -> its producer's _Cast
        self._next = None
        self.counts["produced"] = 0

    def clear(self) -> None:
        super().clear()
        self._made = {}

    def produced(self, x, fmt: str, key: str, q: fp8_gemm.Quantized) -> None:
        self._made[id(x)] = _Cast(weakref.ref(x), fmt, self.fp8.scales.rows[key], q.scale,
                                  q.inv_scale, q)

    def quantize(self, x, fmt, key, weight, node, i, frame, forward=None):
        made = self._made.pop(id(x), None) if x is not None else None
        if made is not None and made.ref() is x and made.fmt == fmt \
                and self.fp8.scales.share(key, made.row):
            self._next = made  # taken by _first, this use being x's first
        try:
            return super().quantize(x, fmt, key, weight, node, i, frame, forward)
        finally:
            self._next = None

    def _first(self, x, fmt: str, key: str, layouts: tuple):
        made, self._next = self._next, None
        if made is None or made.ref() is not x:
            return super()._first(x, fmt, key, layouts)
        self.counts["produced"] += 1
        return made


def producers_of(fp8, graph) -> "Producers":
    """The step's `Producers` (made once, kept on its StepFp8)."""
    made = getattr(fp8, "producers", None)
    if made is None:
        made = fp8.producers = Producers(fp8, graph)
    return made


class Producers:
    """The producers of one step's graph whose outputs get their fp8 copy in their pass."""

    def __init__(self, fp8, graph):
        self.fp8, self.graph = fp8, graph
        self._readers: dict = {}  # (function, node id) -> (callee, call, matmul, index)
        self.counts = {"fused": 0}
        if not isinstance(fp8.casts, ProducedCasts):  # the same state, first uses taken
            casts = ProducedCasts.__new__(ProducedCasts)
            casts.__dict__.update(fp8.casts.__dict__)
            casts._made, casts._next = {}, None
            casts.counts = {**casts.counts, "produced": 0}
            fp8.casts = casts

    # ------------------------------------------------------------- the graph
    def first_reader(self, function, node):
        """(function, call node or None, covered matmul, input index) reading `node`'s
        output first; None where none does (or not found simply)."""
        key = (function.name, node.id)
        if key not in self._readers:
            self._readers[key] = self._find(function, node)
        return self._readers[key]

    def _find(self, function, node):
        spec = PRODUCERS.get(node.target)
        if spec is None or function.gradient_of or len(node.outputs) <= spec[0]:
            return None
        value = node.outputs[spec[0]]
        after = function.nodes[list(function.nodes).index(node) + 1:]
        found = self._reader_in(function, {value}, after)
        if found is None or found[0] != "call":
            return None if found is None else (function, None, found[1], found[2])
        call = found[1]
        callee = self.graph.function(call.target)
        if str(call.repeat) != "1" or callee.gradient_of:
            return None
        inner = {callee.inputs[j].id for j, v in enumerate(call.inputs)
                 if v == value and j < len(callee.inputs)}
        found = self._reader_in(callee, inner, callee.nodes)
        if found is None or found[0] != "matmul":
            return None
        return callee, call, found[1], found[2]

    def _reader_in(self, function, values: set, nodes):
        """("matmul", node, index) or ("call", node, None): the first node of `nodes`
        that quantizes one of `values` (a covered forward matmul) or passes it on."""
        values = set(values)
        for n in nodes:
            if n.kind == "alias" and n.inputs and n.inputs[0] in values:
                values.add(n.outputs[0])
                continue
            hits = [i for i, v in enumerate(n.inputs) if v in values]
            if not hits:
                continue
            if n.kind == "call":
                return "call", n, None
            if n.target == "matmul" and self.fp8.covers(function.name, n.id):
                return "matmul", n, hits[0]
        return None

    # ------------------------------------------------------------- one run
    def run(self, interp, node, frame) -> bool:
        """Run forward `node` with its output's fp8 copy where it can (True: done)."""
        reader = self.first_reader(frame.function, node)
        if reader is None or not self.fp8.scales.recording:
            return False
        callee, call, matmul, index = reader
        where = interp._child_frame(callee, frame, call, 0) if call is not None else frame
        plan = covered(self.fp8.sites, self.fp8.recipe, matmul, where, None)
        if plan is None or plan[index][2]:
            return False
        fmt, key, _ = plan[index]
        plain, transposed = self._layouts(callee, matmul, index)
        if PRODUCERS[node.target][1] and not plain:
            return False
        kernel = interp.kernels.get(node.target)
        if interp._kernel(node.target, node, frame) is not kernel:  # `@kernel` chose another
            return False
        slot = delayed_slot(self.fp8.scales, fmt, key)
        if slot is None:
            return False
        attrs = interp._attrs(node)
        interp._out_bytes(kernel, node, frame, attrs)
        inputs = interp._inputs(node, frame, None)
        made = launch(node.target, inputs, attrs, attrs.pop("out", None),
                      self.fp8.scales._work(), slot, transposed)
        if made is None:
            return False
        outputs, (scale, inv_scale, q, q_t) = made
        for value, tensor in zip(node.outputs, outputs):
            if value:
                frame.env[value] = interp._after(node, frame, value, tensor)
        y = frame.env[node.outputs[PRODUCERS[node.target][0]]]
        copies = fp8_gemm.Quantized(fp8_gemm._fold(y), fmt, scale, inv_scale)
        copies._plain, copies._transposed = q, q_t
        self.fp8.casts.produced(y, fmt, key, copies)
        self.counts["fused"] += 1
        return True

    def _layouts(self, function, matmul, index) -> tuple:
        """(plain, transposed) that the first use casts (Casts.quantize's)."""
        casts, value = self.fp8.casts, matmul.inputs[index]
        readers = casts._readers_of(function.name).get(value, (1, (False, False)))[1]
        layouts = tuple(a or b for a, b in zip(readers, node_layouts(matmul)[index]))
        return layouts[0], layouts[1] or casts._holds(function.name, value)


def kernels_take(scales) -> bool:
    """Delayed scaling's casts run by the CUDA kernels (as ScaleState.cast_delayed's)."""
    return scales.device.type == "cuda" and fp8_gemm.CAST["cuda"] == "kernel" \
        and fp8_gemm.CAST["delayed"] == "fused" and scales.kind == "delayed"


def delayed_slot(scales, fmt: str, key: str) -> tuple | None:
    """(pending or None, past, top, fmt code) of operand `key`: what ScaleState.cast_delayed
    passes its kernel. None where that cast would not run (`kernels_take`, a key new this
    step)."""
    if not kernels_take(scales):
        return None
    row = scales._row(key)
    if scales.window is None or row >= len(scales.window):
        return None
    pending = scales.pending[row] if scales.recording else None
    return (pending, scales.window[row], FORMATS[fmt][1] / 2.0 ** scales.margin,
            0 if fmt == "fp8_e4m3" else 1)


# ---------------------------------------------------------------- the kernels
def _fits(*tensors) -> bool:
    """bf16 CUDA 2-D rows (last dim contiguous), 16-byte aligned, rows and cols and row
    strides multiples of 8: what the fused kernels take."""
    for t in tensors:
        if t is None:
            continue
        if not (isinstance(t, torch.Tensor) and t.is_cuda and t.dtype == torch.bfloat16
                and t.dim() == 2 and t.stride(1) == 1 and t.shape[0] % 8 == 0
                and t.shape[1] % 8 == 0 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0):
            return False
    return True


def _bytes(out, i: int, shape, dtype):
    """out[i] as `shape` (the arena's planned bytes); (ok, tensor or None): not ok where
    bytes are planned but cannot be taken contiguous."""
    from runtime.cuda.kernels import typed

    if not out or i >= len(out) or out[i] is None:
        return True, None
    t = typed(out, i, shape, dtype)
    return (t is not None and t.is_contiguous()), t


def launch(target: str, inputs: list, attrs: dict, out, work, slot: tuple,
           transposed: bool):
    """(the node's outputs, (scale, 1 / scale, fp8 y, fp8 y^T or None)), or None where the
    fused kernels do not take these tensors (the caller runs the plain kernel)."""
    from runtime.cuda.kernels import _extension, _eps, _offset

    pending, past, top, code = slot
    if target in ("rmsnorm", "fused_residual_rmsnorm"):
        *xs, weight = inputs
        shape = xs[0].shape
        flat = [x.reshape(-1, shape[-1]) if x.is_contiguous() else None for x in xs]
        rows, C = (flat[0].shape if flat[0] is not None else (0, 0))
        wanted = [(shape[:-1].numel(), C)] * len(xs) + [(rows,)]
        dtypes = [torch.bfloat16] * len(xs) + [torch.float32]
        given = [_bytes(out, i, s, d) for i, (s, d) in enumerate(zip(wanted, dtypes))]
        if any(f is None for f in flat) or not _fits(*flat) or not all(ok for ok, _ in given) \
                or weight.dtype != torch.bfloat16 or not weight.is_contiguous() \
                or weight.data_ptr() % 16 or not _fits(*(t for _, t in given[:-1])):
            return None
        made = _extension().rmsnorm_forward_fp8(
            flat[0], flat[1] if len(flat) > 1 else None, weight, _eps(attrs), _offset(attrs),
            [t for _, t in given], work, pending, past, top, code, transposed)
        n = len(xs)
        outputs = [t.view(shape) for t in made[:n]] + [made[n].view(shape[:-1])]
        rest = made[n + 1:]
    else:
        from runtime.cuda.kernels import rows_layout

        gate, up = inputs
        if not (isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor)
                and gate.shape == up.shape and rows_layout(gate) and rows_layout(up)):
            return None
        shape = gate.shape
        g2, u2 = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])
        ok, y = _bytes(out, 0, tuple(g2.shape), torch.bfloat16)
        if not ok or not _fits(g2, u2, y):
            return None
        activation = 0 if target == "swiglu" else (1 if attrs.get("approximate", True) else 2)
        made = _extension().swiglu_forward_fp8(g2, u2, [y], activation, work, pending, past,
                                               top, code, transposed)
        outputs = [made[0].view(shape)]
        rest = made[1:]
    scale, inv_scale, q, *q_t = rest
    return outputs, (scale, inv_scale, q, q_t[0] if q_t else None)
