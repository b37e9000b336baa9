"""Tensor types: a shape of dimensions (possibly with variadic leading dims) and a dtype."""

from __future__ import annotations

from dataclasses import dataclass

from modulec.types.dims import Dim

FLOAT_DTYPES = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
INT_DTYPES = ("int32", "int8", "int4")
DTYPES = FLOAT_DTYPES + INT_DTYPES
BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8_e4m3": 8, "fp8_e5m2": 8, "fp4_e2m1": 4,
        "int32": 32, "int8": 8, "int4": 4}
FLOAT = "float"  # a floating tensor whose storage dtype the precision policy decides
# the most dims a tensor type may have (docs/decisions.md, "Sizes"): models use a handful;
# shape checks multiply dims symbolically, and 20,000 of them took minutes
MAX_RANK = 64


@dataclass(frozen=True)
class TensorType:
    """`dims` after any variadic prefix; `prefix` is None for a fixed rank, or the tuple of
    leading dims a variadic `*` stands for once known. `variadic` marks an unbound `*`."""

    dims: tuple[Dim, ...]
    dtype: str = FLOAT
    variadic: bool = False

    @property
    def rank(self) -> int | None:
        return None if self.variadic else len(self.dims)

    @property
    def is_float(self) -> bool:
        return self.dtype == FLOAT or self.dtype in FLOAT_DTYPES

    @property
    def is_int(self) -> bool:
        return self.dtype in INT_DTYPES

    def with_dims(self, dims) -> "TensorType":
        return TensorType(tuple(dims), self.dtype, False)

    def with_dtype(self, dtype: str) -> "TensorType":
        return TensorType(self.dims, dtype, self.variadic)

    def numel(self) -> Dim:
        total = Dim.const(1)
        for dim in self.dims:
            total = total * dim
        return total

    def __str__(self) -> str:
        parts = (["*"] if self.variadic else []) + [str(d) for d in self.dims]
        if self.dtype != FLOAT:
            parts.append(self.dtype)
        return "[" + ", ".join(parts) + "]"


def scalar(dtype: str = FLOAT) -> TensorType:
    return TensorType((), dtype)


def narrower(dtype: str, than: str) -> bool:
    """True when storing a `than` value as `dtype` loses precision (W005)."""
    if FLOAT in (dtype, than):
        return False
    return BITS[dtype] < BITS[than]
