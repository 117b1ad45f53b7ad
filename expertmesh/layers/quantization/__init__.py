"""Weight formats: quantized checkpoints read (fp8, mxfp4) and online quantization (int8, int4, fp8
weight-only; w8a8, w4a8 with int8 activations) held compressed for the CPU kernels. See
registry.py for what is supported."""

from expertmesh.layers.quantization.registry import CHECKPOINT_FORMATS, checkpoint_format, resolve

__all__ = ["CHECKPOINT_FORMATS", "checkpoint_format", "resolve"]
