"""`CUDA_KERNELS`: a GPU implementation of every primitive, keyed by primitive name, with
the reference calling convention (`forward(inputs, attrs)`, `backward(inputs, attrs)`,
runtime/kernels/base.py).

rmsnorm, fused_residual_rmsnorm, layernorm, fused_residual_layernorm, swiglu, geglu, gelu,
softmax (over the last dim; another dim goes to the reference), rope, qk_norm, qk_norm_rope
and embedding's backward have custom CUDA kernels (csrc/kernels). A call they do not cover
(tensors not on the GPU or not contiguous, a dtype other than bf16/fp32, inputs of mixed
dtypes, position_ids not int32) goes to the reference kernel, and so does every other
primitive: the reference kernels are torch ops, which run on CUDA tensors as they are.
swiglu, geglu, rope and qk_norm_rope take strided tensors too (`LAYOUTS`): swiglu and
geglu rows with one row stride each (the halves of the fused up projection), rope and
qk_norm_rope any [B, H, T, D] strides with D contiguous (the transposed heads of the fused
QKV projection). Each custom kernel keeps the reference's dtype policy: fp32 arithmetic,
outputs in the I/O dtype, rstd in fp32. The MoE routing gathers (runtime/cuda/moe.py) and
mamba_conv1d / mamba_selective_scan (runtime/cuda/mamba.py) have their own entries, which
decide their fallback to the reference themselves.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from runtime.cuda.mamba import MAMBA_KERNELS
from runtime.cuda.moe import MOE_KERNELS
from runtime.kernels import KERNELS
from runtime.kernels.base import ReferenceKernel
from runtime.kernels.rope_freq import device_frequencies
from runtime.kernels.tensor import block_layout

CUSTOM_DTYPES = (torch.bfloat16, torch.float32)


def _extension():
    from runtime.cuda.build import load

    return load()


def rows_layout(x: torch.Tensor) -> bool:
    """x seen as rows x C with one row stride (csrc/bindings.cpp `as_rows`)."""
    if x.dim() == 0 or x.stride(-1) != 1:
        return False
    return all(x.size(i) <= 1 or x.stride(i) == x.stride(i + 1) * x.size(i + 1)
               for i in range(x.dim() - 2))


def heads_layout(x: torch.Tensor) -> bool:
    """[B, H, T, D] with the last dim contiguous (rope's strided layout); position_ids and
    other non-floating tensors must be contiguous."""
    if not x.is_floating_point():
        return x.is_contiguous()
    return x.dim() == 4 and (x.stride(3) == 1 or x.size(3) <= 1)


def covered(inputs: list, names, stats, layout=None) -> bool:
    """Whether the custom kernels take these inputs: CUDA and contiguous (or, with
    `layout`, in the strided layout the kernel reads; a dict: by input name, the others
    contiguous), the floating
    tensors other than the statistics all of one dtype in CUSTOM_DTYPES, statistics fp32,
    integer tensors (position_ids) int32; None (an absent optional input) passes."""
    io = set()
    for name, x in zip(names, inputs):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or not x.is_cuda:
            return False
        reads = layout.get(name) if isinstance(layout, dict) else layout
        if not (reads(x) if reads else x.is_contiguous()):
            return False
        if name in stats:
            ok = x.dtype == torch.float32
        elif x.is_floating_point():
            io.add(x.dtype)
            ok = x.dtype in CUSTOM_DTYPES
        else:
            ok = x.dtype == torch.int32
        if not ok:
            return False
    return len(io) == 1


class CudaKernel:
    """A primitive with custom CUDA kernels, falling back to `reference` where they do not
    cover the call. `forward_fn` / `backward_fn` take (extension, inputs, attrs); one
    marked `writes_out` also takes `out`: each output's planned bytes (uint8) or None, on
    the arena (runtime/arena.py out_bytes)."""

    def __init__(self, reference: ReferenceKernel, forward_fn: Callable, backward_fn: Callable,
                 layout: Callable | dict | None = None):
        self.reference = reference
        self.forward_fn = forward_fn
        self.backward_fn = backward_fn
        self.layout = layout

    def __getattr__(self, attr):  # name, forward_inputs, ... as the reference has them
        return getattr(self.reference, attr)

    def covers_forward(self, inputs: list) -> bool:
        return covered(inputs, self.reference.forward_inputs, self.reference.stats, self.layout)

    def covers_backward(self, inputs: list) -> bool:
        return covered(inputs, self.reference.backward_inputs, self.reference.stats, self.layout)

    @property
    def takes_out(self) -> bool:
        return any(getattr(f, "writes_out", False) for f in (self.forward_fn, self.backward_fn))

    def forward(self, inputs: list, attrs: dict) -> list:
        out = attrs.pop("out", None)
        if self.covers_forward(inputs):
            return list(_call(self.forward_fn, inputs, attrs, out))
        return self.reference.forward(inputs, attrs)

    def backward(self, inputs: list, attrs: dict) -> list:
        out = attrs.pop("out", None)
        if self.covers_backward(inputs):
            return list(_call(self.backward_fn, inputs, attrs, out))
        return self.reference.backward(inputs, attrs)


def _call(fn: Callable, inputs: list, attrs: dict, out: list | None):
    if out and getattr(fn, "writes_out", False):
        if not getattr(fn, "writes_rows", False):  # strided parts: the kernel allocates
            out = [o if o is None or o.is_contiguous() else None for o in out]
        return fn(_extension(), inputs, attrs, out=out)
    return fn(_extension(), inputs, attrs)


def writes_out(fn: Callable) -> Callable:
    """Mark a custom kernel function that writes into given bytes (`out=`)."""
    fn.writes_out = True
    return fn


def writes_rows(fn: Callable) -> Callable:
    """Mark a `writes_out` function that also writes rows with one stride (a part of a
    planned concat over the last dim, given typed: runtime/arena.py)."""
    fn.writes_rows = True
    return writes_out(fn)


def typed(out: list | None, i: int, shape, dtype: torch.dtype) -> torch.Tensor | None:
    """out[i] (uint8 bytes) as a contiguous `shape` tensor of `dtype`, or None where there
    are none or too few; a typed out[i] (a strided part of a planned concat,
    runtime/arena.py) as it is, where it is that shape and dtype."""
    raw = out[i] if out and i < len(out) else None
    if raw is None:
        return None
    if raw.dtype != torch.uint8:  # typed already
        return _as_shape(raw, shape) if raw.dtype == dtype else None
    n = dtype.itemsize
    for d in shape:
        n *= int(d)
    return raw[:n].view(dtype).view(tuple(shape)) if raw.numel() >= n else None


def rows_apart(t: torch.Tensor) -> bool:
    """A 2-D tensor whose rows are contiguous and lie at least a row apart: a part of a
    wider matrix (t in x's spare columns, d_t beside d_y: runtime/cuda/lora_kcat.py)."""
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= t.shape[1]


def _as_shape(t: torch.Tensor, shape) -> torch.Tensor | None:
    """`t` as `shape`: itself, or a view of it when it is contiguous with as many elements."""
    shape = tuple(int(d) for d in shape)
    if tuple(t.shape) == shape:
        return t
    return t.view(shape) if t.is_contiguous() and t.numel() == math.prod(shape) else None


# ------------------------------------------------------------------- the custom kernels
def _eps(attrs) -> float:
    return float(attrs.get("eps", 1e-6))


def _offset(attrs) -> float:
    """The norm's scale is offset + weight (Gemma's `1 + w`: offset 1)."""
    return float(attrs.get("offset") or 0.0)


@writes_rows  # y: rows with one stride (a LoRA'd projection's input laid wide)
def _rmsnorm_fwd(ext, inputs, attrs, out=None):
    x, weight = inputs
    return ext.rmsnorm_forward(x, weight, _eps(attrs), _norm_outs(out, x, 0),
                               offset=_offset(attrs))


@writes_out
def _rmsnorm_bwd(ext, inputs, attrs, out=None):
    d_y, x, weight, rstd = inputs
    return ext.rmsnorm_backward(d_y, x, weight, rstd, None, [typed(out, 0, x.shape, x.dtype)],
                                offset=_offset(attrs), weight_grad=_weight_grad(attrs))


def _weight_grad(attrs) -> bool:
    """A norm backward's d_weight is wanted (the GPU step's interpreter says `weight_grad`
    False for a frozen weight's: the kernel then skips its partial sums, ~1/3 of its bytes)."""
    return bool(attrs.get("weight_grad", True))


def _norm_outs(out, x, first: int) -> list:
    """(residual_out,) y like x, then rstd fp32 over x's leading dims. y may be rows with
    one stride (the kernel writes them: a buffer the plan lays wide, modulec/plan/pads.py);
    the others only contiguous (else the kernel allocates and the arena copies in)."""
    like = [typed(out, i, x.shape, x.dtype) for i in range(first + 1)]
    stats = typed(out, first + 1, x.shape[:-1], torch.float32)
    dense = lambda t: t if t is None or t.is_contiguous() else None  # noqa: E731
    return [dense(t) for t in like[:first]] + [like[first], dense(stats)]


@writes_rows  # y as _rmsnorm_fwd's
def _fused_fwd(ext, inputs, attrs, out=None):
    residual, input, weight = inputs
    return ext.fused_residual_rmsnorm_forward(residual, input, weight, _eps(attrs),
                                              _norm_outs(out, residual, 1),
                                              offset=_offset(attrs))


@writes_rows  # d_x (and d_residual_out) rows with one stride: runtime/cuda/residual_rows.py
def _fused_bwd(ext, inputs, attrs, out=None):
    d_residual_out, d_y, residual_out, weight, rstd = inputs
    g, d_weight = ext.rmsnorm_backward(d_y, residual_out, weight, rstd, d_residual_out,
                                       [typed(out, 0, d_y.shape, d_y.dtype)],
                                       offset=_offset(attrs), weight_grad=_weight_grad(attrs))
    return [g, g, d_weight]  # d_residual and d_input are one tensor, as the reference's


def _gated(activation):
    """swiglu's kernels (csrc/kernels/swiglu.cu) for act(gate) * up; `activation(attrs)`
    picks act: 0 silu (swiglu), 1 tanh-form GELU, 2 erf GELU (geglu's `approximate`)."""
    @writes_rows
    def forward(ext, inputs, attrs, out=None):
        gate, up = inputs
        return [ext.swiglu_forward(gate, up, [typed(out, 0, gate.shape, gate.dtype)],
                                   activation=activation(attrs))]

    @writes_rows
    def backward(ext, inputs, attrs, out=None):
        """(d_gate, d_up, y): y, the forward's output, in the same pass where it is wanted
        (a written backward that reads it; `wanted_outputs`, the GPU step's, says not for a
        derived one's empty output), else None."""
        d_y, gate, up = inputs
        with_y = _wanted(attrs, 2)
        made = ext.swiglu_backward(d_y, gate, up, [typed(out, i, gate.shape, gate.dtype)
                                                   for i in range(3 if with_y else 2)],
                                   activation=activation(attrs), with_y=with_y)
        return made if with_y else made + [None]
    return forward, backward


def _wanted(attrs, index: int) -> bool:
    """Whether output `index` is wanted: all are unless `wanted_outputs` (the GPU step's
    interpreter, for a node with an empty output) says otherwise."""
    wanted = attrs.get("wanted_outputs")
    return wanted is None or bool(wanted[index])


_swiglu_fwd, _swiglu_bwd = _gated(lambda attrs: 0)
# geglu(approximate=true) is the tanh form (Gemma's gelu_pytorch_tanh), false the erf form
_geglu_fwd, _geglu_bwd = _gated(lambda attrs: 1 if attrs.get("approximate", True) else 2)


def _no_bias(attrs) -> bool:
    """layernorm's bias was absent (the recorded shapes say None), as the reference reads it."""
    shapes = attrs.get("input_shapes") or {}
    return "bias" in shapes and shapes["bias"] is None


@writes_out
def _layernorm_fwd(ext, inputs, attrs, out=None):
    x, weight, bias = (list(inputs) + [None])[:3]
    outs = [typed(out, 0, x.shape, x.dtype)] + [typed(out, i, x.shape[:-1], torch.float32)
                                                for i in (1, 2)]
    return ext.layernorm_forward(x, weight, bias, float(attrs.get("eps", 1e-5)), outs)


@writes_out
def _layernorm_bwd(ext, inputs, attrs, out=None):
    d_y, x, weight, mean, rstd = inputs
    with_bias = not _no_bias(attrs)
    grads = ext.layernorm_backward(d_y, x, weight, mean, rstd, None, with_bias,
                                   [typed(out, 0, x.shape, x.dtype)])
    return grads if with_bias else grads + [None]


@writes_out
def _fused_layernorm_fwd(ext, inputs, attrs, out=None):
    residual, input, weight, bias = (list(inputs) + [None])[:4]
    like = [typed(out, i, residual.shape, residual.dtype) for i in (0, 1)]
    stats = [typed(out, i, residual.shape[:-1], torch.float32) for i in (2, 3)]
    return ext.fused_residual_layernorm_forward(residual, input, weight, bias,
                                                float(attrs.get("eps", 1e-5)), like + stats)


@writes_out
def _fused_layernorm_bwd(ext, inputs, attrs, out=None):
    d_residual_out, d_y, residual_out, weight, mean, rstd = inputs
    with_bias = not _no_bias(attrs)
    grads = ext.layernorm_backward(d_y, residual_out, weight, mean, rstd, d_residual_out,
                                   with_bias, [typed(out, 0, d_y.shape, d_y.dtype)])
    g = grads[0]  # d_residual and d_input are one tensor, as the reference's
    return [g, g, grads[1], grads[2] if with_bias else None]


def _approximate(attrs) -> bool:
    return bool(attrs.get("approximate", True))


@writes_out
def _gelu_fwd(ext, inputs, attrs, out=None):
    (x,) = inputs
    return [ext.gelu_forward(x, _approximate(attrs), [typed(out, 0, x.shape, x.dtype)])]


@writes_out
def _gelu_bwd(ext, inputs, attrs, out=None):
    d_y, x = inputs
    return [ext.gelu_backward(d_y, x, _approximate(attrs), [typed(out, 0, x.shape, x.dtype)])]


def _last_dim(attrs, x: torch.Tensor) -> bool:
    """softmax's kernels take the last dim only (a row of memory)."""
    return x.dim() > 0 and int(attrs.get("dim", -1)) % x.dim() == x.dim() - 1


@writes_out
def _softmax_fwd(ext, inputs, attrs, out=None):
    (x,) = inputs
    if not _last_dim(attrs, x):
        return KERNELS["softmax"].forward(inputs, attrs)
    return [ext.softmax_forward(x, [typed(out, 0, x.shape, x.dtype)])]


@writes_out
def _softmax_bwd(ext, inputs, attrs, out=None):
    d_y, y = inputs
    if not _last_dim(attrs, y):
        return KERNELS["softmax"].backward(inputs, attrs)
    return [ext.softmax_backward(d_y, y, [typed(out, 0, y.shape, y.dtype)])]


_ROPE_TABLES: dict = {}  # inv_freq per (params, D, device): made before a graph is captured


def rope_args(attrs: dict, x: torch.Tensor, position_ids) -> tuple:
    """(inv_freq fp32 [n] on x's device, attention scaling, interleaved): what the CUDA
    rope kernels take for the primitive's params (runtime/kernels/rope_freq.py computes the
    frequencies in float64; 2n channels of each head rotate)."""
    inv_freq, scaling = device_frequencies(attrs, x.size(3), x.size(2), position_ids, x.device,
                                           _ROPE_TABLES, torch.float32)
    return inv_freq, float(scaling), bool(attrs.get("interleaved"))


def _rope(inverse: bool):
    """q and k rotated in one launch (`rope_pair`) into new tensors laid [B, T, H, D] (the
    attention's layout), returned as their [B, H, T, D] transposes."""
    def run(ext, inputs, attrs):
        q, k, position_ids = inputs
        args = rope_args(attrs, q, position_ids)
        outs = [torch.empty(x.size(0), x.size(2), x.size(1), x.size(3), dtype=x.dtype,
                            device=x.device).transpose(1, 2) for x in (q, k)]
        return list(ext.rope_pair(q, k, position_ids, *args, inverse, outs))
    return run


def _qk_norm_fwd(ext, inputs, attrs):
    q, k, q_weight, k_weight = inputs
    q_norm, q_rstd = ext.rmsnorm_forward(q, q_weight, _eps(attrs))
    k_norm, k_rstd = ext.rmsnorm_forward(k, k_weight, _eps(attrs))
    return [q_norm, k_norm, q_rstd, k_rstd]


def _qk_norm_bwd(ext, inputs, attrs):
    d_q_norm, d_k_norm, q, k, q_weight, k_weight, q_rstd, k_rstd = inputs
    d_q, d_q_weight = ext.rmsnorm_backward(d_q_norm, q, q_weight, q_rstd, None)
    d_k, d_k_weight = ext.rmsnorm_backward(d_k_norm, k, k_weight, k_rstd, None)
    return [d_q, d_k, d_q_weight, d_k_weight]


def qk_rope_layout(x: torch.Tensor) -> bool:
    """q, k and their gradients in rope's strided layout (`heads_layout`) with an even head
    dim up to 256 (the kernel keeps a lane's share of a row in registers); the weights, the
    rstds and position_ids contiguous."""
    if x.is_floating_point() and x.dim() == 4:
        return heads_layout(x) and x.size(3) % 2 == 0 and x.size(3) <= 256
    return x.is_contiguous()


def _qk_norm_rope_fwd(ext, inputs, attrs):
    q, k, q_weight, k_weight, position_ids = inputs
    return ext.qk_norm_rope_forward(q, k, q_weight, k_weight, position_ids, _eps(attrs),
                                    *rope_args(attrs, q, position_ids))


def _qk_norm_rope_bwd(ext, inputs, attrs, extra_heads: int = 0):
    """(d_q, d_k, d_q_weight, d_k_weight); d_q and d_k are head views of one buffer with
    `extra_heads` unwritten slots after them (runtime/cuda/train_kernels.py fills d_v in)."""
    *tensors, position_ids = inputs
    _, d_q, d_k, d_qw, d_kw = ext.qk_norm_rope_backward(
        *tensors, position_ids, *rope_args(attrs, tensors[2], position_ids), extra_heads)
    return [d_q, d_k, d_qw, d_kw]


def _embedding_fwd(ext, inputs, attrs):
    indices, weight = inputs  # a gather: torch's (no arithmetic, no cast)
    rows = weight.index_select(0, indices.reshape(-1).long())
    return [rows.reshape(*indices.shape, weight.shape[1])]


def _embedding_bwd(ext, inputs, attrs):
    """Deterministic: the ids sorted (stable) on the device, then one block per vocabulary
    row sums its rows in order (csrc/kernels/embedding.cu); the padding_idx row then zeroed."""
    from runtime.kernels.base import input_shape
    from runtime.kernels.embedding import zero_padding_row

    d_y, indices = inputs
    V, D = input_shape(attrs, "embedding", "weight")
    sorted_ids, order = torch.sort(indices.reshape(-1).long(), stable=True)
    d_weight = ext.embedding_backward(d_y.reshape(-1, D), sorted_ids, order, V)
    return [zero_padding_row(d_weight, attrs.get("padding_idx"))]


class BlockDiag:
    """block_diag (LoRA's block-diagonal B, modulec/lower/lora.py): one launch each way
    (csrc/kernels/block_diag.cu) where the matrices are contiguous CUDA tensors of one 2-
    or 4-byte dtype, at most `MAX_BLOCKS` of them; else the reference's torch ops, into
    the planned bytes where there are some. No dtype cast: the blocks are copied as they
    are. The forward writes y's planned bytes (`takes_out`); the backward gives each
    block's gradient a tensor of its own (a parameter's gradient: it has no planned bytes
    to go to)."""

    MAX_BLOCKS = 8  # csrc/kernels/kernels.h kMaxBlocks
    takes_out = True

    def __init__(self, reference: ReferenceKernel):
        self.reference = reference

    def __getattr__(self, attr):
        return getattr(self.reference, attr)

    def covers(self, tensors: list) -> bool:
        return 0 < len(tensors) <= self.MAX_BLOCKS and all(
            isinstance(t, torch.Tensor) and t.is_cuda and t.is_contiguous() and t.dim() == 2
            and t.dtype == tensors[0].dtype and t.element_size() in (2, 4) for t in tensors)

    def forward(self, inputs: list, attrs: dict) -> list:
        out, xs = attrs.pop("out", None), list(inputs[0])
        zero_rows = [int(r) for r in attrs.get("zero_rows") or ()]
        if self.covers(xs):
            shape = block_layout([tuple(x.shape) for x in xs], zero_rows)[1]
            y = typed(out, 0, shape, xs[0].dtype)
            return [_extension().block_diag_forward(xs, zero_rows, out=y)]
        y = self.reference.forward_fn(xs, zero_rows=zero_rows)[0]
        into = typed(out, 0, y.shape, y.dtype)
        return [into.copy_(y) if into is not None and into.is_contiguous() else y]

    def backward(self, inputs: list, attrs: dict) -> list:
        attrs.pop("out", None)
        d_y = inputs[0]
        shapes = [[int(d) for d in s] for s in attrs["input_shapes"]["xs"]]
        zero_rows = [int(r) for r in attrs.get("zero_rows") or ()]
        if self.covers([d_y]) and len(shapes) <= self.MAX_BLOCKS:
            return [_extension().block_diag_backward(d_y, shapes, zero_rows)]
        return list(self.reference.backward_fn(d_y, **attrs))


CUSTOM = {
    "rmsnorm": (_rmsnorm_fwd, _rmsnorm_bwd),
    "fused_residual_rmsnorm": (_fused_fwd, _fused_bwd),
    "swiglu": (_swiglu_fwd, _swiglu_bwd),
    "geglu": (_geglu_fwd, _geglu_bwd),
    "rope": (_rope(False), _rope(True)),
    "qk_norm": (_qk_norm_fwd, _qk_norm_bwd),
    "qk_norm_rope": (_qk_norm_rope_fwd, _qk_norm_rope_bwd),
    "embedding": (_embedding_fwd, _embedding_bwd),
    "layernorm": (_layernorm_fwd, _layernorm_bwd),
    "fused_residual_layernorm": (_fused_layernorm_fwd, _fused_layernorm_bwd),
    "gelu": (_gelu_fwd, _gelu_bwd),
    "softmax": (_softmax_fwd, _softmax_bwd),
}

# the custom kernels that read strided inputs (default: contiguous only); the fused
# residual norm its backward's d_residual_out alone (runtime/cuda/residual_rows.py)
LAYOUTS = {"swiglu": rows_layout, "geglu": rows_layout, "rope": heads_layout,
           "qk_norm_rope": qk_rope_layout,
           "fused_residual_rmsnorm": {"d_residual_out": rows_layout}}

CUDA_KERNELS: dict[str, CudaKernel | ReferenceKernel] = {
    name: CudaKernel(ref, *CUSTOM[name], LAYOUTS.get(name)) if name in CUSTOM else ref
    for name, ref in KERNELS.items()
} | MOE_KERNELS | MAMBA_KERNELS | {"block_diag": BlockDiag(KERNELS["block_diag"])}
# these wrap the reference themselves (runtime/cuda/moe.py, runtime/cuda/mamba.py, above)


def _rms_apply(x, stats, weight, offset: float = 0.0):
    """A replayed RMSNorm output, x * rstd * (offset + weight), in one launch (the forward
    kernel's arithmetic); None where the kernel does not take the tensors."""
    rstd = stats[0]
    tensors = (x, rstd, weight)
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors) \
            or x.dtype not in (torch.bfloat16, torch.float32) or weight.dtype != x.dtype:
        return None
    return _extension().rmsnorm_apply(x.contiguous(), rstd.contiguous(), weight.contiguous(),
                                      offset=float(offset))


# per norm: its output from the saved statistics (runtime/decisions.py `_apply_saved`)
APPLY_SAVED_KERNELS = {"rmsnorm": _rms_apply, "fused_residual_rmsnorm": _rms_apply}
