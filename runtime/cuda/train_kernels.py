"""`TRAIN_KERNELS`: the registry the GPU training step runs with, `CUDA_KERNELS` with
the entries that decide its speed replaced.

The reference calling convention casts every bf16 input to fp32 and back (base.py's dtype
policy). That is right for arithmetic but, on the GPU, a matmul run in fp32 is several
times slower than cuBLAS's bf16 GEMM (which accumulates in fp32 anyway), and a view or a
transpose cast to fp32 and back is two copies where none is needed. So:

- layout ops (view, transpose, split, concat, contiguous) and embedding's gather run on the
  tensors as they are, with no cast (they do no arithmetic);
- matmul runs as cuBLAS in the I/O dtype (bf16 operands, fp32 accumulation); transposes
  are strides, not copies;
- flash_attention runs through FlashAttention-2 (runtime/cuda/attention.py);
- rmsnorm, fused_residual_rmsnorm, qk_norm, layernorm, fused_residual_layernorm, gelu and
  softmax get contiguous inputs (a copy only where one is strided); swiglu, rope and
  qk_norm_rope read their strided inputs as they are (the MLP's gate/up are the halves of
  the fused up projection, the attention's q/k transposed heads of the fused QKV
  projection), rope and qk_norm_rope write [B, T, H, D] (FlashAttention's layout);
- no concat copy where the parts already lie side by side in one buffer: swiglu's
  backward writes d_gate / d_up into the halves of one [.., 2 * d_ff] buffer, so the
  concat (written backward) or the split's backward (derived) is a view of it; rope's
  backward and qk_norm_rope's backwards write d_q / d_k into the q and k head slots of a
  [B, T, Hq + 2 Hk, D] buffer and the concat of (d_q, d_k, d_v) copies only d_v into the
  slots left for it;
- zeros, ones and fills are made on the GPU;
- dropout draws its mask from the step's device counter (runtime/cuda/dropout.py), so a
  captured graph draws a new one each replay;
- a matmul backward computes only the gradients its node wants (`Matmul`): a frozen
  weight's (LoRA's base) d_B is neither computed nor allocated, only d_A;
- LoRA's `d = matmul(t, B, NT, alpha=s)` + `y = add(base, d)` run as one
  `addmm(base, t, B^T, alpha=s)` (`lora_addmm`; the step's interpreter finds the pairs,
  runtime/cuda/lora_pairs.py `lora_addmm_pairs`), into `base` itself where nothing else reads
  it: d is never materialized. On the arena, y's planned bytes get the delta first and
  base's GEMM adds into them (`lora_matmul_into`); in the backward, the adapter path's d_x
  is written into the d_x sum's bytes and the frozen weight's d_x GEMM adds into it
  (runtime/cuda/lora_backward.py): no elementwise add of the two;
- a matmul's alpha is the GEMM's (cuBLAS scales in fp32), not a second pass over C.

Everything else (embedding backward, cross_entropy, ...) is CUDA_KERNELS' entry; the
embedding backward is a deterministic custom kernel there. `--tp`'s vocab-parallel lookup
gathers uncast too and sends its backward (masked to the rank's rows) through that
kernel (`VocabParallelEmbedding`).
"""

from __future__ import annotations

import weakref

import torch

from runtime.cuda.attention import BACKENDS, FlashAttention
from runtime.cuda.dropout import DeviceDropout
from runtime.cuda.kernels import CUDA_KERNELS, BlockDiag, rows_apart, typed
from runtime.kernels import KERNELS
from runtime.cuda.gemm import mm_into
from runtime.cuda.lora_kcat import kcat_into
from runtime.kernels.linalg import _fold, _mm, _op
from runtime.kernels.base import ReferenceKernel

NO_CAST = ("view", "transpose", "split", "concat", "contiguous", "matmul", "batched_matmul",
           "tp_copy", "tp_all_reduce",  # the TP pair: NCCL reduces bf16 as it is
           "sp_all_gather", "sp_reduce_scatter", "sp_scatter", "sp_gather")  # and --sp's
CONTIGUOUS = ("rmsnorm", "fused_residual_rmsnorm", "qk_norm", "layernorm",
              "fused_residual_layernorm", "gelu", "softmax")
CREATED = ("zeros", "ones", "fill")


class NoCast:
    """A reference kernel called on its inputs as they are (no dtype cast)."""

    def __init__(self, reference: ReferenceKernel):
        self.reference = reference

    def __getattr__(self, attr):
        return getattr(self.reference, attr)

    def forward(self, inputs: list, attrs: dict) -> list:
        return list(self.reference.forward_fn(*inputs, **attrs))

    def backward(self, inputs: list, attrs: dict) -> list:
        return list(self.reference.backward_fn(*inputs, **attrs))


class Contiguous:
    """A kernel whose tensor inputs are made contiguous first (a copy only where needed),
    but the backward inputs its layout names (runtime/cuda/kernels.py LAYOUTS: the fused
    residual norm's d_residual_out, read as rows with one stride), left as they are."""

    def __init__(self, kernel):
        self.kernel = kernel
        layout = getattr(kernel, "layout", None)
        names = getattr(kernel, "backward_inputs", ()) if isinstance(layout, dict) else ()
        self.rows_backward = frozenset(i for i, name in enumerate(names) if name in layout)

    def __getattr__(self, attr):
        return getattr(self.kernel, attr)

    def forward(self, inputs: list, attrs: dict) -> list:
        return self.kernel.forward(_contiguous(inputs), attrs)

    def backward(self, inputs: list, attrs: dict) -> list:
        return self.kernel.backward(_contiguous(inputs, self.rows_backward), attrs)


def _contiguous(inputs: list, keep=frozenset()) -> list:
    return [x.contiguous() if isinstance(x, torch.Tensor) and i not in keep else x
            for i, x in enumerate(inputs)]


class Add(NoCast):
    """add of two operands of one floating dtype without the reference's fp32 round trip
    (torch adds bf16 in fp32 and rounds once: the reference's bits), written into the
    planned bytes on the arena (`takes_out`: no copy in). Its backward without
    broadcasting is d_y for both operands (the reference casts d_y to fp32 and back: the
    same bits, after three conversion kernels); other operands: the reference."""

    takes_out = True

    def forward(self, inputs: list, attrs: dict) -> list:
        out = attrs.pop("out", None)
        a, b = inputs
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) \
                or a.dtype != b.dtype or not a.is_floating_point():
            return self.reference.forward(inputs, attrs)
        y = typed(out, 0, torch.broadcast_shapes(a.shape, b.shape), a.dtype)
        if y is None:
            return [a + b]
        return [torch.add(a, b, out=y)]

    def backward(self, inputs: list, attrs: dict) -> list:
        attrs.pop("out", None)
        d_y = inputs[0]
        shapes = attrs.get("input_shapes") or {}
        if isinstance(d_y, torch.Tensor) and all(
                _shape_or(shapes.get(name), d_y) == tuple(d_y.shape) for name in ("a", "b")):
            return [d_y, d_y]
        return self.reference.backward(inputs, attrs)


def _shape_or(shape, like: torch.Tensor) -> tuple:
    """A recorded input shape, or `like`'s where none was recorded."""
    return tuple(like.shape) if shape is None else tuple(shape)


class Embedding(NoCast):
    """The gather without a cast; the backward through CUDA_KERNELS' deterministic
    scatter-add kernel (the fp32 reference where it does not cover the inputs)."""

    def backward(self, inputs: list, attrs: dict) -> list:
        return CUDA_KERNELS["embedding"].backward(inputs, attrs)


class VocabParallelEmbedding(NoCast):
    """`--tp`'s lookup in this rank's rows of the table: the masked gather without a cast
    (exact in bf16), the backward through the embedding's deterministic scatter-add kernel
    on the local rows (the other ranks' tokens add zero rows to row 0), the global
    `padding_idx` row zeroed where this rank holds it: no fp32 copy of the table."""

    def backward(self, inputs: list, attrs: dict) -> list:
        from runtime.kernels.base import input_shape
        from runtime.kernels.comm import group_rank
        from runtime.kernels.vocab_parallel import owned

        d_y, indices = inputs
        size, group = attrs["size"], attrs.get("group", "tp")
        rows = input_shape(attrs, "vocab_parallel_embedding", "weight")[0]
        local, mine = owned(indices, rows, size, group)
        plain = {k: v for k, v in attrs.items() if k not in ("size", "group", "padding_idx")}
        (d_weight,) = CUDA_KERNELS["embedding"].backward(
            [d_y * mine[..., None].to(d_y.dtype), local.to(torch.int32)], plain)
        padding = attrs.get("padding_idx")
        if padding is not None and 0 <= int(padding) - group_rank(size, group) * rows < rows:
            d_weight[int(padding) - group_rank(size, group) * rows].zero_()
        return [d_weight]


class Created(NoCast):
    """zeros / ones / fill on `device` (the reference makes them on the CPU by default);
    zeros and ones are written into their planned bytes on the arena (`takes_out`: LoRA's
    zero blocks, made each step, are not made elsewhere and copied in)."""

    takes_out = True
    FILLS = {"zeros": 0.0, "ones": 1.0}

    def __init__(self, reference: ReferenceKernel, device: str):
        super().__init__(reference)
        self.device = device

    def forward(self, inputs: list, attrs: dict) -> list:
        from runtime.kernels.utility import torch_dtype

        out = attrs.pop("out", None)
        value = self.FILLS.get(self.name)
        if out and value is not None:
            y = typed(out, 0, attrs["shape"], torch_dtype(attrs.get("dtype", "bf16")))
            if y is not None:
                return [y.fill_(value)]
        return super().forward(inputs, attrs | {"device": self.device})


# ------------------------------------------------------------- concat without a copy
# buffers made with room for a later concat's last part: storage pointer -> the storage
# offset where that part goes. Weak: the entry lives as long as the tensor it is
# attached to (a view of the buffer that the concat will read).
_SLACK: "weakref.WeakValueDictionary[int, _Slack]" = weakref.WeakValueDictionary()


class _Slack:
    def __init__(self, offset: int):
        self.offset = offset


def reserve_slack(owner: torch.Tensor, offset: int) -> None:
    """`owner`'s storage has unwritten room from storage offset `offset` on for the last
    part of a concat whose other parts are views of it (`join`); the note lives as long
    as `owner`."""
    slack = _Slack(offset)
    owner._modulec_slack = slack
    _SLACK[owner.untyped_storage().data_ptr()] = slack


def _side_by_side(parts: list, dim: int) -> bool:
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for p in parts:
        if (p.dtype != first.dtype or p.device != first.device or p.dim() != first.dim()
                or p.stride() != first.stride()
                or p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset
                or any(p.shape[d] != first.shape[d] for d in range(p.dim()) if d != dim)):
            return False
        offset += p.shape[dim] * p.stride(dim)
    return True


def _joined_shape(parts: list, dim: int) -> list:
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    return shape


def join(parts: list, dim: int) -> torch.Tensor | None:
    """The concat of `parts` along `dim` as a view, when they already lie side by side in
    one buffer (equal strides, each starting where the last ends), or when all but the
    last do and the buffer reserved room for the last (which is copied there); None
    otherwise."""
    if len(parts) < 2 or not all(isinstance(p, torch.Tensor) for p in parts):
        return None
    dim = dim % parts[0].dim()
    first = parts[0]
    if _side_by_side(parts, dim):
        return first.as_strided(_joined_shape(parts, dim), first.stride(), first.storage_offset())
    head, last = parts[:-1], parts[-1]
    if not _side_by_side(head, dim) or last.dtype != first.dtype:
        return None
    storage = first.untyped_storage().data_ptr()
    slack = _SLACK.get(storage)
    at = first.storage_offset() + sum(p.shape[dim] for p in head) * first.stride(dim)
    if slack is None or slack.offset != at or list(last.shape) != list(first.shape[:dim]) + [
            last.shape[dim]] + list(first.shape[dim + 1:]):
        return None
    first.as_strided(last.shape, first.stride(), at).copy_(last)
    _SLACK.pop(storage, None)  # the room is used
    return first.as_strided(_joined_shape(parts, dim), first.stride(), first.storage_offset())


class Concat(NoCast):
    """concat as a view where its parts lie side by side (`join`), else written into its
    planned bytes on the arena (`takes_out`), else torch.cat's own tensor."""

    takes_out = True

    def forward(self, inputs: list, attrs: dict) -> list:
        out = attrs.pop("out", None)
        parts, dim = list(inputs[0]), int(attrs.get("dim", -1))
        joined = join(parts, dim)
        if joined is None:
            joined = _cat_into(parts, dim, out)
        return [joined] if joined is not None else super().forward(inputs, attrs)


def _cat_into(parts: list, dim: int, out) -> torch.Tensor | None:
    """torch.cat(parts) written into the bytes out[0] (its promoted dtype, contiguous),
    or None where there are none, they do not fit, or a part lies in them."""
    if not out or out[0] is None or not parts \
            or not all(isinstance(p, torch.Tensor) for p in parts):
        return None
    dtype = parts[0].dtype
    for p in parts[1:]:
        dtype = torch.promote_types(dtype, p.dtype)
    if any(p.dim() != parts[0].dim() for p in parts):
        return None
    y = typed(out, 0, _joined_shape(parts, dim % parts[0].dim()), dtype)
    if y is None or not y.is_contiguous() or any(overlaps(p, y) for p in parts):
        return None
    return torch.cat(parts, dim=dim, out=y)


class Split(NoCast):
    """split; its backward (a concat of the parts' gradients) a view where it can be."""

    def backward(self, inputs: list, attrs: dict) -> list:
        d_parts = list(inputs[0])
        if all(d is not None for d in d_parts):
            joined = join(d_parts, int(attrs.get("dim", -1)))
            if joined is not None:
                return [joined]
        return super().backward(inputs, attrs)


class Rope:
    """rope through CUDA_KERNELS; the backward writes d_q / d_k into the head slots of a
    fused [B, T, Hq + 2 Hk, D] buffer with room left for d_v (the attention module's
    backward concatenates (d_q, d_k, d_v) over heads next: `join` then copies d_v alone),
    or, on the arena, into the head slots of the planned d_qkv (modulec.plan.joins)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getattr__(self, attr):
        return getattr(self.kernel, attr)

    takes_out = True  # the backward: typed strided targets (a concat planned in place)

    def forward(self, inputs: list, attrs: dict) -> list:
        attrs.pop("out", None)
        return self.kernel.forward(inputs, attrs)

    def backward(self, inputs: list, attrs: dict) -> list:
        out = attrs.pop("out", None)
        if not self.kernel.covers_backward(inputs):
            return self.kernel.backward(inputs, attrs)
        from runtime.cuda.kernels import _extension, rope_args

        d_q, d_k, position_ids = inputs
        args = rope_args(attrs, d_q, position_ids)
        if _typed_targets(out, (d_q, d_k)):  # the head slots of the planned d_qkv
            return list(_extension().rope_pair(d_q, d_k, position_ids, *args, True, list(out)))
        Hq, Hk, D = d_q.shape[1], d_k.shape[1], d_q.shape[3]
        _, g_q, g_k = _extension().rope_qk_into_heads(d_q, d_k, position_ids, *args, True, Hk)
        reserve_slack(g_q, (Hq + Hk) * D)
        return [g_q, g_k]


def _typed_targets(out, like) -> bool:
    """`out` holds a tensor shaped and typed as each of `like` (not planned bytes)."""
    return bool(out) and len(out) == len(like) and all(
        isinstance(o, torch.Tensor) and o.dtype == t.dtype and o.shape == t.shape
        and o.stride(-1) == 1 for o, t in zip(out, like))


class QkNormRope(Rope):
    """qk_norm_rope through CUDA_KERNELS: one launch each way, reading q / k as the strided
    head views of the fused QKV projection (no contiguous copies, unlike qk_norm's); the
    backward writes d_q / d_k into the head slots of a fused [B, T, Hq + 2 Hk, D] buffer
    with room left for d_v, as Rope's does."""

    takes_out = False

    def backward(self, inputs: list, attrs: dict) -> list:
        if not self.kernel.covers_backward(inputs):
            return self.kernel.backward(inputs, attrs)
        from runtime.cuda.kernels import _extension, _qk_norm_rope_bwd

        Hq, Hk, D = inputs[2].shape[1], inputs[3].shape[1], inputs[2].shape[3]
        grads = _qk_norm_rope_bwd(_extension(), inputs, attrs, extra_heads=Hk)
        reserve_slack(grads[0], (Hq + Hk) * D)
        return grads


class Matmul(NoCast):
    """matmul / batched_matmul with no cast; its backward reads `wanted_outputs` (a
    (d_A, d_B) pair of bools the GPU step's interpreter adds when one of the node's
    gradients is unwanted) and computes only the wanted ones (None for the other).
    `takes_out`: on the arena, attrs["out"] holds each output's planned bytes (uint8, or
    None) and a 2-D product is written there by cuBLAS (`mm(out=)`), not copied in."""

    takes_out = True

    def forward(self, inputs: list, attrs: dict) -> list:
        out = attrs.pop("out", None) or [None]
        A, B = inputs
        if self.name == "matmul" and out[0] is not None:
            C = matmul_into(A, B, attrs, out[0])
            if C is not None:
                return [C]
        return super().forward(inputs, attrs)

    def backward(self, inputs: list, attrs: dict) -> list:
        out = attrs.pop("out", None)
        wanted = attrs.pop("wanted_outputs", None)
        b_blocks = attrs.pop("b_blocks", None)  # B block-diagonal (the step's interpreter)
        b_compact = attrs.pop("b_compact", False)  # and its blocks' gradients stacked
        # an NT matmul's both gradients may take one pass (`_skinny_grads`), planned or not
        skinny = self.name == "matmul" and attrs.get("transpose") == "NT"
        if (wanted is None or all(wanted)) and not skinny \
                and not (out and any(o is not None for o in out)):
            return list(self.reference.backward_fn(*inputs, **attrs))
        return matmul_grads(*inputs, wanted=wanted or (True, True), out=out,
                            batched=self.name == "batched_matmul", b_blocks=b_blocks,
                            b_compact=b_compact, **attrs)


# the operands of (d_A, d_B) by mode: (x, y, mode) with d = alpha * op(x) @ op(y), over
# (g, a, b) = (d_C, A, B) (runtime/kernels/linalg.py's formulas)
GRADIENT_PRODUCTS = {
    "NN": ((0, 2, "NT"), (1, 0, "TN")),
    "NT": ((0, 2, "NN"), (0, 1, "TN")),
    "TN": ((2, 0, "NT"), (1, 0, "NN")),
    "TT": ((2, 0, "TT"), (0, 1, "TT")),
}


def matmul_grads(d_C, A, B, *, wanted, batched=False, transpose="NN", alpha=1.0, out=None,
                 b_blocks=None, b_compact=False, **_):
    """The wanted ones of (d_A, d_B) of C = alpha * op(A) @ op(B), None for the others;
    `out`: planned bytes per gradient (or None), written in place where the product is 2-D;
    `b_blocks`: B's block rows where it is block-diagonal (skinny_grads.py); `b_compact`:
    then d_B may come back as its blocks' gradients stacked, [N, 16] (the one-pass kernel's
    `compact`: the caller checks d_B's shape)."""
    from runtime.kernels.base import sum_to_shape

    operands = (d_C, A, B) if batched else (_fold(d_C), _fold(A), _fold(B))
    if not batched and transpose == "NT" and all(wanted):
        both = _skinny_grads(*operands, alpha, out, A, B, b_blocks, b_compact)
        if both is not None:
            return both
    grads = []
    for want, (x, y, mode), like, raw in zip(wanted, GRADIENT_PRODUCTS[transpose], (A, B),
                                              out or (None, None)):
        if not want:
            grads.append(None)
            continue
        x, y = operands[x], operands[y]
        if batched:
            grads.append(sum_to_shape(_mm(x, y, mode, alpha), like.shape))
            continue
        grad = product_into(x, y, mode, alpha, raw) if raw is not None else None
        grads.append((grad if grad is not None else _mm(x, y, mode, alpha)).reshape(like.shape))
    return grads


def _skinny_grads(d_C, a, b, alpha, out, A, B, blocks=None, compact=False) -> list | None:
    """Both gradients of a rank-wide NT product (LoRA's delta) from one pass over d_C
    (runtime/cuda/skinny_grads.py), into their planned bytes where given; None where the
    kernel does not cover the call."""
    from runtime.cuda.skinny_grads import skinny_nt_backward

    if not isinstance(a, torch.Tensor) or a.dim() != 2:
        return None
    targets = [typed(out, i, like.shape, like.dtype) if out else None
               for i, like in enumerate((a, b))]
    grads = skinny_nt_backward(d_C, a, b, alpha, targets, blocks, compact)
    if grads is None:
        return None
    stacked = grads[1].shape != b.shape  # the blocks' gradients stacked ([N, 16])
    return [grads[0].reshape(A.shape), grads[1] if stacked else grads[1].reshape(B.shape)]


def product_into(x: torch.Tensor, y: torch.Tensor, mode: str, alpha: float,
                 raw: torch.Tensor) -> torch.Tensor | None:
    """alpha * op(x) @ op(y) of 2-D operands written into the bytes `raw` (uint8), or None
    where it does not fit them (other dtypes, too few bytes): the caller computes it."""
    a, b = _op(x, mode[0]), _op(y, mode[1])
    if a.dim() != 2 or b.dim() != 2 or a.dtype != b.dtype or not a.is_floating_point():
        return None
    C = planned_product(raw, a, b)
    # alpha in the GEMM (beta = 0: C's old bytes are not read), not a second pass
    return None if C is None else mm_into(a, b, C, alpha)


def planned_product(raw: torch.Tensor, a: torch.Tensor, b: torch.Tensor
                     ) -> torch.Tensor | None:
    """The bytes `raw` as a @ b's C: contiguous, or a typed `raw` whose rows lie apart (t
    written into x's spare columns, the step interpreter's `_t_beside_x`); None where
    they do not fit."""
    if raw.device != a.device:
        return None
    C = typed([raw], 0, (a.shape[0], b.shape[1]), a.dtype)
    if C is None:
        return None
    return C if C.is_contiguous() or (raw.dtype != torch.uint8 and rows_apart(C)) else None


def matmul_into(A: torch.Tensor, B: torch.Tensor, attrs: dict,
                raw: torch.Tensor) -> torch.Tensor | None:
    """matmul(A, B) (attrs: transpose, alpha) written into the bytes `raw`, shaped as the
    matmul's C (A's leading dims kept in NN / NT mode), or None where it does not fit."""
    mode, alpha = attrs.get("transpose", "NN"), float(attrs.get("alpha", 1.0))
    C = product_into(_fold(A), _fold(B), mode, alpha, raw)
    if C is None:
        return None
    keep = mode[0] == "N" and A.dim() > 2
    return C.view(*A.shape[:-1], C.shape[-1]) if keep else C


def lora_matmul_into(x: torch.Tensor, w: torch.Tensor, attrs: dict, t: torch.Tensor,
                     B: torch.Tensor, alpha: float, raw: torch.Tensor, pad: int = 0,
                     pieces=None) -> torch.Tensor | None:
    """matmul(x, w) (attrs: transpose, alpha) + alpha * t @ B^T written into the bytes
    `raw`, shaped as the matmul's C; None where it does not fit (nothing written). The
    delta first (a GEMM of K = rank that only writes C), then the base product added in
    cuBLAS's epilogue (addmm_, beta = 1): C is written once and read once by the big,
    compute-bound GEMM, where base first and the delta added after (a memory-bound GEMM
    of K = rank with beta = 1) read and wrote all of C again. Where W was laid with a
    side slot (runtime/cuda/lora_kcat.py), one GEMM over [x | t] and [W | alpha B] writes
    C and nothing is read back: in x's own bytes where the plan laid its rows `pad`
    elements wider, else (a wide projection) in a copy (`pieces`: B's parameters, for
    kcat_into)."""
    mode, base_alpha = attrs.get("transpose", "NN"), float(attrs.get("alpha", 1.0))
    if not all(isinstance(v, torch.Tensor) for v in (x, w, t, B)) or B.dim() != 2 \
            or w.dim() != 2 or x.dim() < 2 or t.dim() < 2:
        return None
    a, b, t2 = _op(_fold(x), mode[0]), _op(w, mode[1]), _fold(t)
    if a.shape[1] != b.shape[0] or t2.shape != (a.shape[0], B.shape[1]) \
            or B.shape[0] != b.shape[1] or not (a.dtype == b.dtype == t2.dtype == B.dtype) \
            or a.numel() == 0:
        return None
    C = planned_product(raw, a, b)
    if C is None:
        return None
    if mode == "NT" and base_alpha == 1.0 \
            and kcat_into(a, w, t2, B, alpha, C, pad, pieces) is not None:
        return _kept(C, x, mode)  # one GEMM over [x | t] and [W | s B] (lora_kcat.py)
    mm_into(t2, B.t(), C, alpha)  # the delta first: its GEMM only writes C
    mm_into(a, b, C, base_alpha, beta=1.0)
    return _kept(C, x, mode)


def _kept(C: torch.Tensor, x: torch.Tensor, mode: str) -> torch.Tensor:
    """The matmul's C with x's leading dims kept (NN / NT mode)."""
    keep = mode[0] == "N" and x.dim() > 2
    return C.view(*x.shape[:-1], C.shape[-1]) if keep else C


def overlaps(a, b) -> bool:
    """Tensors `a` and `b` share bytes (one storage, intersecting byte spans)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) \
            or a.numel() == 0 or b.numel() == 0 \
            or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = byte_span(a), byte_span(b)
    return a0 < b1 and b0 < a1


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range [start, end) a tensor's elements lie in."""
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def lora_addmm(base: torch.Tensor, t: torch.Tensor, B: torch.Tensor, alpha: float,
               inplace: bool) -> torch.Tensor | None:
    """base + alpha * t @ B^T (t: [.., r], B: [n, r], base: [.., n]) as one GEMM with
    beta = 1 (cuBLAS reads base in its epilogue), into base when `inplace` (base must be
    contiguous then); None where the operands do not fit (the caller runs matmul + add)."""
    if not all(isinstance(v, torch.Tensor) for v in (base, t, B)) or B.dim() != 2 \
            or t.dim() < 2 or t.shape[-1] != B.shape[1] \
            or tuple(base.shape) != (*t.shape[:-1], B.shape[0]) \
            or not (base.dtype == t.dtype == B.dtype) \
            or not (base.device == t.device == B.device) or base.numel() == 0:
        return None
    t2 = t.reshape(-1, t.shape[-1])
    if inplace and base.is_contiguous():
        mm_into(t2, B.t(), base.view(-1, base.shape[-1]), alpha, beta=1.0)
        return base
    out = torch.addmm(base.reshape(-1, base.shape[-1]), t2, B.t(), alpha=alpha)
    return out.view(base.shape)


def train_kernels(device: str = "cuda", attention=("flash",)) -> dict:
    """The registry; `attention`: the attention backends to try in order
    (runtime/cuda/attention.py BACKENDS)."""
    kernels = dict(CUDA_KERNELS)
    kernels.update({name: NoCast(KERNELS[name]) for name in NO_CAST})
    kernels.update({name: Matmul(KERNELS[name]) for name in ("matmul", "batched_matmul")})
    kernels.update({name: Contiguous(CUDA_KERNELS[name]) for name in CONTIGUOUS})
    kernels["add"] = Add(KERNELS["add"])
    kernels["concat"] = Concat(KERNELS["concat"])
    kernels["block_diag"] = BlockDiag(KERNELS["block_diag"])  # its own: tests set takes_out
    kernels["split"] = Split(KERNELS["split"])
    kernels["rope"] = Rope(CUDA_KERNELS["rope"])
    kernels["qk_norm_rope"] = QkNormRope(CUDA_KERNELS["qk_norm_rope"])
    kernels["embedding"] = Embedding(KERNELS["embedding"])
    kernels["vocab_parallel_embedding"] = VocabParallelEmbedding(
        KERNELS["vocab_parallel_embedding"])
    kernels.update({name: Created(KERNELS[name], device) for name in CREATED})
    kernels["flash_attention"] = FlashAttention(tuple(attention))
    kernels["dropout"] = DeviceDropout(KERNELS["dropout"])  # masks from a device seed
    # `@kernel("cudnn")` etc. (runtime/kernel_choice.py): one attention backend, the
    # step's order for a call it does not cover (an error with fallback=false)
    kernels.update({f"flash_attention@{name}": FlashAttention(
        (name,), fallback=kernels["flash_attention"]) for name in BACKENDS})
    return kernels


def allocating_ops(kernels: dict) -> frozenset:
    """The ops whose kernels allocate their outputs (`allocates_outputs`: no `out=`): on the
    arena their saved values keep those bytes (runtime/arena.py own_saved)."""
    return frozenset(name for name, kernel in kernels.items()
                     if getattr(kernel, "allocates_outputs", False))


TRAIN_KERNELS = train_kernels()
