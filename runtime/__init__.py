"""The modulec runtime: the Schedule IR interpreter.

`runtime.kernels` holds the reference kernels in torch (CPU, float64 / float32 / bfloat16),
one forward and one explicit backward per primitive of `std/primitives`; the CUDA kernels
(`csrc/`) are checked against them.
"""


def __getattr__(name: str):
    """`from runtime import Model` without importing torch for `import runtime`."""
    if name == "Model":
        from runtime.model import Model

        return Model
    raise AttributeError(name)
