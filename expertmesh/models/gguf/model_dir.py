"""The small directory a GGUF model loads from like a checkpoint: config.json from the metadata
(families.py), the tokenizer (tokenizer.py) and gguf.json naming the weight files, under
`$EXPERTMESH_GGUF_DIR` or `~/.cache/expertmesh/gguf/<hash of the files' paths, sizes, times>/`."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import numpy as np

from expertmesh.models.gguf.families import CONFIG_TENSORS, TENSOR_FLAGS, hf_config, rope_config
from expertmesh.models.gguf.names import mtp_block
from expertmesh.models.gguf.quants import HELD, held_kinds
from expertmesh.models.gguf.reader import gguf_files, open_file
from expertmesh.models.gguf.tokenizer import write_tokenizer

log = logging.getLogger("expertmesh")
MARKER = "gguf.json"
# in the cache key: a directory written by an engine that planned the held kinds otherwise is not
# reused (2: the experts' down projection in its own group, quants.held_kinds)
INFO_VERSION = 2


def _cache_root() -> str:
    if os.environ.get("EXPERTMESH_GGUF_DIR"):
        return os.environ["EXPERTMESH_GGUF_DIR"]
    root = os.environ.get("EXPERTMESH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "expertmesh"
    )
    return os.path.join(root, "gguf")


def gguf_model_dir(model: str) -> str:
    """A directory the engine loads like a checkpoint: config.json, tokenizer, gguf.json."""
    files = [os.path.abspath(p) for p in gguf_files(model)]
    stamp = json.dumps([INFO_VERSION, *((p, os.path.getsize(p), os.path.getmtime(p)) for p in files)])
    out = os.path.join(_cache_root(), hashlib.sha256(stamp.encode()).hexdigest()[:16])
    if os.path.exists(os.path.join(out, MARKER)):
        return out
    first = open_file(files[0])
    meta = first.metadata
    cfg = hf_config(meta)
    types = {t.name: t.tensor_type.name for t in first.tensors}
    for p in files[1:]:
        types.update({t.name: t.tensor_type.name for t in open_file(p).tensors})
    names = set(types)
    cfg["tie_word_embeddings"] = "output.weight" not in names
    if cfg.get("vocab_size") is None:
        emb = next(t for t in first.tensors if t.name == "token_embd.weight")
        cfg["vocab_size"] = emb.shape[0]
    if cfg["architectures"][0] == "Qwen2MoeForCausalLM":
        cfg["qkv_bias"] = "blk.0.attn_q.bias" in names
    for key, tensor in TENSOR_FLAGS.get(meta["general.architecture"], {}).items():
        cfg[key] = tensor in names
    factors = {
        t.name: np.asarray(t.data, np.float64).tolist() for t in first.tensors if t.name in CONFIG_TENSORS
    }
    if (rope := rope_config(meta, factors)) is not None:
        cfg.pop("rope_parameters", None)
        cfg["rope_scaling"] = rope
    cfg["torch_dtype"] = "float32"
    held = sorted(set(types.values()) & set(HELD))
    if held:  # the loader holds these codes as stored (GGUFFormat); quantization="dequantize" does not
        cfg["quantization_config"] = {"quant_method": "gguf", "held_types": held}
    os.makedirs(out, exist_ok=True)
    tmp = f"{out}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    write_tokenizer(files[0], tmp)
    main = {n: t for n, t in types.items() if not mtp_block(n, cfg["num_hidden_layers"])}
    info = {
        "files": files,
        "arch": meta["general.architecture"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "held_kinds": held_kinds(main),
    }
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(info, f, indent=1)
    for n in sorted(os.listdir(tmp), key=lambda n: n == MARKER):  # the marker last: complete
        os.replace(os.path.join(tmp, n), os.path.join(out, n))
    os.rmdir(tmp)
    log.info("GGUF %s: %s, config and tokenizer in %s", files[0], cfg["architectures"][0], out)
    return out


def gguf_info(model_dir: str) -> dict[str, Any] | None:
    marker = os.path.join(model_dir, MARKER)
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        return json.load(f)
