"""The CUDA kernels (csrc/kernels, runtime/cuda): every .cu compiles with nvcc (no GPU
needed), every primitive has a GPU implementation, and on a GPU (`-m cuda`) each custom
kernel matches the reference kernel (runtime/kernels) forward and backward, in fp32 and
bf16, on shapes that take the vector path, the scalar path and rows longer than the
register cache."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kernel_testing import assert_close

torch = pytest.importorskip("torch")

from runtime.cuda.kernels import CUDA_KERNELS, CUSTOM, CudaKernel  # noqa: E402
from runtime.kernels import KERNELS  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CU_FILES = sorted((ROOT / "csrc" / "kernels").glob("*.cu"))

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]


# ------------------------------------------------------------------ without a GPU
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_kernels_compile(tmp_path):
    """Each kernel file compiles alone for Hopper (one nvcc per file, in parallel), for the
    one target the extension is built for on Hopper (runtime/cuda/build.py: torch turns
    TORCH_CUDA_ARCH_LIST=9.0a into this -gencode). `-arch=sm_90a` also ran the front end a
    second time for a compute_90 PTX the build never makes: a third of the time."""
    assert CU_FILES, "no csrc/kernels/*.cu"

    def compile_one(cu: Path):
        cmd = ["nvcc", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-c", str(cu),
               "-o", str(tmp_path / f"{cu.stem}.o")]
        return cu.name, subprocess.run(cmd, capture_output=True, text=True)

    with ThreadPoolExecutor() as pool:
        for name, done in pool.map(compile_one, CU_FILES):
            assert done.returncode == 0, f"{name}:\n{done.stderr}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_kernel_harnesses_compile(tmp_path):
    """The standalone kernel harnesses (benchmarks/kernels/*.cu: each includes a kernel
    file and calls its launchers, so a launcher's new argument breaks it) compile for
    Hopper, as their headers say to build them (cross_entropy_ab.cu: against the current
    csrc/kernels/cross_entropy.cu)."""
    harnesses = sorted((ROOT / "benchmarks" / "kernels").glob("*.cu"))
    assert harnesses, "no benchmarks/kernels/*.cu"
    ce_file = ROOT / "csrc" / "kernels" / "cross_entropy.cu"

    def compile_one(cu: Path):
        cmd = ["nvcc", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
               f"-I{ROOT / 'csrc' / 'kernels'}", f'-DCE_FILE="{ce_file}"', "-c", str(cu),
               "-o", str(tmp_path / f"{cu.stem}.o")]
        return cu.name, subprocess.run(cmd, capture_output=True, text=True)

    with ThreadPoolExecutor() as pool:
        for name, done in pool.map(compile_one, harnesses):
            assert done.returncode == 0, f"{name}:\n{done.stderr}"


def test_every_primitive_has_a_gpu_kernel():
    assert set(CUDA_KERNELS) == set(KERNELS)
    assert set(CUSTOM) <= set(KERNELS)
    for name in CUSTOM:
        assert isinstance(CUDA_KERNELS[name], CudaKernel)
        assert CUDA_KERNELS[name].forward_inputs == KERNELS[name].forward_inputs
    # the routing gathers, the sync-free counts and the grouped GEMM (runtime/cuda/moe.py)
    for name in ("moe_permute", "moe_unpermute", "moe_router", "moe_compute_offsets",
                 "grouped_gemm"):
        assert CUDA_KERNELS[name].reference is KERNELS[name]
        assert CUDA_KERNELS[name].backward_inputs == KERNELS[name].backward_inputs


def test_uncovered_calls_fall_back_to_the_reference():
    kernel = CUDA_KERNELS["rmsnorm"]
    x, w = torch.randn(3, 8), torch.randn(8)
    assert not kernel.covers_forward([x, w])  # CPU tensors
    got = kernel.forward([x, w], {"eps": 1e-6})
    want = KERNELS["rmsnorm"].forward([x, w], {"eps": 1e-6})
    assert_close(got, want, 0, "rmsnorm on CPU")


# ----------------------------------------------------------------------- on a GPU
def rand(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def check(name, phase, inputs, attrs, dtype):
    """The custom kernel covers the call (no silent fallback) and matches the reference."""
    kernel = CUDA_KERNELS[name]
    covers = kernel.covers_forward if phase == "forward" else kernel.covers_backward
    assert covers(inputs), f"{name} {phase}: the custom kernel does not cover these inputs"
    got = getattr(kernel, phase)(inputs, attrs)
    want = getattr(KERNELS[name], phase)(inputs, attrs)
    assert_close(got, want, TOL[dtype], f"{name} {phase} {dtype}")
    return want


# vector path, scalar path (C % 8), rows beyond the register cache, many rows (persistent
# grid), short rows that share a warp (C <= 32 vectors; 300 rows: a partial last block)
NORM_SHAPES = [(4, 64), (3, 5, 1000), (7, 4097), (2, 33), (16, 8192), (5, 20000), (2048, 256),
               (300, 7), (1000, 128), (3, 40, 72)]


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rmsnorm(shape, dtype):
    torch.manual_seed(0)
    x, w = rand(*shape, dtype=dtype), rand(shape[-1], dtype=dtype)
    y, rstd = check("rmsnorm", "forward", [x, w], {"eps": 1e-6}, dtype)
    check("rmsnorm", "backward", [rand(*shape, dtype=dtype), x, w, rstd], {}, dtype)


@needs_gpus(1)
@pytest.mark.parametrize("name", ["rmsnorm", "fused_residual_rmsnorm", "swiglu"])
def test_kernels_write_into_the_bytes_they_are_given(name):
    """`out` (the arena's planned bytes, uint8, with room to spare): the outputs are views
    of them with the values the kernels give without; bytes too few: a new tensor."""
    torch.manual_seed(5)
    bf16 = lambda *size: rand(*size, dtype=torch.bfloat16)  # noqa: E731
    shape, kernel = (6, 256), CUDA_KERNELS[name]
    inputs = {"rmsnorm": lambda: [bf16(*shape), bf16(shape[1])],
              "fused_residual_rmsnorm": lambda: [bf16(*shape), bf16(*shape), bf16(shape[1])],
              "swiglu": lambda: [bf16(*shape), bf16(*shape)]}[name]()
    want = kernel.forward(inputs, {"eps": 1e-6})
    out = [torch.empty(t.nbytes + 512, dtype=torch.uint8, device="cuda") for t in want]
    got = kernel.forward(inputs, {"eps": 1e-6, "out": out})
    for g, w, raw in zip(got, want, out):
        assert g.data_ptr() == raw.data_ptr() and torch.equal(g, w)
    short = kernel.forward(inputs, {"eps": 1e-6, "out": [o[:8] for o in out]})
    assert all(s.data_ptr() != raw.data_ptr() for s, raw in zip(short, out))
    d_y = bf16(*shape)  # the backward: d_x of the norms, d_gate and d_up of swiglu
    backward_inputs = {"rmsnorm": lambda: [d_y, inputs[0], inputs[1], want[1]],
                       "fused_residual_rmsnorm": lambda: [bf16(*shape), d_y, want[0],
                                                          inputs[2], want[2]],
                       "swiglu": lambda: [d_y, *inputs]}[name]()
    d_want = kernel.backward(backward_inputs, {})
    written = 2 if name == "swiglu" else 1
    raw = [torch.empty(d.nbytes, dtype=torch.uint8, device="cuda") for d in d_want[:written]]
    d_got = kernel.backward(backward_inputs, {"out": raw})
    for g, w, r in zip(d_got, d_want, raw):
        assert g.data_ptr() == r.data_ptr() and torch.equal(g, w)


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_fused_residual_rmsnorm(shape, dtype):
    torch.manual_seed(1)
    res, inp, w = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype), rand(shape[-1], dtype=dtype)
    res_out, y, rstd = check("fused_residual_rmsnorm", "forward", [res, inp, w], {"eps": 1e-5}, dtype)
    d_res_out, d_y = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype)
    check("fused_residual_rmsnorm", "backward", [d_res_out, d_y, res_out, w, rstd], {}, dtype)


# (2048, 4096) and (301, 4096) bf16, (300, 2048) fp32: rows of 512 16-byte vectors, which
# take the frozen d_x's pipelined kernel (norms.cu rms_backward_pipelined_kernel: a grid
# of 2 blocks a multiprocessor; 2048 rows give each block several, both register sets in
# turn, ~300 some blocks one row and some two)
@needs_gpus(1)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("shape,dtype", [((3, 5, 1000), torch.bfloat16),
                                         ((7, 4097), torch.bfloat16),
                                         ((16, 8192), torch.bfloat16),
                                         ((300, 7), torch.bfloat16),
                                         ((2048, 4096), torch.bfloat16),
                                         ((301, 4096), torch.bfloat16),
                                         ((300, 2048), torch.float32)])
def test_rms_backward_without_the_weights_gradient(shape, dtype, offset):
    """weight_grad=False (a frozen norm weight, the GPU step's `weight_grad` attr): d_x bit
    for bit as with it (the partial sums only feed d_weight), d_weight None; both norms,
    with Gemma's offset too."""
    torch.manual_seed(2)
    make = lambda *size: rand(*size, dtype=dtype)  # noqa: E731
    res, inp, w = make(*shape), make(*shape), make(shape[-1])
    attrs = {"eps": 1e-5, "offset": offset}
    for name, fwd in (("rmsnorm", [inp, w]), ("fused_residual_rmsnorm", [res, inp, w])):
        kernel = CUDA_KERNELS[name]
        outs = kernel.forward(fwd, attrs)
        d_y = make(*shape)
        bwd = [d_y, inp, w, outs[1]] if name == "rmsnorm" else \
            [make(*shape), d_y, outs[0], w, outs[2]]
        full = kernel.backward(bwd, {"offset": offset})
        alone = kernel.backward(bwd, {"offset": offset, "weight_grad": False})
        assert alone[-1] is None and full[-1] is not None
        assert all(torch.equal(a, b) for a, b in zip(alone[:-1], full[:-1]))


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rmsnorm_apply_saved_gives_the_forward_output(shape, dtype):
    """The replayed norm output (x * rstd * weight from the saved x and rstd) is the
    forward kernel's output bit for bit; from fused_residual_rmsnorm's residual_out it is
    within the I/O dtype's rounding (the forward normalizes the fp32 sum)."""
    from runtime.cuda.kernels import APPLY_SAVED_KERNELS

    torch.manual_seed(2)
    x, w = rand(*shape, dtype=dtype), rand(shape[-1], dtype=dtype)
    y, rstd = CUDA_KERNELS["rmsnorm"].forward([x, w], {"eps": 1e-6})
    assert torch.equal(APPLY_SAVED_KERNELS["rmsnorm"](x, [rstd], w), y)
    res, inp = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype)
    res_out, y, rstd = CUDA_KERNELS["fused_residual_rmsnorm"].forward([res, inp, w], {"eps": 1e-5})
    got = APPLY_SAVED_KERNELS["fused_residual_rmsnorm"](res_out, [rstd], w)
    assert_close([got], [y], TOL[dtype], "apply_saved from residual_out")


# the vector path, the scalar path, a row longer than the register cache, rows in a warp
OFFSET_SHAPES = [(4, 64), (3, 5, 1000), (7, 4097), (300, 7), (3, 40, 320)]


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", OFFSET_SHAPES)
def test_norms_with_offset(shape, dtype):
    """Gemma's `(1 + w)` norms (`offset=1.0`, added in fp32 inside the kernels) against the
    reference, forward and backward; weights around 0 as Gemma's are; apply_saved replays
    the forward's output bit for bit."""
    from runtime.cuda.kernels import APPLY_SAVED_KERNELS

    torch.manual_seed(6)
    attrs = {"eps": 1e-6, "offset": 1.0}
    x, w = rand(*shape, dtype=dtype), rand(shape[-1], dtype=dtype, scale=0.1)
    y, rstd = check("rmsnorm", "forward", [x, w], attrs, dtype)
    check("rmsnorm", "backward", [rand(*shape, dtype=dtype), x, w, rstd], attrs, dtype)
    y, rstd = CUDA_KERNELS["rmsnorm"].forward([x, w], attrs)
    assert torch.equal(APPLY_SAVED_KERNELS["rmsnorm"](x, [rstd], w, 1.0), y)
    assert not torch.equal(APPLY_SAVED_KERNELS["rmsnorm"](x, [rstd], w), y)
    res = rand(*shape, dtype=dtype)
    res_out, y, rstd = check("fused_residual_rmsnorm", "forward", [res, x, w], attrs, dtype)
    d_res_out, d_y = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype)
    check("fused_residual_rmsnorm", "backward", [d_res_out, d_y, res_out, w, rstd], attrs, dtype)


@needs_gpus(1)
def test_embedding_backward_gives_the_padding_row_no_gradient():
    """`embedding(padding_idx=p)`: the custom kernel's d_weight with row p zeroed, as the
    reference and torch.nn.Embedding's padding_idx give."""
    torch.manual_seed(7)
    ids = torch.randint(0, 9, (2, 40), device="cuda", dtype=torch.int32)
    ids[0, :5] = 3
    d_y = rand(2, 40, 64, dtype=torch.bfloat16)
    attrs = {"input_shapes": {"weight": (9, 64)}, "padding_idx": 3}
    kernel = CUDA_KERNELS["embedding"]
    assert kernel.covers_backward([d_y, ids])
    (got,) = kernel.backward([d_y, ids], attrs)
    assert not got[3].any() and got[ids[1].long()].any()
    assert_close([got], KERNELS["embedding"].backward([d_y, ids], attrs), TOL[torch.bfloat16],
                 "embedding backward with padding_idx")


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T, V, D", [(2, 64, 100, 256), (4, 33, 7, 37), (1, 5, 50000, 64)])
def test_embedding_backward_is_deterministic_and_matches_the_reference(B, T, V, D, dtype):
    """Repeated ids (V=7), unused rows (V=50000: zeros), the scalar path (D=37)."""
    torch.manual_seed(3)
    ids = torch.randint(0, V, (B, T), device="cuda", dtype=torch.int32)
    d_y = rand(B, T, D, dtype=dtype)
    attrs = {"input_shapes": {"weight": (V, D)}}
    kernel = CUDA_KERNELS["embedding"]
    assert kernel.covers_backward([d_y, ids])
    got = kernel.backward([d_y, ids], attrs)
    assert_close(got, KERNELS["embedding"].backward([d_y, ids], attrs), TOL[dtype],
                 "embedding backward")
    assert torch.equal(kernel.backward([d_y, ids], attrs)[0], got[0])
    unused = torch.ones(V, dtype=torch.bool, device="cuda")
    unused[ids.reshape(-1).long()] = False
    assert not got[0][unused].any()


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, top_k, E, C", [(64, 2, 8, 128), (37, 1, 4, 37), (5, 3, 3, 2048)])
def test_moe_permute_and_unpermute_match_the_reference(N, top_k, E, C, dtype):
    """The routing gathers (runtime/cuda/moe.py) against the reference, forward and
    backward, and bitwise repeatable."""
    torch.manual_seed(4)
    x = rand(N, C, dtype=dtype)
    indices = torch.stack([torch.randperm(E, device="cuda")[:top_k] for _ in range(N)]).int()
    offsets = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.bincount(indices.reshape(-1).long(), minlength=E).cumsum(0)
    attrs = {"input_shapes": {"x": (N, C)}}
    permute, unpermute = CUDA_KERNELS["moe_permute"], CUDA_KERNELS["moe_unpermute"]
    got = permute.forward([x, indices, offsets], attrs)
    want = KERNELS["moe_permute"].forward([x, indices, offsets], attrs)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    scatter = got[1]
    d_perm = rand(N * top_k, C, dtype=dtype)
    assert_close(permute.backward([d_perm, scatter], attrs),
                 KERNELS["moe_permute"].backward([d_perm, scatter], attrs), TOL[dtype],
                 "moe_permute backward")
    rows = rand(N * top_k, C, dtype=dtype)
    weights = torch.rand(N, top_k, device="cuda")
    assert_close(unpermute.forward([rows, weights, scatter], {}),
                 KERNELS["moe_unpermute"].forward([rows, weights, scatter], {}), TOL[dtype],
                 "moe_unpermute forward")
    d_comb = rand(N, C, dtype=dtype)
    got = unpermute.backward([d_comb, rows, weights, scatter], {})
    assert_close(got, KERNELS["moe_unpermute"].backward([d_comb, rows, weights, scatter], {}),
                 TOL[dtype], "moe_unpermute backward")
    again = unpermute.backward([d_comb, rows, weights, scatter], {})
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7,), (3, 1001), (64, 4096), (2, 3, 37), (5,)])
def test_swiglu(shape, dtype):
    torch.manual_seed(2)
    gate, up = rand(*shape, dtype=dtype, scale=4.0), rand(*shape, dtype=dtype)
    check("swiglu", "forward", [gate, up], {}, dtype)
    check("swiglu", "backward", [rand(*shape, dtype=dtype), gate, up], {}, dtype)


@needs_gpus(1)
@pytest.mark.parametrize("approximate", [True, False], ids=["tanh", "erf"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 1001), (64, 4096), (2, 3, 37)])
def test_geglu(shape, dtype, approximate):
    """geglu runs swiglu's kernels with a GELU (Gemma's tanh form, or erf), contiguous and
    on the halves of a fused [.., 2C] projection (d_gate / d_up: halves of one buffer)."""
    torch.manual_seed(8)
    attrs = {"approximate": approximate}
    gate, up = rand(*shape, dtype=dtype, scale=4.0), rand(*shape, dtype=dtype)
    check("geglu", "forward", [gate, up], attrs, dtype)
    check("geglu", "backward", [rand(*shape, dtype=dtype), gate, up], attrs, dtype)
    C = shape[-1]
    gate, up = rand(*shape[:-1], 2 * C, dtype=dtype, scale=3.0).split([C, C], dim=-1)
    check("geglu", "forward", [gate, up], attrs, dtype)
    check("geglu", "backward", [rand(*shape, dtype=dtype), gate, up], attrs, dtype)
    got = CUDA_KERNELS["geglu"].backward([rand(*shape, dtype=dtype), gate, up], attrs)
    assert got[0].data_ptr() + C * got[0].element_size() == got[1].data_ptr()


# (B, Hq, Hkv, T, D, positions): None = 0..T-1, "batch" = [B, T], "shared" = [1, T];
# D=6 and D=20 take the scalar path, Hq=5 a partial head group
ROPE_CASES = [(2, 4, 2, 16, 128, None), (1, 3, 1, 7, 6, None), (2, 5, 5, 9, 80, "batch"),
              (3, 2, 1, 5, 64, "shared"), (1, 8, 2, 33, 20, "batch")]


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope(case, dtype):
    torch.manual_seed(3)
    B, Hq, Hkv, T, D, positions = case
    q, k = rand(B, Hq, T, D, dtype=dtype), rand(B, Hkv, T, D, dtype=dtype)
    pos = None
    if positions:
        rows = B if positions == "batch" else 1
        pos = torch.randint(0, 64, (rows, T), device="cuda", dtype=torch.int32)
    attrs = {"theta": 10000.0}
    check("rope", "forward", [q, k, pos], attrs, dtype)
    d_q, d_k = rand(B, Hq, T, D, dtype=dtype), rand(B, Hkv, T, D, dtype=dtype)
    check("rope", "backward", [d_q, d_k, pos], attrs, dtype)


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, Hq, Hkv, T, D", [(2, 4, 2, 16, 128), (1, 3, 1, 5, 72)])
def test_qk_norm(B, Hq, Hkv, T, D, dtype):
    torch.manual_seed(4)
    q, k = rand(B, Hq, T, D, dtype=dtype), rand(B, Hkv, T, D, dtype=dtype)
    qw, kw = rand(D, dtype=dtype), rand(D, dtype=dtype)
    _, _, q_rstd, k_rstd = check("qk_norm", "forward", [q, k, qw, kw], {"eps": 1e-6}, dtype)
    d_q, d_k = rand(B, Hq, T, D, dtype=dtype), rand(B, Hkv, T, D, dtype=dtype)
    check("qk_norm", "backward", [d_q, d_k, q, k, qw, kw, q_rstd, k_rstd], {}, dtype)


@needs_gpus(1)
def test_mixed_dtypes_fall_back():
    """bf16 activations with fp32 weights are not covered: the reference runs them."""
    x, w = rand(4, 64, dtype=torch.bfloat16), rand(64, dtype=torch.float32)
    kernel = CUDA_KERNELS["rmsnorm"]
    assert not kernel.covers_forward([x, w])
    assert_close(kernel.forward([x, w], {}), KERNELS["rmsnorm"].forward([x, w], {}), 0, "fallback")


# ----------------------------------------------------------- strided calls (no copies)
@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 64), (5, 37), (4, 7, 1024), (3, 8)])
def test_swiglu_on_the_halves_of_a_fused_projection(shape, dtype):
    """gate / up as the two halves of [.., 2C] (row stride 2C; C odd: the scalar path),
    d_gate / d_up come back as the halves of one [.., 2C] buffer."""
    torch.manual_seed(5)
    C = shape[-1]
    gate_up = rand(*shape[:-1], 2 * C, dtype=dtype, scale=3.0)
    gate, up = gate_up.split([C, C], dim=-1)
    assert not gate.is_contiguous()
    check("swiglu", "forward", [gate, up], {}, dtype)
    d_y = rand(*shape, dtype=dtype)
    got = CUDA_KERNELS["swiglu"].backward([d_y, gate, up], {})
    want = KERNELS["swiglu"].backward([d_y, gate, up], {})
    assert_close(got, want, TOL[dtype], f"swiglu backward strided {dtype}")
    d_gate, d_up, _ = got  # (and y)
    assert d_gate.data_ptr() + C * d_gate.element_size() == d_up.data_ptr()
    from runtime.cuda.train_kernels import join
    both = join([d_gate, d_up], -1)
    assert both is not None and both.is_contiguous()
    assert_close([both], [torch.cat(want[:2], dim=-1)], TOL[dtype], "joined d_gate_up")


GATED = [("swiglu", {}), ("geglu", {"approximate": True}), ("geglu", {"approximate": False})]


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 64), (5, 37), (4, 7, 1024)])
@pytest.mark.parametrize("name, attrs", GATED, ids=["swiglu", "geglu-tanh", "geglu-erf"])
def test_gated_backward_writes_y_in_its_pass(name, attrs, shape, dtype):
    """The backward's y (the MLP's recompute of hidden, fused into it): the reference's
    within the dtype's tolerance and the forward kernel's bit for bit, contiguous and on
    the halves of a fused projection, into given bytes too; d_gate / d_up as without y."""
    torch.manual_seed(9)
    C, kernel = shape[-1], CUDA_KERNELS[name]
    gate, up = rand(*shape[:-1], 2 * C, dtype=dtype, scale=3.0).split([C, C], dim=-1)
    for g, u in ((gate, up), (gate.contiguous(), up.contiguous())):
        d_y = rand(*shape, dtype=dtype)
        got = kernel.backward([d_y, g, u], dict(attrs))
        want = KERNELS[name].backward([d_y, g, u], dict(attrs))
        assert len(got) == 3 and got[2].shape == g.shape
        assert_close(got, want, TOL[dtype], f"{name} backward with y {dtype}")
        assert torch.equal(got[2], kernel.forward([g, u], dict(attrs))[0])
        plain = kernel.backward([d_y, g, u], dict(attrs, wanted_outputs=(True, True, False)))
        assert plain[2] is None
        assert torch.equal(plain[0], got[0]) and torch.equal(plain[1], got[1])
        raw = torch.empty(got[2].nbytes + 64, dtype=torch.uint8, device="cuda")
        into = kernel.backward([d_y, g, u], dict(attrs, out=[None, None, raw]))
        assert into[2].data_ptr() == raw.data_ptr() and torch.equal(into[2], got[2])


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(2, 8, 2, 16, 64), (1, 3, 1, 7, 6), (2, 5, 5, 9, 80),
                                  (1, 32, 4, 33, 64)])
def test_rope_on_the_heads_of_a_fused_qkv(case, dtype):
    """q / k as the transposed head views of [B, T, Hq + 2 Hk, D]; outputs laid out
    [B, T, H, D]; the training registry's backward writes the fused QKV gradient and
    the concat over heads copies only d_v."""
    from runtime.cuda.train_kernels import TRAIN_KERNELS

    torch.manual_seed(6)
    B, Hq, Hk, T, D = case
    qkv = rand(B, T, Hq + 2 * Hk, D, dtype=dtype)
    q, k, v = (x.transpose(1, 2) for x in qkv.split([Hq, Hk, Hk], dim=2))
    pos = torch.randint(0, 64, (B, T), device="cuda", dtype=torch.int32)
    attrs = {"theta": 10000.0}
    q_rot, k_rot = check("rope", "forward", [q, k, None], attrs, dtype)
    got = CUDA_KERNELS["rope"].forward([q, k, pos], attrs)
    assert got[0].transpose(1, 2).is_contiguous()
    assert_close(got, KERNELS["rope"].forward([q, k, pos], attrs), TOL[dtype], "rope pos")
    d_out = rand(B, T, Hq + 2 * Hk, D, dtype=dtype)
    d_q, d_k, d_v = (x.transpose(1, 2) for x in d_out.split([Hq, Hk, Hk], dim=2))
    want = KERNELS["rope"].backward([d_q, d_k, pos], attrs)
    got = TRAIN_KERNELS["rope"].backward([d_q, d_k, pos], attrs)
    assert_close(got, want, TOL[dtype], f"rope backward into heads {dtype}")
    parts = [g.transpose(1, 2) for g in (*got, d_v)]
    fused = TRAIN_KERNELS["concat"].forward([parts], {"dim": 2})[0]
    assert fused.data_ptr() == got[0].data_ptr() and fused.is_contiguous()
    ref = torch.cat([w.transpose(1, 2).to(dtype) for w in want] + [d_v.transpose(1, 2)], dim=2)
    assert_close([fused], [ref], TOL[dtype], "fused qkv gradient")


@needs_gpus(1)
@pytest.mark.parametrize("case", [(1, 32, 8, 33, 128), (2, 32, 4, 17, 64), (1, 5, 1, 9, 128)])
def test_rope_a_block_a_position_gives_the_head_a_thread_bits(case, monkeypatch):
    """bf16 rotate-half with a head's pairs in 4 or 8 vectors runs rope_rows_kernel (the
    heads of a warp share a position's angles); its results, forward in place on the
    fused QKV's head views and backward into them, are the general kernel's bit for bit
    (MODULEC_ROPE_ROWS=0). Hkv 4 at D=64 and Hq 5 leave a warp's last heads empty."""
    from benchmarks.harness import profiled_events
    from runtime.cuda.train_kernels import TRAIN_KERNELS

    torch.manual_seed(9)
    B, Hq, Hk, T, D = case
    qkv = rand(B, T, Hq + 2 * Hk, D, dtype=torch.bfloat16)
    pos = torch.randint(0, 64, (B, T), device="cuda", dtype=torch.int32)
    attrs = {"theta": 500000.0}
    d_out = rand(B, T, Hq + 2 * Hk, D, dtype=torch.bfloat16)

    def run():
        """The forward's and backward's results, and the names of the kernels they ran."""
        q, k, _ = (x.transpose(1, 2) for x in qkv.clone().split([Hq, Hk, Hk], dim=2))
        d_q, d_k, _ = (x.transpose(1, 2) for x in d_out.split([Hq, Hk, Hk], dim=2))
        results = []

        def both():
            results.extend(t.clone() for t in CUDA_KERNELS["rope"].forward([q, k, pos], attrs))
            results.extend(TRAIN_KERNELS["rope"].backward([d_q, d_k, pos], attrs))
        names = " ".join(e.get("name", "") for e in profiled_events(both))
        return results, names

    rows, rows_kernels = run()
    monkeypatch.setenv("MODULEC_ROPE_ROWS", "0")
    heads, heads_kernels = run()
    assert "rope_rows_kernel" in rows_kernels and "rope_rows_kernel" not in heads_kernels
    for got, want in zip(rows, heads):
        assert torch.equal(got, want)
    want = KERNELS["rope"].backward([x.transpose(1, 2) for x in
                                     d_out.split([Hq, Hk, Hk], dim=2)[:2]] + [pos], attrs)
    assert_close(rows[2:], want, TOL[torch.bfloat16], "rope backward, a block a position")


# (B, Hq, Hkv, T, D, positions) as ROPE_CASES. D=128 and 64 take the vector path; D=72
# (bf16: 36 is not whole vectors), 4, 6 and 20 the scalar path with 2 to 8 elements a lane
# (fp32 D=72: the vector path, 9 vectors a half); Hq=5 and Hkv=1 partial head groups;
# 4x512 rows x 20 heads more tasks than the backward's persistent grid holds; D=256 the
# largest head dim. Positions stay below 64: the angles' fp32 rounding (powf here, torch's
# pow in the reference) grows with the position.
QK_ROPE_CASES = [(2, 4, 2, 16, 128, None), (2, 8, 8, 9, 64, "batch"), (1, 5, 1, 7, 64, "shared"),
                 (1, 3, 1, 5, 72, None), (2, 2, 1, 33, 6, "batch"), (1, 8, 2, 17, 20, "shared"),
                 (1, 2, 1, 3, 4, None), (4, 16, 4, 512, 128, "batch"), (2, 4, 2, 8, 256, "batch")]


def _positions(kind, B, T):
    if kind is None:
        return None
    return torch.randint(0, 64, (B if kind == "batch" else 1, T), device="cuda", dtype=torch.int32)


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", QK_ROPE_CASES)
def test_qk_norm_rope(case, dtype):
    """Contiguous q / k; the backward is bitwise repeatable (the weight gradients are
    reduced without atomics)."""
    torch.manual_seed(8)
    B, Hq, Hkv, T, D, positions = case
    q, k = rand(B, Hq, T, D, dtype=dtype), rand(B, Hkv, T, D, dtype=dtype, scale=3.0)
    qw, kw = rand(D, dtype=dtype), rand(D, dtype=dtype)
    pos = _positions(positions, B, T)
    attrs = {"eps": 1e-6, "theta": 10000.0}
    _, _, q_rstd, k_rstd = check("qk_norm_rope", "forward", [q, k, qw, kw, pos], attrs, dtype)
    d_q, d_k = rand(B, Hq, T, D, dtype=dtype), rand(B, Hkv, T, D, dtype=dtype)
    inputs = [d_q, d_k, q, k, qw, kw, q_rstd, k_rstd, pos]
    want = check("qk_norm_rope", "backward", inputs, attrs, dtype)
    kernel = CUDA_KERNELS["qk_norm_rope"]
    first, again = kernel.backward(inputs, attrs), kernel.backward(inputs, attrs)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert_close(first, want, TOL[dtype], "qk_norm_rope backward (second call)")


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(2, 4, 2, 16, 128), (1, 6, 3, 9, 64), (2, 3, 1, 5, 72)])
def test_qk_norm_rope_on_the_heads_of_a_fused_qkv(case, dtype):
    """q / k as the transposed head views of [B, T, Hq + 2 Hk, D] (no copy); outputs laid
    out [B, T, H, D]; the training registry's backward reads d_q_rot / d_k_rot as
    transposed views too and writes the fused QKV gradient, and the concat over heads
    copies only d_v. fp32 D=72 takes the vector path on these strides, bf16 the scalar."""
    from runtime.cuda.train_kernels import TRAIN_KERNELS

    torch.manual_seed(9)
    B, Hq, Hk, T, D = case
    qkv = rand(B, T, Hq + 2 * Hk, D, dtype=dtype)
    q, k, v = (x.transpose(1, 2) for x in qkv.split([Hq, Hk, Hk], dim=2))
    qw, kw = rand(D, dtype=dtype), rand(D, dtype=dtype)
    pos = torch.randint(0, 64, (B, T), device="cuda", dtype=torch.int32)
    attrs = {"eps": 1e-6, "theta": 1000000.0}
    fwd = [q, k, qw, kw, pos]
    _, _, q_rstd, k_rstd = check("qk_norm_rope", "forward", fwd, attrs, dtype)
    got = TRAIN_KERNELS["qk_norm_rope"].forward(fwd, attrs)
    assert got[0].transpose(1, 2).is_contiguous() and got[1].transpose(1, 2).is_contiguous()
    d_out = rand(B, T, Hq + 2 * Hk, D, dtype=dtype)
    d_q, d_k, d_v = (x.transpose(1, 2) for x in d_out.split([Hq, Hk, Hk], dim=2))
    bwd = [d_q, d_k, q, k, qw, kw, q_rstd, k_rstd, pos]
    want = KERNELS["qk_norm_rope"].backward(bwd, attrs)
    assert CUDA_KERNELS["qk_norm_rope"].covers_backward(bwd)
    got = TRAIN_KERNELS["qk_norm_rope"].backward(bwd, attrs)
    assert_close(got, want, TOL[dtype], f"qk_norm_rope backward into heads {dtype}")
    parts = [g.transpose(1, 2) for g in (*got[:2], d_v)]
    fused = TRAIN_KERNELS["concat"].forward([parts], {"dim": 2})[0]
    assert fused.data_ptr() == got[0].data_ptr() and fused.is_contiguous()
    ref = torch.cat([w.transpose(1, 2).to(dtype) for w in want[:2]] + [d_v.transpose(1, 2)], dim=2)
    assert_close([fused], [ref], TOL[dtype], "fused qkv gradient")


@needs_gpus(1)
def test_qk_norm_rope_head_dims_it_does_not_take_fall_back():
    """A head dim over 256 is not the kernel's: the reference runs it."""
    q, k = rand(1, 2, 3, 258, dtype=torch.bfloat16), rand(1, 1, 3, 258, dtype=torch.bfloat16)
    w = rand(258, dtype=torch.bfloat16)
    kernel = CUDA_KERNELS["qk_norm_rope"]
    assert not kernel.covers_forward([q, k, w, w, None])
    assert_close(kernel.forward([q, k, w, w, None], {}),
                 KERNELS["qk_norm_rope"].forward([q, k, w, w, None], {}), 0, "fallback")


def test_join_refuses_parts_that_are_not_side_by_side():
    from runtime.cuda.train_kernels import join

    a, b = torch.randn(4, 6), torch.randn(4, 6)
    assert join([a, b], -1) is None
    x = torch.randn(4, 12)
    left, right = x.split([6, 6], dim=-1)
    assert torch.equal(join([left, right], -1), x)
    assert join([right, left], -1) is None  # out of order
    assert join([left[:, :5], right], -1) is None  # a gap


@needs_gpus(1)
@pytest.mark.parametrize("n", [1, 7, 4096, 100003])
@pytest.mark.parametrize("grad_dtype", DTYPES)
def test_adamw_matches_torch(n, grad_dtype):
    """csrc/kernels/adamw.cu against torch.optim.AdamW (on the fp32 value of the same
    gradients), three steps, weight decay on; the bf16 copy is the master rounded."""
    from runtime.cuda.build import load

    torch.manual_seed(7)
    p = torch.randn(n, device="cuda")
    ref = p.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    m, v, step = torch.zeros_like(p), torch.zeros_like(p), torch.zeros((), device="cuda")
    compute = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        g = torch.randn(n, device="cuda").to(grad_dtype)
        step.add_(1)
        load().adamw_step(p, g, m, v, compute, step, 1e-2, 0.9, 0.95, 1e-8, 0.1)
        ref.grad = g.float()
        opt.step()
    assert float((p - ref.detach()).abs().max()) < 1e-5
    assert torch.equal(compute, p.to(torch.bfloat16))


@needs_gpus(1)
@pytest.mark.parametrize("n", [1, 7, 4096, 100003])
@pytest.mark.parametrize("grad_dtype", DTYPES)
def test_adamw_on_a_split_master_matches_the_fp32_master(n, grad_dtype):
    """adamw_split_step (the master as bf16 top half + int16 low half, runtime/cuda/state.py)
    gives the fp32-master kernel's values bit for bit, three steps; its top half is the
    master rounded to nearest but for exact ties."""
    from runtime.cuda.build import load
    from runtime.cuda.state import joined_master, split_master

    torch.manual_seed(7)
    p = torch.randn(n, device="cuda")
    hi, lo = torch.empty(n, device="cuda", dtype=torch.bfloat16), torch.empty(
        n, device="cuda", dtype=torch.int16)
    split_master(p, hi, lo)
    m, v, step = torch.zeros_like(p), torch.zeros_like(p), torch.zeros((), device="cuda")
    m2, v2 = m.clone(), v.clone()
    for _ in range(3):
        g = torch.randn(n, device="cuda").to(grad_dtype)
        step.add_(1)
        load().adamw_step(p, g, m, v, None, step, 1e-2, 0.9, 0.95, 1e-8, 0.1)
        load().adamw_split_step(hi, lo, g, m2, v2, step, 1e-2, 0.9, 0.95, 1e-8, 0.1)
    assert torch.equal(joined_master(hi, lo), p)
    assert torch.equal(m2, m) and torch.equal(v2, v)
    differs = hi != p.to(torch.bfloat16)
    assert bool((lo[differs] == -2**15).all())


@needs_gpus(1)
def test_swiglu_writes_the_halves_of_a_planned_concat():
    """A concat planned in place (modulec.plan.joins) gives swiglu's backward d_gate and
    d_up as the strided halves of each row of one [.., 2C] buffer (and the forward a
    strided y): the kernel writes them there, values as without."""
    torch.manual_seed(6)
    kernel, (rows, C) = CUDA_KERNELS["swiglu"], (6, 256)
    gate, up, d_y = (rand(2, rows // 2, C, dtype=torch.bfloat16) for _ in range(3))
    joined = torch.full((2, rows // 2, 2 * C), float("nan"), dtype=torch.bfloat16, device="cuda")
    halves = [joined.narrow(-1, 0, C), joined.narrow(-1, C, C)]
    want = kernel.backward([d_y, gate, up], {})
    got = kernel.backward([d_y, gate, up], {"out": halves})
    for g, w, half in zip(got, want, halves):
        assert g.data_ptr() == half.data_ptr() and g.stride() == half.stride()
        assert torch.equal(g, w)
    y = kernel.forward([gate, up], {"out": [halves[0]]})[0]
    assert y.data_ptr() == halves[0].data_ptr() and torch.equal(y, kernel.forward([gate, up], {})[0])


@needs_gpus(1)
def test_rope_backward_writes_the_head_slots_of_a_planned_d_qkv():
    """On the arena the attention's (d_q, d_k, d_v) concat is planned in place: rope's
    backward gets the q and k head slots of the [B, T, Hq + 2 Hk, D] gradient as
    [B, H, T, D] strided targets and writes them there, values as without."""
    from runtime.cuda.train_kernels import train_kernels

    torch.manual_seed(7)
    B, T, Hq, Hk, D = 2, 16, 4, 2, 32
    rope = train_kernels("cuda")["rope"]
    d_q, d_k = rand(B, Hq, T, D, dtype=torch.bfloat16), rand(B, Hk, T, D, dtype=torch.bfloat16)
    qkv = torch.full((B, T, Hq + 2 * Hk, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    slots = [qkv.narrow(2, 0, Hq).transpose(1, 2), qkv.narrow(2, Hq, Hk).transpose(1, 2)]
    want = rope.backward([d_q, d_k, None], {"theta": 10000.0})
    got = rope.backward([d_q, d_k, None], {"theta": 10000.0, "out": slots})
    for g, w, slot in zip(got, want, slots):
        assert g.data_ptr() == slot.data_ptr() and torch.equal(g, w)
    assert qkv[:, :, Hq + Hk:].isnan().all()  # d_v's slots: left for it


@needs_gpus(1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_rows", [[], [3, 0, 5, 2]])
@pytest.mark.parametrize("shapes", [((64, 16), (17, 16), (9, 5)),  # an element a thread
                                    ((64, 16), (17, 16), (9, 16))])  # 16-byte pieces
def test_block_diag_matches_the_reference_bit_for_bit(dtype, zero_rows, shapes):
    """One launch each way (csrc/kernels/block_diag.cu): the forward into given bytes (the
    arena's) or a new tensor, every other element zero even where the bytes held NaN; the
    backward each block in a contiguous tensor of its own; both the reference's bits, an
    element a thread or (rows of whole 16-byte pieces: LoRA's 16-wide blocks) a piece."""
    from runtime.cuda.kernels import BlockDiag

    torch.manual_seed(7)
    kernel, reference = CUDA_KERNELS["block_diag"], KERNELS["block_diag"]
    assert isinstance(kernel, BlockDiag) and kernel.takes_out
    xs = [rand(rows, cols, dtype=dtype) for rows, cols in shapes]
    attrs = {"zero_rows": zero_rows} if zero_rows else {}
    want = reference.forward_fn(xs, **attrs)[0]
    raw = torch.full((want.numel() * want.element_size() + 64,), 255, dtype=torch.uint8,
                     device="cuda")  # NaN bits in bf16 and fp32
    got = kernel.forward([xs], {**attrs, "out": [raw]})[0]
    assert got.data_ptr() == raw.data_ptr() and torch.equal(got, want)
    assert torch.equal(kernel.forward([xs], dict(attrs))[0], want)
    d_y = rand(*want.shape, dtype=dtype)
    shapes = {"input_shapes": {"xs": [tuple(x.shape) for x in xs]}}
    grads = kernel.backward([d_y], {**attrs, **shapes})[0]
    for got_grad, want_grad in zip(grads, reference.backward_fn(d_y, **attrs, **shapes)[0]):
        assert got_grad.is_contiguous() and torch.equal(got_grad, want_grad)
