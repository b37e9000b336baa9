"""Every primitive's shape rule, on concrete sizes: one table.

Each case is a tiny module `T()` whose inputs have concrete shapes, whose graph calls one
primitive (or its `_backward`), and whose outputs are declared with the shapes and dtypes
the primitive must produce. A case must check with no diagnostics at all, and the types
the checker infers for the outputs must be exactly the declared ones (dtype included:
the output comparison of `modulec check` itself only warns about narrowing).

A case's `broken` variants rewrite one piece of its text (`old` -> `new`) and must give
exactly one diagnostic, with the given code and message fragment (and help fragment).
Every primitive of `std/primitives` must have a case: a new primitive without one fails
`test_every_primitive_has_a_case`. A case marked `xfail` records a known checker bug
(strict: once the bug is fixed, the case passes and the marker must go).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from modulec.check.driver import check_program
from modulec.check.graph import declared_type
from modulec.ops.registry import op_table
from modulec.syntax.parser import parse_text


@dataclass(frozen=True)
class Break:
    """Replace `old` by `new` in the case's inputs, or else in its flow (where it must
    occur exactly once): the program must then give one diagnostic `code` whose message
    contains `message` (and a help line containing `help`, when given)."""

    old: str
    new: str
    code: str
    message: str
    help: str | None = None


@dataclass(frozen=True)
class Case:
    op: str     # the primitive covered (`rmsnorm_backward` covers rmsnorm too)
    ins: str    # `x: [2, 3, 8], w: [8]`
    flow: str   # `(x, w) -> rmsnorm() -> (y, rstd)`
    outs: str   # `y: [2, 3, 8], rstd: [2, 3, fp32]`: the expected shapes and dtypes
    broken: tuple[Break, ...] = ()
    xfail: str | None = None  # a known checker bug (the case must currently fail)

    @property
    def program(self) -> str:
        return (f"module T():\n  forward:\n    in: ({self.ins})\n    out: ({self.outs})\n"
                f"    graph:\n      {self.flow}\n")

    def broken_program(self, broken: Break) -> str:
        field = "ins" if broken.old in self.ins else "flow"
        text = getattr(self, field)
        assert text.count(broken.old) == 1, f"`{broken.old}` must occur once in {field}"
        return replace(self, **{field: text.replace(broken.old, broken.new)}).program


def B(old, new, code, message, help=None) -> Break:  # noqa: N802 (short, for the table)
    return Break(old, new, code, message, help)


NOT_FLOAT = "must be a floating tensor, found int32"
Q, KV = "q: [2, 8, 16, 32], k: [2, 2, 16, 32]", "v: [2, 2, 16, 32]"  # GQA: Hq=8, Hkv=2

CASES: list[Case] = [
    # ------------------------------------------------------------------ matmul (§6.1.1)
    Case("matmul", "a: [4, 8], b: [8, 16]", "(a, b) -> matmul() -> c", "c: [4, 16]",
         (B("b: [8, 16]", "b: [16, 8]", "E004", "`matmul(transpose=NN)` contracts 8",
            help="another transpose mode would fit: `transpose=NT` gives [4, 16]"),
          B("a: [4, 8]", "a: [4, 8, int32]", "E015", "multiplies floating tensors; A is int32"),
          B("a: [4, 8]", "a: [8]", "E004", "`matmul` needs matrices; A has shape [8]"))),
    Case("matmul", "x: [2, 3, 8], w: [8, 16]", "(x, w) -> matmul(transpose=NN) -> y",
         "y: [2, 3, 16]"),
    Case("matmul", "x: [3, 8], w: [2, 4, 16]", "(x, w) -> matmul(transpose=NN) -> y",
         "y: [3, 16]"),  # B's leading dims fold into its rows: [8, 16]
    Case("matmul", "x: [2, 3, 8], w: [16, 8]", "(x, w) -> matmul(transpose=NT) -> y",
         "y: [2, 3, 16]",  # y = x·Wᵀ, W stored [out, in]
         (B("transpose=NT", "transpose=TN", "E004",
            "`matmul(transpose=TN)` contracts 6 (from A: [2, 3, 8]) with 16",
            help="another transpose mode would fit: `transpose=NT` gives [2, 3, 16]"),
          B("transpose=NT", "transpose=XY", "E003", "must be one of NN, NT, TN, TT"))),
    Case("matmul", "a: [4, 8], b: [16, 8]", "(a, b) -> matmul(transpose=NT) -> c", "c: [4, 16]"),
    Case("matmul", "d_y: [2, 3, 16], x: [2, 3, 8]", "(d_y, x) -> matmul(transpose=TN) -> d_w",
         "d_w: [16, 8]",  # d_W = d_yᵀ·x contracts batch and time
         (B("x: [2, 3, 8]", "x: [2, 4, 8]", "E004", "contracts 6 (from A: [2, 3, 16]) with 8"),)),
    Case("matmul", "a: [8, 4], b: [8, 16]", "(a, b) -> matmul(transpose=TN) -> c", "c: [4, 16]"),
    Case("matmul", "a: [8, 4], b: [16, 8]", "(a, b) -> matmul(transpose=TT) -> c", "c: [4, 16]",
         (B("b: [16, 8]", "b: [8, 16]", "E004", "`matmul(transpose=TT)` contracts 8",
            help="`transpose=TN` gives [4, 16]"),)),
    Case("matmul", "a: [2, 3, 4], b: [5, 6]", "(a, b) -> matmul(transpose=TT) -> c", "c: [4, 5]"),
    Case("matmul", "x: [2, 3, 8], w: [16, 8]",
         "(x, w) -> matmul(transpose=NT, alpha=0.5, beta=0.0) -> y", "y: [2, 3, 16]",
         (B("alpha=0.5", "alpha=true", "E003", "parameter `alpha` of `matmul` must be a number"),)),
    # ------------------------------------------------------------------ batched_matmul
    Case("batched_matmul", "a: [2, 4, 3, 8], b: [2, 4, 8, 5]", "(a, b) -> batched_matmul() -> c",
         "c: [2, 4, 3, 5]",
         (B("b: [2, 4, 8, 5]", "b: [2, 3, 8, 5]", "E004", "batch dims [2, 4] and [2, 3] differ"),
          B("b: [2, 4, 8, 5]", "b: [2, 4, 7, 5]", "E004", "contracts 8 with 7"))),
    Case("batched_matmul", "q: [2, 4, 6, 8], k: [2, 4, 6, 8]",
         "(q, k) -> batched_matmul(transpose=NT) -> s", "s: [2, 4, 6, 6]"),
    Case("batched_matmul", "a: [2, 4, 3, 8], w: [8, 5]", "(a, w) -> batched_matmul() -> c",
         "c: [2, 4, 3, 5]",  # a 2-D B broadcasts over A's batch dims
         (B("w: [8, 5]", "w: [4, 8, 5]", "E004", "batch dims [2, 4] and [4] differ"),)),
    Case("batched_matmul", "a: [2, 8, 3], b: [2, 8, 5]",
         "(a, b) -> batched_matmul(transpose=TN) -> c", "c: [2, 3, 5]"),
    Case("batched_matmul", "a: [2, 8, 3], b: [2, 5, 8]",
         "(a, b) -> batched_matmul(transpose=TT) -> c", "c: [2, 3, 5]"),
    # ------------------------------------------------------------------ attention
    Case("flash_attention", f"{Q}, {KV}", "(q, k, v) -> flash_attention(causal=true) -> (o, lse)",
         "o: [2, 8, 16, 32], lse: [2, 8, 16, fp32]",
         (B("k: [2, 2, 16, 32]", "k: [2, 3, 16, 32]", "E004", "`v` has shape [2, 2, 16, 32]"),
          B(KV, "v: [2, 3, 16, 32]", "E004", "`v` has shape [2, 3, 16, 32]"),
          B(f"{Q}, {KV}", "q: [2, 8, 16, 32], k: [2, 3, 16, 32], v: [2, 3, 16, 32]", "E004",
            "8 query heads are not a multiple of 3 key/value heads"),
          B("q: [2, 8, 16, 32]", "q: [2, 8, 16, 64]", "E004", "`k` has shape [2, 2, 16, 32]"),
          B("-> (o, lse)", "-> (o, lse, x)", "E003", "returns 2 tensor(s), the destination"))),
    Case("flash_attention", f"{Q}, {KV}, slopes: [8, fp32]",
         "(q, k, v, slopes) -> flash_attention(causal=true, window_size=4) -> (o, lse)",
         "o: [2, 8, 16, 32], lse: [2, 8, 16, fp32]",
         (B("slopes: [8, fp32]", "slopes: [2, fp32]", "E004", "`alibi_slopes` has shape [2"),)),
    Case("rope", f"{Q}, pos: [2, 16, int32]",
         "(q, k, pos) -> rope(theta=500000.0) -> (q_rot, k_rot)",
         "q_rot: [2, 8, 16, 32], k_rot: [2, 2, 16, 32]",
         (B("pos: [2, 16, int32]", "pos: [2, 16]", "E015", "`position_ids` must be int32"),
          B("pos: [2, 16, int32]", "pos: [2, 15, int32]", "E004", "`position_ids` has shape"),
          B(Q, "q: [2, 8, 16, 5], k: [2, 2, 16, 5]", "E004", "rotates pairs of the head dim"))),
    Case("rope", Q, "(q, k) -> rope() -> (q_rot, k_rot)",
         "q_rot: [2, 8, 16, 32], k_rot: [2, 2, 16, 32]"),
    Case("qk_norm", f"{Q}, qw: [32], kw: [32]",
         "(q, k, qw, kw) -> qk_norm(eps=1e-6) -> (qn, kn, q_rstd, k_rstd)",
         "qn: [2, 8, 16, 32], kn: [2, 2, 16, 32], q_rstd: [2, 8, 16, fp32], "
         "k_rstd: [2, 2, 16, fp32]",
         (B("qw: [32]", "qw: [16]", "E004", "`q_weight` has shape [16]"),)),
    Case("qk_norm_rope", f"{Q}, qw: [32], kw: [32], pos: [2, 16, int32]",
         "(q, k, qw, kw, pos) -> qk_norm_rope(eps=1e-6, theta=1e6) -> (qr, kr, q_rstd, k_rstd)",
         "qr: [2, 8, 16, 32], kr: [2, 2, 16, 32], q_rstd: [2, 8, 16, fp32], "
         "k_rstd: [2, 2, 16, fp32]",
         (B("kw: [32]", "kw: [16]", "E004", "`k_weight` has shape [16]"),
          B("pos: [2, 16, int32]", "pos: [2, 16]", "E015", "`position_ids` must be int32"),
          B("q: [2, 8, 16, 32], k: [2, 2, 16, 32], qw: [32], kw: [32]",
            "q: [2, 8, 16, 5], k: [2, 2, 16, 5], qw: [5], kw: [5]", "E004",
            "`qk_norm_rope` rotates pairs of the head dim"))),
    Case("qk_norm_rope", "q: [2, 8, 16, 32, bf16], k: [2, 2, 16, 32, bf16], qw: [32, bf16], "
         "kw: [32, bf16]",
         "(q, k, qw, kw) -> qk_norm_rope() -> (qr, kr, q_rstd, k_rstd)",
         "qr: [2, 8, 16, 32, bf16], kr: [2, 2, 16, 32, bf16], q_rstd: [2, 8, 16, fp32], "
         "k_rstd: [2, 2, 16, fp32]"),
    # ------------------------------------------------------------------ norms
    Case("rmsnorm", "x: [2, 3, 8], w: [8]", "(x, w) -> rmsnorm(eps=1e-5) -> (y, rstd)",
         "y: [2, 3, 8], rstd: [2, 3, fp32]",
         (B("w: [8]", "w: [7]", "E004", "`weight` has shape [7], expected [8]"),
          B("x: [2, 3, 8]", "x: [2, 3, 8, int32]", "E015", f"`x` {NOT_FLOAT}"),
          B("eps=1e-5", "eps=true", "E003", "parameter `eps` of `rmsnorm` must be a number"))),
    Case("rmsnorm", "x: [2, 3, 8, bf16], w: [8, bf16]", "(x, w) -> rmsnorm() -> (y, rstd)",
         "y: [2, 3, 8, bf16], rstd: [2, 3, fp32]"),
    Case("fused_residual_rmsnorm", "r: [2, 3, 8], x: [2, 3, 8], w: [8]",
         "(r, x, w) -> fused_residual_rmsnorm() -> (r_out, y, rstd)",
         "r_out: [2, 3, 8], y: [2, 3, 8], rstd: [2, 3, fp32]",
         (B("x: [2, 3, 8]", "x: [2, 4, 8]", "E004", "leading dims do not match [2, 3]"),)),
    Case("layernorm", "x: [2, 3, 8], w: [8], b: [8]",
         "(x, w, b) -> layernorm(eps=1e-5) -> (y, mean, rstd)",
         "y: [2, 3, 8], mean: [2, 3, fp32], rstd: [2, 3, fp32]",
         (B("b: [8]", "b: [7]", "E004", "`bias` has shape [7]"),)),
    Case("layernorm", "x: [4, 8], w: [8]", "(x, w) -> layernorm() -> (y, mean, rstd)",
         "y: [4, 8], mean: [4, fp32], rstd: [4, fp32]"),
    Case("fused_residual_layernorm", "r: [2, 3, 8], x: [2, 3, 8], w: [8], b: [8]",
         "(r, x, w, b) -> fused_residual_layernorm() -> (r_out, y, mean, rstd)",
         "r_out: [2, 3, 8], y: [2, 3, 8], mean: [2, 3, fp32], rstd: [2, 3, fp32]",
         (B("x: [2, 3, 8]", "x: [2, 4, 8]", "E004", "leading dims do not match [2, 3]"),)),
    Case("group_rmsnorm", "x: [2, 3, 16], w: [16], z: [2, 3, 16]",
         "(x, w, z) -> group_rmsnorm(groups=4) -> (y, rstd)",
         "y: [2, 3, 16], rstd: [2, 3, 4, fp32]",
         (B("groups=4", "groups=5", "E004", "16 channels do not split into 5 groups"),
          B("z: [2, 3, 16]", "z: [2, 3, 8]", "E004", "`gate` has shape [2, 3, 8]"))),
    Case("group_rmsnorm", "x: [6, 16], w: [16]", "(x, w) -> group_rmsnorm() -> (y, rstd)",
         "y: [6, 16], rstd: [6, 1, fp32]"),
    # ------------------------------------------------------------------ activations
    Case("swiglu", "g: [2, 3, 16], u: [2, 3, 16]", "(g, u) -> swiglu() -> y", "y: [2, 3, 16]",
         (B("u: [2, 3, 16]", "u: [2, 3, 8]", "E004", "`up` has shape [2, 3, 8]"),
          B("g: [2, 3, 16]", "g: [2, 3, 16, int32]", "E015", f"`gate` {NOT_FLOAT}"))),
    Case("geglu", "g: [6, 16], u: [6, 16]", "(g, u) -> geglu(approximate=false) -> y", "y: [6, 16]",
         (B("u: [6, 16]", "u: [5, 16]", "E004", "leading dims do not match [6]"),)),
    Case("gelu", "x: [2, 3, 8]", "x -> gelu(approximate=true) -> y", "y: [2, 3, 8]",
         (B("x: [2, 3, 8]", "x: [2, 3, 8, int32]", "E015", "`gelu` needs a floating tensor"),)),
    Case("silu", "x: [2, 3, 8, bf16]", "x -> silu() -> y", "y: [2, 3, 8, bf16]",
         (B("x: [2, 3, 8, bf16]", "x: [2, 3, 8, int32]", "E015", "`silu` needs a floating"),)),
    Case("relu", "x: [2, 3, 8]", "x -> relu() -> y", "y: [2, 3, 8]",
         (B("x: [2, 3, 8]", "x: [2, 3, 8, int32]", "E015", "`relu` needs a floating tensor"),)),
    Case("relu2", "x: [2, 3, 8]", "x -> relu2() -> y", "y: [2, 3, 8]",
         (B("x: [2, 3, 8]", "x: [2, 3, 8, int32]", "E015", "`relu2` needs a floating tensor"),)),
    Case("sigmoid", "x: [6, 4]", "x -> sigmoid() -> y", "y: [6, 4]",
         (B("x: [6, 4]", "x: [6, 4, int32]", "E015", "`sigmoid` needs a floating tensor"),)),
    Case("exp", "x: [6, 4]", "x -> exp() -> y", "y: [6, 4]",
         (B("x: [6, 4]", "x: [6, 4, int32]", "E015", "`exp` needs a floating tensor"),)),
    Case("neg", "x: [6, 4, fp32]", "x -> neg() -> y", "y: [6, 4, fp32]",
         (B("x: [6, 4, fp32]", "x: [6, 4, int32]", "E015", "`neg` needs a floating tensor"),)),
    Case("exp_neg", "a_log: [16, 4, fp32]", "a_log -> exp_neg() -> a", "a: [16, 4, fp32]",
         (B("a_log: [16, 4, fp32]", "a_log: [16, 4, int32]", "E015", "`exp_neg` needs a float"),)),
    Case("scale", "x: [2, 3, 8]", "x -> scale(0.125) -> y", "y: [2, 3, 8]",
         (B("scale(0.125)", "scale()", "E003", "`scale` needs its parameter `factor`"),)),
    Case("softmax", "x: [2, 4, 6, 6]", "x -> softmax(dim=-1) -> p", "p: [2, 4, 6, 6]",
         (B("dim=-1", "dim=4", "E004", "`dim=4` is out of range for a tensor of rank 4"),
          B("x: [2, 4, 6, 6]", "x: [2, 4, 6, 6, int32]", "E015", "`softmax` needs a floating"))),
    # ------------------------------------------------------------------ elementwise
    Case("add", "x: [2, 3, 8], b: [8]", "(x, b) -> add() -> y", "y: [2, 3, 8]",
         (B("b: [8]", "b: [7]", "E004", "do not broadcast: 8 vs 7"),
          B("b: [8]", "b: [8, int32]", "E015", "`add` needs floating tensors; `b` is int32"))),
    Case("add", "x: [2, 1, 8], b: [3, 1]", "(x, b) -> add() -> y", "y: [2, 3, 8]"),
    Case("mul", "x: [2, 3, 8], m: [2, 3, 1]", "(x, m) -> mul() -> y", "y: [2, 3, 8]",
         (B("m: [2, 3, 1]", "m: [2, 4, 1]", "E004", "do not broadcast: 3 vs 4"),)),
    Case("add3", "a: [2, 3, 8], b: [2, 3, 8], c: [2, 3, 8]", "(a, b, c) -> add3() -> y",
         "y: [2, 3, 8]",
         (B("c: [2, 3, 8]", "c: [8]", "E004", "`add3` adds tensors of one shape"),
          B("b: [2, 3, 8]", "b: [2, 3, 9]", "E004", "`add3` adds tensors of one shape"))),
    # ------------------------------------------------------------------ views and copies
    Case("view", "x: [2, 3, 8]", "x -> view([6, -1]) -> y", "y: [6, 8]",
         (B("[6, -1]", "[5, 8]", "E004", "`view` to [5, 8] changes the element count"),
          B("[6, -1]", "[5, -1]", "E004", "changes the element count"),
          B("[6, -1]", "[-1, -1]", "E004", "`view` can infer at most one dim"),
          B("[6, -1]", "[-2, -24]", "E004", "`view` dims are sizes, or -1"),
          B("[6, -1]", "[0, -1]", "E004", "cannot infer the -1 dim next to a 0 dim"))),
    Case("view", "x: [2, 3, 8]", "x -> view(shape=[2, 3, 2, 4]) -> y", "y: [2, 3, 2, 4]"),
    Case("transpose", "x: [2, 3, 8]", "x -> transpose(1, 2) -> y", "y: [2, 8, 3]",
         (B("transpose(1, 2)", "transpose(1, 3)", "E004", "`dim1=3` is out of range"),
          B("transpose(1, 2)", "transpose(1)", "E003", "needs its parameter `dim1`"))),
    Case("transpose", "x: [2, 3, 4, 8]", "x -> transpose(dim0=-3, dim1=-1) -> y",
         "y: [2, 8, 4, 3]"),
    Case("permute", "x: [2, 3, 8]", "x -> permute([0, 2, 1]) -> y", "y: [2, 8, 3]",
         (B("[0, 2, 1]", "[0, 1, 1]", "E004", "is not a permutation of the 3 dims"),
          B("[0, 2, 1]", "[1, 0]", "E004", "is not a permutation of the 3 dims"))),
    Case("contiguous", "x: [2, 3, 8]", "x -> transpose(0, 1) -> contiguous() -> y",
         "y: [3, 2, 8]",
         (B("-> y", "-> (y, z)", "E003", "returns 1 tensor(s), the destination names 2"),)),
    Case("copy", "x: [2, 3, 8, int32]", "x -> copy() -> y", "y: [2, 3, 8, int32]"),
    Case("select", "x: [2, 3, 8]", "x -> select(dim=1, index=-1) -> y", "y: [2, 8]",
         (B("index=-1", "index=3", "E004", "index 3 is out of range for dim 1 of size 3"),)),
    Case("slice", "x: [2, 3, 8]", "x -> slice(dim=2, start=-3) -> y", "y: [2, 3, 3]",
         (B("dim=2", "dim=3", "E004", "`dim=3` is out of range for a tensor of rank 3"),)),
    Case("slice", "x: [2, T, 8]", "x -> slice(dim=1, start=1, end=-1) -> y",
         "y: [2, T - 2, 8]",
         (B("start=1, end=-1", "start=-2, end=4", "E004", "is not known at compile time"),)),
    Case("dropout", "x: [2, 3, 8]", "x -> dropout(p=0.1) -> (y, mask)",
         "y: [2, 3, 8], mask: [2, 3, 8]",
         (B("p=0.1", "p=1.5", "E003", "`p` of `dropout` is a probability below 1"),)),
    Case("stop_gradient", "x: [2, 3, 8]", "x -> stop_gradient() -> y", "y: [2, 3, 8]"),
    Case("scale_gradient", "x: [2, 3, 8]", "x -> scale_gradient(scale=0.5, clip=1.0) -> y",
         "y: [2, 3, 8]",
         (B("scale=0.5", "scale=true", "E003", "`scale`"),)),
    Case("cast", "x: [2, 3, 8, bf16]", "x -> cast(dtype=fp32) -> y", "y: [2, 3, 8, fp32]",
         (B("dtype=fp32", "dtype=fp33", "E003", "`dtype` of `cast` must be a dtype"),)),
    Case("tp_copy", "x: [2, 3, 8]", "x -> tp_copy(size=2) -> y", "y: [2, 3, 8]",
         (B("tp_copy(size=2)", "tp_copy()", "E003", "`tp_copy` needs its parameter `size`"),)),
    Case("tp_all_reduce", "x: [2, 3, 8]", "x -> tp_all_reduce(size=2) -> y", "y: [2, 3, 8]",
         (B("size=2", "size=2, group=3", "E003", "parameter `group` of `tp_all_reduce`"),)),
    Case("sp_all_gather", "x: [2, 3, 8]", "x -> sp_all_gather(size=2) -> y", "y: [2, 6, 8]",
         (B("size=2", "size=2, dim=3", "E004", "`dim=3` is out of range"),)),
    Case("sp_gather", "x: [2, 3, 8]", "x -> sp_gather(size=4, dim=-1) -> y", "y: [2, 3, 32]",
         (B("size=4, dim=-1", "dim=-1", "E003", "`sp_gather` needs its parameter `size`"),)),
    Case("sp_reduce_scatter", "x: [2, 6, 8]", "x -> sp_reduce_scatter(size=2) -> y",
         "y: [2, 3, 8]",
         (B("[2, 6, 8]", "[2, 7, 8]", "E027", "dim 1 of [2, 7, 8] (7) is not divisible by "
            "the tensor-parallel size 2"),)),
    Case("sp_scatter", "x: [2, 6, 8]", "x -> sp_scatter(size=3) -> y", "y: [2, 2, 8]",
         (B("size=3", "size=4", "E027", "is not divisible by the tensor-parallel size 4"),)),
    Case("split", "x: [2, 3, 24]", "x -> split([8, 8, 8]) -> (a, b, c)",
         "a: [2, 3, 8], b: [2, 3, 8], c: [2, 3, 8]",
         (B("[8, 8, 8]", "[8, 8, 4]", "E004", "`split` sizes add up to 20, but dim 2"),
          B("-> (a, b, c)", "-> (a, b, c, d)", "E003", "returns 3 tensor(s), the destination"))),
    Case("split", "x: [2, 3, 24]", "x -> split(sizes=[1, 2], dim=1) -> (a, b)",
         "a: [2, 1, 24], b: [2, 2, 24]"),
    Case("concat", "a: [2, 3, 8]", "a -> concat(dim=-1) -> y", "y: [2, 3, 8]"),
    Case("concat", "a: [2, 3, 8], b: [2, 3, 4]", "(a, b) -> concat(dim=-1) -> y", "y: [2, 3, 12]",
         (B("b: [2, 3, 4]", "b: [2, 5, 4]", "E004", "does not match [2, 3, 8] in the other"),)),
    Case("block_diag", "a: [4, 2], b: [3, 1]", "(a, b) -> block_diag() -> y", "y: [7, 3]",
         (B("b: [3, 1]", "b: [3, 1, 1]", "E004", "lays matrices along a diagonal; input 1"),
          B("block_diag()", "block_diag(zero_rows=[1, 2])", "E004",
            "has 2 entries: one before, between and after the 2 matrices makes 3"))),
    Case("block_diag", "a: [4, 2], b: [3, 1]", "(a, b) -> block_diag(zero_rows=[0, 5, 1]) -> y",
         "y: [13, 3]"),
    # ------------------------------------------------------------------ reductions
    Case("reduce_sum", "x: [2, 3, 8]", "x -> reduce_sum(dims=[-1]) -> y", "y: [2, 3]",
         (B("dims=[-1]", "dims=[3]", "E004", "`dims=3` is out of range for a tensor of rank 3"),)),
    Case("reduce_sum", "x: [2, 3, fp32]", "x -> reduce_sum(dims=[0, 1]) -> y", "y: [fp32]"),
    Case("reduce_sum", "x: [2, 3, 8]", "x -> reduce_sum(dims=[0, 2], keepdim=true) -> y",
         "y: [1, 3, 1]",
         (B("dims=[0, 2]", "dims=[0, -3]", "E004", "names a dim of [2, 3, 8] twice"),)),
    Case("reduce_mean", "x: [2, 3, 8]", "x -> reduce_mean(dims=[1], keepdim=true) -> y",
         "y: [2, 1, 8]",
         (B("keepdim=true", "keepdim=1", "E003", "`keepdim` of `reduce_mean` must be a boolean"),)),
    Case("reduce_max", "x: [2, 3, 8]", "x -> reduce_max(dim=-1) -> (v, i)",
         "v: [2, 3], i: [2, 3, int32]",
         (B("dim=-1", "dim=-4", "E004", "`dim=-4` is out of range"),)),
    Case("reduce_max", "x: [2, 3, 8]", "x -> reduce_max(dim=1, keepdim=true) -> (v, i)",
         "v: [2, 1, 8], i: [2, 1, 8, int32]"),
    # ------------------------------------------------------------------ constructors
    Case("zeros", "", "() -> zeros(shape=[2, 3], dtype=fp32) -> z", "z: [2, 3, fp32]",
         (B("dtype=fp32", "dtype=float64", "E003", "parameter `dtype` of `zeros` must be a dtype"),
          B("shape=[2, 3]", "shape=[2, -1]", "E003", "`zeros(shape=[2, -1])` has a negative dim"))),
    Case("zeros", "", "() -> zeros(shape=[]) -> z", "z: [bf16]"),
    Case("ones", "", "() -> ones(shape=[4, 2], dtype=fp32) -> m", "m: [4, 2, fp32]",
         (B("shape=[4, 2], ", "", "E003", "`ones` needs its parameter `shape`"),)),
    Case("fill", "", "() -> fill(shape=[2, 3], value=-1.0, dtype=fp32) -> f",
         "f: [2, 3, fp32]",
         (B("value=-1.0, ", "", "E003", "`fill` needs its parameter `value`"),)),
    # ------------------------------------------------------------------ embedding, loss
    Case("embedding", "ids: [2, 3, int32], w: [100, 8]", "(ids, w) -> embedding() -> y",
         "y: [2, 3, 8]",
         (B("ids: [2, 3, int32]", "ids: [2, 3]", "E015", "`indices` must be int32, found float"),
          B("w: [100, 8]", "w: [100, 8, int32]", "E015", f"`weight` {NOT_FLOAT}"))),
    Case("cross_entropy", "logits: [2, 3, 100], labels: [2, 3, int32]",
         "(logits, labels) -> cross_entropy(ignore_index=-100) -> (loss, lse)",
         "loss: [2, 3, fp32], lse: [2, 3, fp32]",
         (B("labels: [2, 3, int32]", "labels: [2, 4, int32]", "E004", "leading dims do not match"),
          B("labels: [2, 3, int32]", "labels: [2, 3]", "E015", "`labels` must be int32"))),
    Case("vocab_parallel_embedding", "ids: [2, 3, int32], w: [50, 8]",
         "(ids, w) -> vocab_parallel_embedding(size=2) -> y", "y: [2, 3, 8]",
         (B("size=2", "", "E003", "`vocab_parallel_embedding` needs its parameter `size`"),
          B("ids: [2, 3, int32]", "ids: [2, 3]", "E015", "`indices` must be int32"))),
    Case("vocab_parallel_cross_entropy", "logits: [2, 3, 50], labels: [2, 3, int32]",
         "(logits, labels) -> vocab_parallel_cross_entropy(size=2) -> (loss, lse)",
         "loss: [2, 3, fp32], lse: [2, 3, fp32]",
         (B("labels: [2, 3, int32]", "labels: [2, 4, int32]", "E004", "leading dims do not match"),)),
    # ------------------------------------------------------------------ mixture of experts
    Case("moe_router", "x: [6, 8], gate: [4, 8]",
         "(x, gate) -> moe_router(top_k=2) -> (weights, idx, stats)",
         "weights: [6, 2], idx: [6, 2, int32], stats: [2, 4, fp32]",
         (B("gate: [4, 8]", "gate: [4, 7]", "E004", "`gate` has shape [4, 7]"),
          B("top_k=2", "top_k=5", "E004", "cannot pick top_k=5 of 4 experts"),
          B("moe_router(top_k=2)", "moe_router()", "E003", "needs its parameter `top_k`"))),
    Case("moe_compute_offsets", "idx: [6, 2, int32]",
         "idx -> moe_compute_offsets(num_experts=4) -> offsets", "offsets: [5, int32]",
         (B("idx: [6, 2, int32]", "idx: [6, 2]", "E015", "`indices` must be int32"),)),
    Case("moe_permute", "x: [6, 8], idx: [6, 2, int32], offsets: [5, int32]",
         "(x, idx, offsets) -> moe_permute() -> (permuted, scatter)",
         "permuted: [12, 8], scatter: [12, int32]",
         (B("idx: [6, 2, int32]", "idx: [5, 2, int32]", "E004", "`indices` has shape [5, 2"),
          B("offsets: [5, int32]", "offsets: [5]", "E015", "`expert_offsets` must be int32"))),
    Case("moe_unpermute", "out: [12, 8], weights: [6, 2], scatter: [12, int32]",
         "(out, weights, scatter) -> moe_unpermute() -> combined", "combined: [6, 8]",
         (B("out: [12, 8]", "out: [10, 8]", "E004", "has shape [10, 8], expected [12, 8]"),)),
    Case("grouped_gemm", "x: [12, 8], w: [4, 16, 8], offsets: [5, int32]",
         "(x, w, offsets) -> grouped_gemm() -> y", "y: [12, 16]",  # NT: weights [G, N, K]
         (B("offsets: [5, int32]", "offsets: [4, int32]", "E004",
            "offsets must have groups + 1 = 5 entries"),
          B("offsets: [5, int32]", "offsets: [5]", "E015", "`offsets` must be int32"),
          B("w: [4, 16, 8]", "w: [4, 8, 16]", "E004", "grouped_gemm contracts 8 (input) with 16",
            help="[groups, K, N] use NN"),
          B("grouped_gemm()", "grouped_gemm(transpose=TN)", "E003", "must be one of NN, NT"))),
    Case("grouped_gemm", "x: [12, 8], w: [4, 8, 16], offsets: [5, int32]",
         "(x, w, offsets) -> grouped_gemm(transpose=NN) -> y", "y: [12, 16]"),
    # ------------------------------------------------------------------ Mamba
    Case("mamba_conv1d", "x: [2, 16, 10], w: [16, 1, 4], b: [16]",
         "(x, w, b) -> mamba_conv1d(kernel_size=4) -> (y, state)",
         "y: [2, 16, 10], state: [2, 16, 3]",
         (B("kernel_size=4", "kernel_size=3", "E004", "`weight` has shape [16, 1, 4]"),
          B("b: [16]", "b: [8]", "E004", "`bias` has shape [8]"))),
    Case("mamba_conv1d", "x: [2, 16, 10], w: [16, 1, 3], b: [16], s: [2, 16, 2]",
         "(x, w, b, s) -> mamba_conv1d(kernel_size=3, activation=none) -> (y, state)",
         "y: [2, 16, 10], state: [2, 16, 2]",
         (B("s: [2, 16, 2]", "s: [2, 16, 3]", "E004", "`conv_state` has shape [2, 16, 3]"),
          B("activation=none", "activation=relu", "E003", "must be one of silu, none"))),
    Case("mamba_selective_scan",
         "u: [2, 16, 10], dt: [2, 16, 10], a: [16, 4], bm: [2, 2, 4, 10], cm: [2, 2, 4, 10], "
         "d: [16], dt_bias: [16]",
         "(u, dt, a, bm, cm, d, dt_bias) -> mamba_selective_scan() -> (y, state)",
         "y: [2, 16, 10], state: [2, 16, 4]",
         (B("a: [16, 4]", "a: [16, 5]", "E004", "`B` has shape [2, 2, 4, 10]"),
          B("dt: [2, 16, 10]", "dt: [2, 16, 9]", "E004", "`delta` has shape [2, 16, 9]"),
          B("bm: [2, 2, 4, 10], cm: [2, 2, 4, 10]", "bm: [2, 3, 4, 10], cm: [2, 3, 4, 10]",
            "E004", "16 channels do not split into 3 groups"))),
    # ------------------------------------------------------------------ backward calls
    # `<op>_backward` is checked against the backward signature (NN mode for matmul)
    Case("rmsnorm_backward",
         "d_y: [2, 3, 8, bf16], x: [2, 3, 8, bf16], w: [8, bf16], rstd: [2, 3, fp32]",
         "(d_y, x, w, rstd) -> rmsnorm_backward() -> (d_x, d_w)",
         "d_x: [2, 3, 8, bf16], d_w: [8, bf16]",
         (B("w: [8, bf16]", "w: [7, bf16]", "E004", "`weight` has shape [7, bf16]"),
          B("rstd: [2, 3, fp32]", "rstd: [2, 4, fp32]", "E004", "leading dims do not match"))),
    # (d_gate, d_up, y): y is the forward's output, returned by the backward's pass
    Case("swiglu_backward", "d_y: [2, 3, 16], g: [2, 3, 16], u: [2, 3, 16]",
         "(d_y, g, u) -> swiglu_backward() -> (d_g, d_u, h)",
         "d_g: [2, 3, 16], d_u: [2, 3, 16], h: [2, 3, 16]",
         (B("-> (d_g, d_u, h)", "-> (d_g, d_u, h, e)", "E003", "returns 3 tensor(s), the destination"),
          B("u: [2, 3, 16]", "u: [2, 3, 15]", "E004", "`up` has shape [2, 3, 15]"))),
    Case("geglu_backward", "d_y: [6, 16, bf16], g: [6, 16, bf16], u: [6, 16, bf16]",
         "(d_y, g, u) -> geglu_backward(approximate=false) -> (d_g, d_u, h)",
         "d_g: [6, 16, bf16], d_u: [6, 16, bf16], h: [6, 16, bf16]",
         (B("g: [6, 16, bf16]", "g: [6, 8, bf16]", "E004", "`gate` has shape [6, 8, bf16]"),)),
    Case("matmul_backward", "d_y: [2, 3, 16], x: [2, 3, 8], w: [8, 16]",
         "(d_y, x, w) -> matmul_backward() -> (d_x, d_w)", "d_x: [2, 3, 8], d_w: [8, 16]",
         (B("w: [8, 16]", "w: [8, 15]", "E004", "`B` has shape [8, 15]"),)),
    Case("qk_norm_rope_backward",
         "d_qr: [2, 8, 16, 32], d_kr: [2, 2, 16, 32], q: [2, 8, 16, 32], k: [2, 2, 16, 32], "
         "qw: [32], kw: [32], q_rstd: [2, 8, 16, fp32], k_rstd: [2, 2, 16, fp32]",
         "(d_qr, d_kr, q, k, qw, kw, q_rstd, k_rstd) -> qk_norm_rope_backward(theta=1e6) "
         "-> (d_q, d_k, d_qw, d_kw)",
         "d_q: [2, 8, 16, 32], d_k: [2, 2, 16, 32], d_qw: [32], d_kw: [32]"),
    Case("flash_attention_backward",
         "d_o: [2, 8, 16, 32, bf16], q: [2, 8, 16, 32, bf16], k: [2, 2, 16, 32, bf16], "
         "v: [2, 2, 16, 32, bf16], o: [2, 8, 16, 32, bf16], lse: [2, 8, 16, fp32]",
         "(d_o, q, k, v, o, lse) -> flash_attention_backward() -> (d_q, d_k, d_v)",
         "d_q: [2, 8, 16, 32, bf16], d_k: [2, 2, 16, 32, bf16], d_v: [2, 2, 16, 32, bf16]"),
    # ------------------------------------------------------------------ known checker bugs
    Case("rmsnorm_backward", "d_y: [2, 3, 8], x: [2, 3, 8], w: [8], rstd: [2, 3, fp32]",
         "(d_y, x, w, rstd) -> rmsnorm_backward() -> (d_x, d_w)", "d_x: [2, 3, 8], d_w: [8]"),
    Case("matmul_backward", "d_y: [2, 3, 16], x: [2, 3, 8], w: [16, 8]",
         "(d_y, x, w) -> matmul_backward(transpose=NT) -> (d_x, d_w)",
         "d_x: [2, 3, 8], d_w: [16, 8]"),
]


def _marks(case: Case) -> list:
    return [pytest.mark.xfail(reason=case.xfail, strict=True)] if case.xfail else []


def _variants() -> list:
    return [pytest.param(case, id=f"{case.op}-{index}", marks=_marks(case))
            for index, case in enumerate(CASES)]


def _broken() -> list:
    return [pytest.param(case, broken, id=f"{case.op}-{index}-broken{number}",
                         marks=_marks(case))
            for index, case in enumerate(CASES) for number, broken in enumerate(case.broken)]


def _check(text: str):
    result = parse_text(text, "T.module")
    assert result.program is not None and not list(result.diagnostics), text
    instances: list = []
    return check_program(result.program, checked=instances), instances


def _show(diagnostics) -> str:
    return "\n".join(f"{d.code}: {d.message} | help: {list(d.help)}" for d in diagnostics)


@pytest.mark.parametrize("case", _variants())
def test_case_checks_with_the_declared_types(case: Case):
    diagnostics, instances = _check(case.program)
    assert not diagnostics, f"{case.program}\n{_show(diagnostics)}"
    (instance,) = instances
    computed = {name: t for phase, name, t, _ in instance.inferred if phase == "forward"}
    for sig in instance.definition.forward.outputs:
        expected = declared_type(instance, sig, sig.span)
        assert str(computed[sig.name]) == str(expected), \
            f"{case.flow}: `{sig.name}` is {computed[sig.name]}, expected {expected}"


@pytest.mark.parametrize("case, broken", _broken())
def test_broken_variant_is_reported(case: Case, broken: Break):
    text = case.broken_program(broken)
    diagnostics, _ = _check(text)
    assert len(diagnostics) == 1, f"{text}\n{_show(diagnostics)}"
    (found,) = diagnostics
    assert found.code == broken.code, _show(diagnostics)
    assert broken.message in found.message, _show(diagnostics)
    if broken.help is not None:
        assert any(broken.help in line for line in found.help), _show(diagnostics)


def test_every_primitive_has_a_case():
    covered = {case.op.removesuffix("_backward") for case in CASES if not case.xfail}
    missing = sorted(set(op_table()) - covered)
    assert not missing, f"primitives without a case in CASES: {missing}"
    unknown = sorted({case.op.removesuffix("_backward") for case in CASES} - set(op_table()))
    assert not unknown, f"cases of unknown primitives: {unknown}"


NOTHING_TO_BREAK = {"copy", "stop_gradient"}  # any tensor, any dtype, and no parameters


def test_every_primitive_has_a_broken_variant():
    with_broken = {case.op.removesuffix("_backward") for case in CASES if case.broken}
    missing = sorted(set(op_table()) - with_broken - NOTHING_TO_BREAK)
    assert not missing, f"primitives without a broken variant in CASES: {missing}"
