"""zeros, ones, fill (spec §6.11): constants, no inputs, no backward; cast (`@dtype`).

`dtype` is a DSL dtype name; attrs may also carry `device` (default CPU). fp4_e2m1 and
int4 have no torch dtype and are refused.
"""

from __future__ import annotations

import torch

from runtime.kernels.base import register

TORCH_DTYPES = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
    "int32": torch.int32, "int8": torch.int8,
    "fp64": torch.float64,  # not a DSL dtype: the reference runtime's float64 mode
}


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype {name} has no torch reference dtype")
    return TORCH_DTYPES[name]


@register("zeros", (), ("y",))
def _zeros_forward(*, shape, dtype="bf16", device="cpu", **_):
    return [torch.zeros(list(shape), dtype=torch_dtype(dtype), device=device)]


@register("ones", (), ("y",))
def _ones_forward(*, shape, dtype="bf16", device="cpu", **_):
    return [torch.ones(list(shape), dtype=torch_dtype(dtype), device=device)]


@register("fill", (), ("y",))
def _fill_forward(*, shape, value, dtype="bf16", device="cpu", **_):
    # fp8 has no fill kernel on CPU: fill in fp32 and round
    out = torch.full(list(shape), float(value), dtype=torch.float32, device=device)
    return [out.to(torch_dtype(dtype))]


# ------------------------------------------------------------------------------- cast
# `@dtype(T)` (§7.4.1); the backward converts d_y back to the dtype x had at forward
# (attrs["input_dtypes"], recorded like input_shapes; absent: d_y's own)
def _cast_backward(d_y, **attrs):
    source = (attrs.get("input_dtypes") or {}).get("x")
    return [d_y.to(source) if source is not None else d_y]


@register("cast", ("x",), ("y",), ("d_y",), ("d_x",), backward=_cast_backward, converts=True)
def _cast_forward(x, *, dtype, **_):
    return [x.to(torch_dtype(dtype))]
