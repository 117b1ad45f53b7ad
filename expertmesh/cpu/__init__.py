"""The CPU backend: our C kernels (csrc/, built on first use), their ctypes entry
points, which matmul serves a weight (oneDNN / AMX, the panel GEMM), whole decode steps in one
native call, and large weights on huge pages. Layers reach it through the weights they hold."""
