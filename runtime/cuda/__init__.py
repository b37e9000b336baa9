"""CUDA implementations of the primitives: `CUDA_KERNELS` (runtime.cuda.kernels) maps every
primitive name to a kernel with the reference calling convention (runtime/kernels/base.py);
custom kernels live in csrc/ and are built on first use (runtime.cuda.build)."""
