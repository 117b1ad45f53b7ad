"""GGUF files (llama.cpp's format) as a model: config, tokenizer and tensors under HF names.

`LLM(model="file.gguf")`, a directory holding one, or the first part of a split set
(`name-00001-of-00003.gguf`) resolves to a small directory beside the cache (`gguf_model_dir`):
config.json made from the file's metadata, the tokenizer transformers builds from it, and
`gguf.json` naming the weight files. The loader (models/loader.py) then opens each GGUF file as a
`GGUFTensorFile`: its tensors renamed from llama.cpp's names to the HF checkpoint names the family
expects (stacked `ffn_*_exps` expert tensors served one expert at a time, so an EP rank reads only
its experts' bytes), llama.cpp's Q/K row permutation undone for llama-style architectures, and
every quantized type dequantized with `gguf.quants.dequantize` (the format's own dequantizer) for
just the rows a rank asks for. The file is read through gguf's memory map: only touched pages are
read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from expertmesh.layers.quantization.view import LogicalTensor

log = logging.getLogger("expertmesh")

SPLIT = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")
MARKER = "gguf.json"


class GGUFError(ValueError):
    pass


# ---- which files --------------------------------------------------------------------------------
def is_gguf(model: str | None) -> bool:
    """A .gguf file, or a directory holding one and no config.json."""
    if model is None:
        return False
    if os.path.isfile(model):
        return model.endswith(".gguf")
    if os.path.isdir(model) and not os.path.exists(os.path.join(model, "config.json")):
        return any(n.endswith(".gguf") for n in os.listdir(model))
    return False


def gguf_files(model: str) -> list[str]:
    """Every part of the model: one file, or all parts of a split set (named by any part)."""
    if os.path.isdir(model):
        names = sorted(n for n in os.listdir(model) if n.endswith(".gguf"))
        firsts = [n for n in names if not SPLIT.match(n) or SPLIT.match(n).group(2) == "00001"]
        if len(firsts) != 1:
            raise GGUFError(f"directory {model!r} holds {len(firsts)} GGUF models ({firsts}); name the file")
        model = os.path.join(model, firsts[0])
    m = SPLIT.match(os.path.basename(model))
    if not m:
        return [model]
    base, count = os.path.join(os.path.dirname(model), m.group(1)), int(m.group(3))
    parts = [f"{base}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [p for p in parts if not os.path.exists(p)]
    if missing:
        raise GGUFError(f"split GGUF {model!r}: missing parts {missing}")
    return parts


# ---- config from metadata -----------------------------------------------------------------------
def _fields(reader: Any) -> dict[str, Any]:
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name not in ("tokenizer.ggml.model",):
            continue  # large arrays: the tokenizer is built by transformers
        try:
            out[name] = field.contents()
        except Exception:  # an unreadable field is simply not used
            continue
    return out


def hf_config(meta: dict[str, Any]) -> dict[str, Any]:
    """An HF config dict for the architectures llama.cpp's converter writes that we run."""
    arch = meta.get("general.architecture")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    cfg: dict[str, Any] = {
        "vocab_size": get("vocab_size") or meta.get("tokenizer.ggml.vocab_size"),
        "hidden_size": get("embedding_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "rope_parameters": {"rope_theta": get("rope.freq_base", 10000.0), "rope_type": "default"},
        "intermediate_size": get("feed_forward_length"),
        "tie_word_embeddings": False,  # set by the tensors present (gguf_model_dir)
    }
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            cfg[hf] = meta[f"tokenizer.ggml.{key}"]
    if get("attention.key_length"):
        cfg["head_dim"] = get("attention.key_length")
    if arch in ("qwen3moe", "qwen2moe"):
        cfg.update(
            num_experts=get("expert_count"),
            num_local_experts=get("expert_count"),
            num_experts_per_tok=get("expert_used_count"),
            moe_intermediate_size=get("expert_feed_forward_length"),
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        if arch == "qwen3moe":
            # llama.cpp's qwen3moe always renormalises the top-k weights (as transformers notes)
            cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", norm_topk_prob=True)
            cfg["intermediate_size"] = cfg["intermediate_size"] or cfg["moe_intermediate_size"]
        else:
            cfg.update(
                architectures=["Qwen2MoeForCausalLM"],
                model_type="qwen2_moe",
                shared_expert_intermediate_size=get("expert_shared_feed_forward_length"),
                norm_topk_prob=False,
                qkv_bias=True,
            )
    elif arch == "llama" and get("expert_count"):  # Mixtral: llama.cpp writes it as llama
        cfg.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            num_local_experts=get("expert_count"),
            num_experts_per_tok=get("expert_used_count"),
        )
    elif arch == "llama":
        cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    else:
        raise GGUFError(
            f"GGUF architecture {arch!r} is not supported yet (supported: qwen3moe, qwen2moe, llama/mixtral)"
        )
    return cfg


# ---- names --------------------------------------------------------------------------------------
# llama.cpp's name piece -> the HF checkpoint's piece, per architecture; `{moe}` is the MoE block.
_ATTN = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QWEN = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# stacked expert tensors: llama.cpp piece -> (HF MoE block, per-expert projection name)
_EXPERTS = {
    "qwen": {"ffn_gate_exps": ("mlp", "gate_proj"), "ffn_up_exps": ("mlp", "up_proj"),
             "ffn_down_exps": ("mlp", "down_proj")},
    "llama": {"ffn_gate_exps": ("block_sparse_moe", "w1"), "ffn_up_exps": ("block_sparse_moe", "w3"),
              "ffn_down_exps": ("block_sparse_moe", "w2")},
}  # fmt: skip
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _pieces(arch: str) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    if arch in ("qwen2moe", "qwen3moe"):
        return {**_ATTN, **_QWEN}, _EXPERTS["qwen"]
    return {**_ATTN, "ffn_gate_inp": "block_sparse_moe.gate"}, _EXPERTS["llama"]


# ---- tensors ------------------------------------------------------------------------------------
def _undo_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of llama.cpp's converter `permute` (rotary halves interleaved per head)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


# Types held as stored in our int8 / int4 group kinds (layers/quantization/held.py), W = code * s + o
# per 32 inputs, bit for bit gguf's dequantization (q * d, and q * d + m, are exact in float32:
# an fp16 scale times a code of at most 8 bits needs 19 bits):
#   Q8_0 = d * q (q int8): int8 codes q, scale d, offset 0
#   Q4_0 = d * (q - 8) (q 0..15): int4 codes q, scale d, offset -8 d
#   Q4_1 = d * q + m: int4 codes q, scale d, offset m
HELD = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


class GGUFTensor(LogicalTensor):
    """One GGUF tensor (or one expert of a stacked one) in HF orientation [out, in]; indexing reads
    and dequantizes only the rows asked for (whole heads for a permuted Q/K weight). Q8_0, Q4_0 and
    Q4_1 matrices say how they map onto our held kinds (`held_kind`, `quantized`)."""

    def __init__(self, data: np.ndarray, qtype: Any, shape: tuple[int, ...], key: str, permute: int = 0):
        from gguf import GGMLQuantizationType as Q

        self.data, self.qtype, self.shape, self.base, self.permute = data, qtype, shape, key, permute
        self.dtype = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}.get(qtype, torch.float32)
        # the head and embedding take float weights (the head's kernels are not the held ones)
        if (
            qtype.name in HELD
            and len(shape) == 2
            and not permute
            and not key.startswith(("lm_head", "model.embed"))
        ):
            self.held_kind = (HELD[qtype.name], 32)

    def quantized(self, rows: tuple[int, int], cols: tuple[int, int], group: int, g0: int) -> tuple:
        """Codes [o, i] uint8, scales and offsets [o, groups] float32 of the region (whole blocks)."""
        (o0, o1), (i0, i1) = rows, cols
        b0, b1 = i0 // 32, -(-i1 // 32)
        # whole blocks, or (group = the region: a rank's part of a 32-wide row) inside one block
        if (group == 32 and i0 % 32) or (group != 32 and b1 - b0 != 1):
            raise ValueError(
                f"{self.base}: GGUF {self.qtype.name} blocks are 32 inputs; asked {group} at {i0}"
            )
        raw = np.asarray(self.data[o0:o1]).reshape(o1 - o0, -1, BLOCK_BYTES[self.qtype.name])[:, b0:b1]
        raw = np.array(raw)  # a copy: the memory map is read-only

        def half(at: int) -> torch.Tensor:  # the fp16 field at byte `at` of every block, as float32
            return torch.from_numpy(
                np.ascontiguousarray(raw[..., at : at + 2]).view(np.float16)[..., 0]
            ).float()

        d = half(0)
        raw = torch.from_numpy(raw)
        if self.qtype.name == "Q8_0":
            codes = raw[..., 2:].reshape(o1 - o0, -1)
            return codes[:, i0 - b0 * 32 : i1 - b0 * 32], d, torch.zeros_like(d)
        qs = raw[..., 4:] if self.qtype.name == "Q4_1" else raw[..., 2:]
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(o1 - o0, -1)[:, i0 - b0 * 32 : i1 - b0 * 32]
        if self.qtype.name == "Q4_1":
            return codes, d, half(2)
        return codes, d, -8 * d

    def _rows(self, r0: int, r1: int) -> torch.Tensor:
        from gguf import GGMLQuantizationType as Q
        from gguf.quants import dequantize

        raw = np.asarray(self.data[r0:r1] if self.shape else self.data)
        if self.qtype in (Q.F32, Q.F16):
            return torch.from_numpy(raw.copy())
        if self.qtype == Q.BF16:
            return torch.from_numpy(raw.copy()).view(torch.int16).view(torch.bfloat16)
        return torch.from_numpy(dequantize(raw, self.qtype).astype(np.float32, copy=False))

    def materialize(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        if not bounds:
            return self._rows(0, 0).reshape(())
        (r0, r1), rest = bounds[0], bounds[1:]
        if self.permute:  # rows mix within a head: un-permute the whole tensor, then cut
            t = _undo_permute(self._rows(0, self.shape[0]), self.permute)[r0:r1]
        else:
            t = self._rows(r0, r1)
        t = t.reshape(r1 - r0, *self.shape[1:])
        return t[(slice(None), *(slice(a, b) for a, b in rest))].contiguous() if rest else t


class GGUFTensorFile:
    """One GGUF file's tensors under HF names (the part of safe_open the loader uses)."""

    def __init__(self, path: str, info: dict[str, Any]) -> None:
        from gguf import GGUFReader

        self.path = path
        try:
            self.reader = GGUFReader(path, "r")
        except Exception as exc:
            raise GGUFError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
        self.tensors: dict[str, tuple[Any, int | None, int]] = {}  # key -> (tensor, expert, heads)
        arch, heads, kv = info["arch"], info["num_attention_heads"], info["num_key_value_heads"]
        pieces, experts = _pieces(arch)
        logged: set[str] = set()
        for t in self.reader.tensors:
            if t.tensor_type.name not in ("F32", "F16", "BF16") and t.tensor_type.name not in logged:
                logged.add(t.tensor_type.name)
                log.info(
                    "GGUF %s: %s tensors dequantized at load", os.path.basename(path), t.tensor_type.name
                )
            name, hf = t.name, None
            top = name.rsplit(".", 1)
            if top[0] in _TOP:
                hf = f"{_TOP[top[0]]}.{top[1]}"
            m = BLOCK.match(name)
            if m:
                layer, piece, kind = m.groups()
                if piece in experts:
                    block, proj = experts[piece]
                    for e in range(int(t.shape[-1])):
                        key = f"model.layers.{layer}.{block}.experts.{e}.{proj}.{kind}"
                        self.tensors[key] = (t, e, 0)
                    continue
                if piece in pieces:
                    hf = f"model.layers.{layer}.{pieces[piece]}.{kind}"
            if hf is None:
                raise GGUFError(f"{path}: tensor {name!r} has no HF name for architecture {arch!r}")
            permute = 0
            if arch == "llama" and piece_of(name) in ("attn_q", "attn_k") and name.endswith(".weight"):
                permute = heads if piece_of(name) == "attn_q" else kv
            self.tensors[hf] = (t, None, permute)

    def __enter__(self) -> GGUFTensorFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.reader = None

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_slice(self, key: str) -> GGUFTensor:
        if key not in self.tensors:
            raise KeyError(f"{self.path} has no tensor {key!r}")
        t, e, permute = self.tensors[key]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # numpy order: HF's [out, in]
        data = t.data
        if e is not None:
            shape, data = shape[1:], data[e]
        elif key.endswith("shared_expert_gate.weight") and len(shape) == 1:  # llama.cpp: a vector [H]
            shape, data = (1, *shape), data[None]
        return GGUFTensor(data, t.tensor_type, shape, key, permute)


def piece_of(name: str) -> str:
    m = BLOCK.match(name)
    return m.group(2) if m else ""


# ---- the weight format --------------------------------------------------------------------------
@dataclass(frozen=True)
class GGUFFormat:
    """quantization_config {"quant_method": "gguf"}: Q8_0 / Q4_0 / Q4_1 matrices held as int8 / int4
    codes with a scale and offset per 32 inputs; every other type dequantized at load."""

    held_types: tuple[str, ...] = ()
    method: str = "gguf"
    online: bool = False
    holds_compressed = True

    @classmethod
    def from_config(cls, cfg: dict) -> GGUFFormat:
        return cls(tuple(cfg.get("held_types", ())))

    def describe(self) -> str:
        return f"gguf, {'/'.join(self.held_types) or 'no'} matrices held as int codes (groups of 32)"

    def name(self) -> str:
        return "gguf"

    def view(self, handles: dict[str, Any]) -> Any:
        from expertmesh.layers.quantization.view import CheckpointView

        class GGUFView(CheckpointView):
            def get_slice(self, key: str) -> Any:  # codes where the plan holds the key
                return self.serve(key, self.stored(key))

        return GGUFView(handles)


# ---- the model directory ------------------------------------------------------------------------
def _cache_root() -> str:
    if os.environ.get("EXPERTMESH_GGUF_DIR"):
        return os.environ["EXPERTMESH_GGUF_DIR"]
    root = os.environ.get("EXPERTMESH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "expertmesh"
    )
    return os.path.join(root, "gguf")


def gguf_model_dir(model: str) -> str:
    """A directory the engine loads like a checkpoint: config.json, tokenizer, gguf.json."""
    from gguf import GGUFReader

    files = [os.path.abspath(p) for p in gguf_files(model)]
    stamp = json.dumps([(p, os.path.getsize(p), os.path.getmtime(p)) for p in files])
    out = os.path.join(_cache_root(), hashlib.sha256(stamp.encode()).hexdigest()[:16])
    if os.path.exists(os.path.join(out, MARKER)):
        return out
    try:
        reader = GGUFReader(files[0], "r")
    except Exception as exc:
        raise GGUFError(f"{files[0]}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    meta = _fields(reader)
    cfg = hf_config(meta)
    names = {t.name for t in reader.tensors}
    for p in files[1:]:
        names |= {t.name for t in GGUFReader(p, "r").tensors}
    cfg["tie_word_embeddings"] = "output.weight" not in names
    if cfg.get("vocab_size") is None:
        emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
        cfg["vocab_size"] = int(emb.shape[-1])
    if cfg["architectures"][0] == "Qwen2MoeForCausalLM":
        cfg["qkv_bias"] = "blk.0.attn_q.bias" in names
    cfg["torch_dtype"] = "float32"
    held = sorted({t.tensor_type.name for t in reader.tensors} & set(HELD))
    if held:  # the loader holds these codes as stored (GGUFFormat); quantization="dequantize" does not
        cfg["quantization_config"] = {"quant_method": "gguf", "held_types": held}
    os.makedirs(out, exist_ok=True)
    tmp = f"{out}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    _write_tokenizer(files[0], tmp)
    info = {
        "files": files,
        "arch": meta["general.architecture"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
    }
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(info, f, indent=1)
    for n in sorted(os.listdir(tmp), key=lambda n: n == MARKER):  # the marker last: complete
        os.replace(os.path.join(tmp, n), os.path.join(out, n))
    os.rmdir(tmp)
    log.info("GGUF %s: %s, config and tokenizer in %s", files[0], cfg["architectures"][0], out)
    return out


def _write_tokenizer(path: str, out: str) -> None:
    """transformers' tokenizer from the GGUF metadata, saved as files AutoTokenizer reads."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        tok.save_pretrained(out)
    except Exception as exc:  # a tokenizer transformers cannot build: token ids, or tokenizer=
        log.warning("GGUF %s: no tokenizer from its metadata (%s); pass tokenizer= to use text", path, exc)


def gguf_info(model_dir: str) -> dict[str, Any] | None:
    marker = os.path.join(model_dir, MARKER)
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        return json.load(f)
