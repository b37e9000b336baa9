"""The LayerNorm, GELU and softmax CUDA kernels (csrc/kernels/layernorm.cu, gelu.cu,
softmax.cu; issue 19 item 5) against the reference kernels (runtime/kernels), forward and
backward, fp32 and bf16: shapes on the 16-byte vector path, the scalar path (C not a
multiple of the vector width, or a base not 16-byte aligned), rows longer than the
register cache, many rows (the backward's persistent grid) and short rows that share a
warp; fused_residual_layernorm likewise. `-m cuda`; skipped without CUDA."""

from __future__ import annotations

import pytest

from kernel_testing import assert_close

torch = pytest.importorskip("torch")

from test_cuda_kernels import DTYPES, NORM_SHAPES, TOL, check, rand  # noqa: E402

from runtime.cuda.kernels import CUDA_KERNELS  # noqa: E402
from runtime.kernels import KERNELS  # noqa: E402
from tests.dist_testing import needs_gpus  # noqa: E402

pytestmark = needs_gpus(1)

# the vector path, C % 8 (scalar), one element, long rows, a partial last vector
ELEMENTWISE_SHAPES = [(4, 64), (3, 5, 1001), (1,), (7, 4097), (2, 3, 8192), (13,)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_layernorm(shape, bias, dtype):
    torch.manual_seed(11)
    C = shape[-1]
    x = rand(*shape, dtype=dtype, scale=2.0) + 0.5  # a mean away from 0
    w, b = rand(C, dtype=dtype), rand(C, dtype=dtype) if bias else None
    attrs = {"eps": 1e-5, "input_shapes": {"bias": (C,) if bias else None}}
    y, mean, rstd = check("layernorm", "forward", [x, w, b], attrs, dtype)
    inputs = [rand(*shape, dtype=dtype), x, w, mean, rstd]
    assert CUDA_KERNELS["layernorm"].covers_backward(inputs)
    got = CUDA_KERNELS["layernorm"].backward(inputs, dict(attrs))
    want = KERNELS["layernorm"].backward(inputs, dict(attrs))
    if not bias:  # no d_bias
        assert got[2] is None and want[2] is None
        got, want = got[:2], want[:2]
    assert_close(got, want, TOL[dtype], f"layernorm backward {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(4, 64), (3, 5, 1000), (7, 4097), (300, 7), (2048, 256)])
def test_fused_residual_layernorm(shape, bias, dtype):
    """residual_out = residual + input (fp32), then layernorm of it; the backward's d_x is
    d_residual_out + layernorm's d_x, one tensor for d_residual and d_input."""
    torch.manual_seed(12)
    C = shape[-1]
    res, inp = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype)
    w, b = rand(C, dtype=dtype), rand(C, dtype=dtype) if bias else None
    attrs = {"eps": 1e-5, "input_shapes": {"bias": (C,) if bias else None}}
    res_out, y, mean, rstd = check("fused_residual_layernorm", "forward", [res, inp, w, b],
                                   attrs, dtype)
    inputs = [rand(*shape, dtype=dtype), rand(*shape, dtype=dtype), res_out, w, mean, rstd]
    kernel = CUDA_KERNELS["fused_residual_layernorm"]
    assert kernel.covers_backward(inputs)
    got = kernel.backward(inputs, dict(attrs))
    want = KERNELS["fused_residual_layernorm"].backward(inputs, dict(attrs))
    assert got[0] is got[1]
    if not bias:
        assert got[3] is None and want[3] is None
    n = 4 if bias else 3
    assert_close(got[:n], want[:n], TOL[dtype], f"fused_residual_layernorm backward {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", [True, False])
@pytest.mark.parametrize("shape", ELEMENTWISE_SHAPES)
def test_gelu(shape, approximate, dtype):
    torch.manual_seed(13)
    x = rand(*shape, dtype=dtype, scale=3.0)
    attrs = {"approximate": approximate}
    check("gelu", "forward", [x], attrs, dtype)
    check("gelu", "backward", [rand(*shape, dtype=dtype), x], attrs, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_on_an_unaligned_base(dtype):
    """A view one element into its storage: not 16-byte aligned, the scalar path."""
    torch.manual_seed(14)
    x = rand(1 + 8 * 100, dtype=dtype)[1:]
    assert x.data_ptr() % 16
    for approximate in (True, False):
        check("gelu", "forward", [x], {"approximate": approximate}, dtype)
        check("gelu", "backward", [rand(800, dtype=dtype), x], {"approximate": approximate},
              dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_softmax(shape, dtype):
    torch.manual_seed(15)
    x = rand(*shape, dtype=dtype, scale=4.0)
    (y,) = check("softmax", "forward", [x], {"dim": -1}, dtype)
    check("softmax", "backward", [rand(*shape, dtype=dtype), y], {"dim": -1}, dtype)


def test_softmax_masked_rows_and_other_dims():
    """-inf entries (a mask) get 0 as the reference's; a dim other than the last goes to
    the reference (the kernels read rows of memory)."""
    torch.manual_seed(16)
    x = rand(6, 40, dtype=torch.float32)
    x[:, ::3] = float("-inf")
    (y,) = check("softmax", "forward", [x], {"dim": -1}, torch.float32)
    assert torch.all(y[:, ::3] == 0)
    z = rand(5, 7, dtype=torch.bfloat16)
    got = CUDA_KERNELS["softmax"].forward([z], {"dim": 0})
    assert_close(got, KERNELS["softmax"].forward([z], {"dim": 0}), 0, "softmax dim 0")


@pytest.mark.parametrize("name", ["layernorm", "gelu", "softmax"])
def test_kernels_write_into_the_bytes_they_are_given(name):
    """`out` (the arena's planned bytes, uint8): the outputs are views of them, with the
    values the kernels give without."""
    torch.manual_seed(17)
    shape = (6, 256)
    bf16 = lambda *size: rand(*size, dtype=torch.bfloat16)  # noqa: E731
    kernel = CUDA_KERNELS[name]
    inputs = {"layernorm": [bf16(*shape), bf16(256), bf16(256)], "gelu": [bf16(*shape)],
              "softmax": [bf16(*shape)]}[name]
    want = kernel.forward(inputs, {})
    out = [torch.empty(t.nbytes + 256, dtype=torch.uint8, device="cuda") for t in want]
    got = kernel.forward(inputs, {"out": out})
    for g, w, raw in zip(got, want, out):
        assert g.data_ptr() == raw.data_ptr() and torch.equal(g, w)
    d_y = bf16(*shape)
    backward_inputs = {"layernorm": lambda: [d_y, inputs[0], inputs[1], want[1], want[2]],
                       "gelu": lambda: [d_y, inputs[0]], "softmax": lambda: [d_y, want[0]]}[name]()
    d_want = kernel.backward(backward_inputs, {})
    raw = torch.empty(d_want[0].nbytes, dtype=torch.uint8, device="cuda")
    d_got = kernel.backward(backward_inputs, {"out": [raw]})
    assert d_got[0].data_ptr() == raw.data_ptr() and torch.equal(d_got[0], d_want[0])


def test_the_training_registry_takes_strided_inputs():
    """TRAIN_KERNELS' layernorm / gelu / softmax copy a strided input to a contiguous one
    and run the custom kernel (the transposed view's values, not its memory order)."""
    from runtime.cuda.train_kernels import TRAIN_KERNELS

    torch.manual_seed(18)
    x = rand(64, 48, dtype=torch.bfloat16).t()  # [48, 64], strided
    w, b = rand(64, dtype=torch.bfloat16), rand(64, dtype=torch.bfloat16)
    cases = {"layernorm": ([x, w, b], {"eps": 1e-5}), "gelu": ([x], {}),
             "softmax": ([x], {"dim": -1})}
    for name, (inputs, attrs) in cases.items():
        got = TRAIN_KERNELS[name].forward(inputs, dict(attrs))
        want = KERNELS[name].forward(inputs, dict(attrs))
        assert_close(got, want, TOL[torch.bfloat16], f"{name} strided")
