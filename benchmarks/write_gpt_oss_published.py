"""Write a random-weight gpt-oss-20b (its published config.json: tests/real_configs/) twice from the
same codes: as the published MXFP4 safetensors checkpoint (`*_blocks` / `*_scales` experts, bf16
rest) and as the GGUF file llama.cpp's converter makes of it (ggml MXFP4 experts, gate / up split,
bf16 rest, `--outtype bf16`), streaming: one layer's tensors at a time, written to both.

Expert codes are random e2m1 nibbles with the block scale 2^-7 (values' spread ~0.023, about the
published init's 0.02), attention and router weights normal(0, 0.02) in bf16, norms ~1, biases and
sinks small, so activations stay finite over any depth. `--layers N` keeps the first N of the 24
layers (all alike but for the sliding / full alternation, which the slice keeps); `--vocab V`
shrinks the 201,088-token vocabulary (the embedding and head are 1.16 GB each in bf16). The
vocabulary is placeholder tokens: the benchmarks feed token ids.

    python benchmarks/write_gpt_oss_published.py --layers 2 --vocab 32768 --out /work/bigfiles/gpt-oss-2of24
    python benchmarks/bench_gguf_load.py --file /work/bigfiles/gpt-oss-2of24.gguf \\
        --safetensors /work/bigfiles/gpt-oss-2of24 --quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "tests", "real_configs", "gpt-oss-20b.json")
sys.path.insert(0, os.path.join(ROOT, "tests"))
from gguf_checkpoints import gpt_oss_metadata  # noqa: E402  (the test writer's keys: one source)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from write_published_size import placeholder_vocabulary  # noqa: E402

Q = gguf.GGMLQuantizationType
SCALE = 127 - 7  # e8m0 block scale 2^-7


def to_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Checkpoint MXFP4 (byte k: values 2k low, 2k + 1 high) -> ggml MXFP4 blocks of 17 bytes (the
    scale, then byte j: value j low, value j + 16 high), rows [..., G * 17]."""
    codes = np.stack([blocks & 15, blocks >> 4], -1).reshape(*blocks.shape[:-1], 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales[..., None], packed], -1).astype(np.uint8)
    return out.reshape(*out.shape[:-2], -1)


def layer_tensors(cfg: dict, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """One layer's checkpoint tensors (HF names under the layer)."""
    h, e, inter = cfg["hidden_size"], cfg["num_local_experts"], cfg["intermediate_size"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * std).to(torch.bfloat16)

    t = {
        "input_layernorm.weight": 1 + normal(h, std=0.1),
        "post_attention_layernorm.weight": 1 + normal(h, std=0.1),
    }
    for name, out in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
        t[f"self_attn.{name}.weight"], t[f"self_attn.{name}.bias"] = normal(out, h), normal(out)
    t["self_attn.o_proj.weight"], t["self_attn.o_proj.bias"] = normal(h, heads * hd), normal(h)
    t["self_attn.sinks"] = normal(heads, std=0.5)
    t["mlp.router.weight"], t["mlp.router.bias"] = normal(e, h), normal(e)
    for name, out, inp in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
        t[f"mlp.experts.{name}_blocks"] = torch.from_numpy(
            rng.integers(0, 256, (e, out, inp // 32, 16), np.uint8)
        )
        t[f"mlp.experts.{name}_scales"] = torch.full((e, out, inp // 32), SCALE, dtype=torch.uint8)
        t[f"mlp.experts.{name}_bias"] = normal(e, out)
    return t


def _bf16_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint8)


def gguf_tensors(t: dict[str, torch.Tensor], i: int) -> list[tuple[str, np.ndarray, Q]]:
    """One layer as the converter writes it: (name, array as written, ggml type)."""
    p = f"blk.{i}."
    out = [(p + "attn_norm.weight", t["input_layernorm.weight"].float().numpy(), Q.F32)]
    out.append(
        (p + "post_attention_norm.weight", t["post_attention_layernorm.weight"].float().numpy(), Q.F32)
    )
    for hf, name in (
        ("q_proj", "attn_q"),
        ("k_proj", "attn_k"),
        ("v_proj", "attn_v"),
        ("o_proj", "attn_output"),
    ):
        out.append((p + name + ".weight", _bf16_bytes(t[f"self_attn.{hf}.weight"]), Q.BF16))
        out.append((p + name + ".bias", t[f"self_attn.{hf}.bias"].float().numpy(), Q.F32))
    out.append((p + "attn_sinks.weight", t["self_attn.sinks"].float().numpy(), Q.F32))
    out.append((p + "ffn_gate_inp.weight", t["mlp.router.weight"].float().numpy(), Q.F32))
    out.append((p + "ffn_gate_inp.bias", t["mlp.router.bias"].float().numpy(), Q.F32))
    gu_b, gu_s = t["mlp.experts.gate_up_proj_blocks"].numpy(), t["mlp.experts.gate_up_proj_scales"].numpy()
    bias = t["mlp.experts.gate_up_proj_bias"].float().numpy()
    out.append((p + "ffn_gate_exps.weight", to_ggml(gu_b[:, ::2], gu_s[:, ::2]), Q.MXFP4))
    out.append((p + "ffn_up_exps.weight", to_ggml(gu_b[:, 1::2], gu_s[:, 1::2]), Q.MXFP4))
    out.append((p + "ffn_gate_exps.bias", np.ascontiguousarray(bias[:, ::2]), Q.F32))
    out.append((p + "ffn_up_exps.bias", np.ascontiguousarray(bias[:, 1::2]), Q.F32))
    d_b, d_s = t["mlp.experts.down_proj_blocks"].numpy(), t["mlp.experts.down_proj_scales"].numpy()
    out.append((p + "ffn_down_exps.weight", to_ggml(d_b, d_s), Q.MXFP4))
    out.append((p + "ffn_down_exps.bias", t["mlp.experts.down_proj_bias"].float().numpy(), Q.F32))
    return out


def write(out: str, n_layers: int | None, vocab: int | None, seed: int = 0) -> dict:
    cfg = json.load(open(CONFIG))
    total = cfg["num_hidden_layers"]
    layers = list(range(n_layers or total))  # the first N: every layer is alike but for its type
    cfg.update(num_hidden_layers=len(layers), layer_types=cfg["layer_types"][: len(layers)])
    if vocab:
        cfg.update(vocab_size=vocab, eos_token_id=min(cfg["eos_token_id"], vocab - 1),
                   pad_token_id=min(cfg["pad_token_id"], vocab - 1))  # fmt: skip
    # llama.cpp's gpt-oss slides on even layers: the published alternation, kept by the slice
    assert cfg["layer_types"] == [("sliding_attention", "full_attention")[i % 2] for i in range(len(layers))]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(out + ".gguf", "gpt-oss")
    gpt_oss_metadata(w, cfg, len(layers))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    placeholder_vocabulary(w, v)
    w.add_eos_token_id(cfg["eos_token_id"])
    # the tensor table first (shapes known), then each tensor's bytes as it is made
    probe = np.random.default_rng(0)
    small = {**cfg, "num_local_experts": 1}
    plan = [("token_embd.weight", (v, 2 * h), Q.BF16), ("output_norm.weight", (h,), Q.F32),
            ("output.weight", (v, 2 * h), Q.BF16)]  # fmt: skip
    one = gguf_tensors(layer_tensors(small, probe), 0)  # names, shapes, types (one expert)
    e = cfg["num_local_experts"]
    for i in range(len(layers)):
        for name, arr, kind in one:
            shape = (e, *arr.shape[1:]) if "_exps" in name or "gate_inp" in name else arr.shape
            plan.append((f"blk.{i}.{name[len('blk.0.') :]}", shape, kind))
    for name, shape, kind in plan:
        dtype = np.dtype(np.float32) if kind == Q.F32 else np.dtype(np.uint8)
        w.add_tensor_info(
            name, shape, dtype, int(np.prod(shape)) * dtype.itemsize, None if kind == Q.F32 else kind
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    index, written = {}, 0

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, os.path.join(out, name))
        index.update({k: name for k in tensors})

    for key, gname in (
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("lm_head.weight", "output.weight"),
    ):
        t = torch.from_numpy(rng.standard_normal((v, h), dtype=np.float32) * 0.02).to(torch.bfloat16)
        shard(f"{gname.split('.')[0]}.safetensors", {key: t})
        if key == "model.embed_tokens.weight":
            w.write_tensor_data(_bf16_bytes(t))
            norm = (1 + rng.standard_normal(h, dtype=np.float32) * 0.1).astype(np.float32)
            shard("norm.safetensors", {"model.norm.weight": torch.from_numpy(norm).to(torch.bfloat16)})
            w.write_tensor_data(torch.from_numpy(norm).to(torch.bfloat16).float().numpy())
        else:
            w.write_tensor_data(_bf16_bytes(t))
        written += 2 * t.numel()
    for i in range(len(layers)):
        t = layer_tensors(cfg, rng)
        shard(f"layer-{i:03d}.safetensors", {f"model.layers.{i}.{k}": x for k, x in t.items()})
        for _name, arr, _ in gguf_tensors(t, i):
            w.write_tensor_data(np.ascontiguousarray(arr))
            written += arr.nbytes
        del t
    w.close()
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)
    open(os.path.join(out, "READY"), "w").close()  # bench_gguf_load.py takes the directory as it is
    return {"safetensors": out, "gguf": out + ".gguf", "layers": layers, "vocab": v, "gguf_bytes": written}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the checkpoint directory; the GGUF file is <out>.gguf")
    ap.add_argument("--layers", type=int, default=0, help="a slice of this many layers (0: all 24)")
    ap.add_argument("--vocab", type=int, default=0, help="a smaller vocabulary (0: the published 201,088)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    info = write(args.out, args.layers or None, args.vocab or None, args.seed)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
