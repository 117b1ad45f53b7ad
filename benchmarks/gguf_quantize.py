"""Quantize a GGUF file with llama.cpp's own quantizer (llama_model_quantize through
llama-cpp-python; run under a python that has it), e.g. an F32 file from gguf_convert.py to Q4_K_M:

    /work/peers/llamacpp/bin/python benchmarks/gguf_quantize.py in-f32.gguf out-Q4_K_M.gguf Q4_K_M
"""

from __future__ import annotations

import ctypes
import sys


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    import llama_cpp

    src, dst, ftype = sys.argv[1:]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 1
    sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))


if __name__ == "__main__":
    main()
