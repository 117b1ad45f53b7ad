"""GGUF files (llama.cpp's format) as a model: config, tokenizer and tensors under HF names.

`LLM(model="file.gguf")`, a directory holding one, or the first part of a split set
(`name-00001-of-00003.gguf`) resolves (config/model_source.py, through the source registered
here) to a small directory beside the cache: config.json made from the file's metadata, the
tokenizer built from it, and `gguf.json` naming the weight files (model_dir.py). The loader
(models/loader.py) then opens each GGUF file as a `GGUFTensorFile` (tensors.py).

  reader.py     the header off a memory map (metadata, tensor table), which files make a model
  families.py   metadata -> HF config, per family
  names.py      llama.cpp's tensor names -> the HF names each family's loader expects
  quants.py     block types: held as stored (codes + scales, exact) or dequantized, vectorised
  tensors.py    logical tensors the loader slices per rank (experts, rows, held regions)
  tokenizer.py  the tokenizer from tokenizer.ggml.* metadata
  model_dir.py  the config / tokenizer / gguf.json directory
The weight format the config names ({"quant_method": "gguf"}) is layers/quantization/gguf.py.
"""

from expertmesh.config.model_source import register_source
from expertmesh.models.gguf.model_dir import gguf_info, gguf_model_dir
from expertmesh.models.gguf.quants import HELD, decode_blocks, held_kinds
from expertmesh.models.gguf.reader import GGUFError, gguf_files, is_gguf, open_file
from expertmesh.models.gguf.tensors import GGUFTensor, GGUFTensorFile, KvBTensor

register_source("gguf", is_gguf, gguf_model_dir)

__all__ = [
    "HELD",
    "GGUFError",
    "GGUFTensor",
    "GGUFTensorFile",
    "KvBTensor",
    "decode_blocks",
    "gguf_files",
    "gguf_info",
    "gguf_model_dir",
    "held_kinds",
    "is_gguf",
    "open_file",
]
