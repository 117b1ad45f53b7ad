"""The tokenizer a GGUF file's metadata describes (tokenizer.ggml.*), built by transformers.

The vocabulary and merges are read off our header reader (reader.py) and handed to transformers'
GGUF tokenizer builders (`convert_gguf_tokenizer`: by `tokenizer.ggml.model`, gpt2 byte-level BPE,
llama sentencepiece, with the pre-tokenizer split of `tokenizer.ggml.pre`), so every family gets
its tokenizer, not only those transformers maps a config for, and the file is parsed once.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from expertmesh.models.gguf.reader import GGUFFile

log = logging.getLogger("expertmesh")
STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
# tokenizer.ggml.<key> -> transformers' tokenizer_dict key (its GGUF_TOKENIZER_MAPPING)
_DICT = {"model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
         "token_type": "token_type", "merges": "merges", "precompiled_charsmap": "precompiled_charsmap",
         "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
         "padding_token_id": "pad_token_id", "add_space_prefix": "add_prefix_space"}  # fmt: skip
_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
            "pad_token": "padding_token_id"}  # fmt: skip


def tokenizer_parts(path: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(architecture, transformers' tokenizer_dict, tokenizer_config kwargs) from the metadata."""
    f = GGUFFile(path, STRING_ARRAYS)  # not cached: the vocabulary is needed once
    f.close()
    meta = f.metadata
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError("the file has no tokenizer.ggml.tokens")
    tok = {}
    for key, name in _DICT.items():
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            tok[name] = value.tolist() if hasattr(value, "tolist") else value
    config: dict[str, Any] = {}
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    for key in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{key}" in meta:
            config[key] = bool(meta[f"tokenizer.ggml.{key}"])
    if tok.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp adds BOS to sentencepiece unless told
    for name, key in _SPECIAL.items():
        i = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tok["tokens"][i] if i is not None and 0 <= i < len(tok["tokens"]) else None
    return meta["general.architecture"], tok, config


def write_tokenizer(path: str, out: str) -> bool:
    """Save the file's tokenizer into `out` as files AutoTokenizer reads; False (with a warning)
    where it cannot be built: the user passes tokenizer= or prompts token ids."""
    try:
        try:
            from transformers.integrations.gguf import convert_gguf_tokenizer
        except ImportError:  # an older transformers: its own GGUF path (a second parse of the file)
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
            tok.save_pretrained(out)
            return True
        from transformers import PreTrainedTokenizerFast

        arch, tok, config = tokenizer_parts(path)
        backend, extra = convert_gguf_tokenizer(arch, tok)
        PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra).save_pretrained(out)
        return True
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # tokenizers' Rust panics (pyo3's PanicException) are BaseExceptions
        log.warning("GGUF %s: no tokenizer from its metadata (%s); pass tokenizer= to use text", path, exc)
        return False
