"""The modulec runtime: the Schedule IR interpreter.

`runtime.kernels` holds the reference kernels in torch (CPU, float64 / float32 / bfloat16),
one forward and one explicit backward per primitive of `std/primitives`; the CUDA kernels
(`csrc/`) are checked against them.
"""
