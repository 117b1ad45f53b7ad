"""Write a random-weight Qwen3-30B-A3B (its published config.json: tests/real_configs/) as a
Q4_K_M-like GGUF file, streaming: each tensor's blocks are made and written one at a time, so
neither memory nor disk ever holds a full-precision copy.

The mix is llama.cpp's Q4_K_M rule (llama-quant.cpp): Q4_K everywhere, Q6_K for attn_v and
ffn_down(_exps) in the layers its `use_more_bits` picks (the first and last eighth, every third
between) and for the head; the router and norms F32. Blocks are random codes with fp16 scales
chosen so weights have the published init's spread (W = d * sc * (q - 7.5) for Q4_K, centred
codes for Q6_K), so activations stay finite over any number of layers.

`--layers N` writes N of the 48 layers, spread evenly over the published depth (layer i of the
slice is published layer i * 48 // N and takes that layer's Q4_K_M types), so a slice has the
full model's mix of Q4_K and Q6_K layers. The vocabulary is placeholder tokens: the benchmark
feeds token ids.

    python benchmarks/write_published_size.py --out /work/bigfiles/qwen3-30b-a3b-Q4_K_M.gguf
    python benchmarks/write_published_size.py --layers 12 --out /work/bigfiles/qwen3-12of48.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import time

import gguf
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "tests", "real_configs", "qwen3-30b-a3b.json")
Q = gguf.GGMLQuantizationType
ROWS_AT_ONCE = 1 << 14  # blocks are made this many rows at a time (tens of MB)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of layers that get Q6_K in Q4_K_M (llama-quant.cpp)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins a block -> Q4_K's 12 bytes (inverse of gguf's get_scale_min)."""
    hi_sc, hi_m = sc[:, 4:], m[:, 4:]
    return np.concatenate(
        [sc[:, :4] | ((hi_sc >> 4) << 6), m[:, :4] | ((hi_m >> 4) << 6), (hi_sc & 15) | ((hi_m & 15) << 4)],
        axis=-1,
    ).astype(np.uint8)


def random_blocks(qtype: str, n: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """n random blocks [n, bytes] of Q4_K or Q6_K whose values have about `std` spread."""
    if qtype == "Q4_K":
        sc = rng.integers(32, 64, (n, 8), dtype=np.uint8)
        # W = d * sc * q - dmin * m with dmin * m = 7.5 * d * sc: m = sc, dmin = 7.5 d
        d = np.full((n, 1), std / 4.6 / 48, np.float32)  # uniform codes: std of (q - 7.5) is 4.6
        head = np.concatenate(
            [d.astype(np.float16).view(np.uint8), (7.5 * d).astype(np.float16).view(np.uint8)], -1
        )
        qs = rng.integers(0, 256, (n, 128), dtype=np.uint8)
        return np.concatenate([head, _pack_scales(sc, sc), qs], axis=-1)
    assert qtype == "Q6_K"
    ql = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    qh = rng.integers(0, 256, (n, 64), dtype=np.uint8)
    sc = rng.integers(32, 64, (n, 16), dtype=np.int8)
    d = np.full((n, 1), std / 18.5 / 48, np.float16)  # codes - 32 uniform in [-32, 31]: std 18.5
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8)], axis=-1)


def tensors(cfg: dict, layers: list[int]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy-order shape [.., out, in], type) of every tensor, in llama.cpp's order."""
    h, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hd, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    e, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
    out = [("token_embd.weight", (v, h), "Q4_K"), ("output_norm.weight", (h,), "F32"),
           ("output.weight", (v, h), "Q6_K")]  # fmt: skip
    for i, src in enumerate(layers):
        more = "Q6_K" if use_more_bits(src, n) else "Q4_K"
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", (h,), "F32"), (p + "attn_q.weight", (heads * hd, h), "Q4_K"),
            (p + "attn_k.weight", (kv * hd, h), "Q4_K"), (p + "attn_v.weight", (kv * hd, h), more),
            (p + "attn_output.weight", (h, heads * hd), "Q4_K"), (p + "attn_q_norm.weight", (hd,), "F32"),
            (p + "attn_k_norm.weight", (hd,), "F32"), (p + "ffn_norm.weight", (h,), "F32"),
            (p + "ffn_gate_inp.weight", (e, h), "F32"), (p + "ffn_gate_exps.weight", (e, inter, h), "Q4_K"),
            (p + "ffn_up_exps.weight", (e, inter, h), "Q4_K"),
            (p + "ffn_down_exps.weight", (e, h, inter), more),
        ]  # fmt: skip
    return out


def placeholder_vocabulary(w: gguf.GGUFWriter, vocab: int) -> None:
    """Placeholder tokens `<ti>` as a gpt2 BPE vocabulary: the benchmarks feed token ids."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"<t{i}>" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges(["<t1> <t2>"])  # llama.cpp needs merges; ids are fed, never text


def qwen3moe_header(w: gguf.GGUFWriter, cfg: dict, n_layers: int, file_type: gguf.LlamaFileType) -> None:
    """llama.cpp's qwen3moe metadata of a Qwen3-MoE config with n_layers, the placeholder vocabulary."""
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(file_type)
    placeholder_vocabulary(w, cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])


def write(out: str, n_layers: int | None, seed: int = 0) -> dict:
    cfg = json.load(open(CONFIG))
    total = cfg["num_hidden_layers"]
    layers = list(range(total)) if not n_layers else [i * total // n_layers for i in range(n_layers)]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(out, "qwen3moe")
    qwen3moe_header(w, cfg, len(layers), gguf.LlamaFileType.MOSTLY_Q4_K_M)
    plan = tensors(cfg, layers)
    for name, shape, qtype in plan:
        if qtype == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
            continue
        block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]
        byte_shape = (*shape[:-1], shape[-1] // block * size)  # the writer takes quantized tensors as bytes
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), Q[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    std = cfg["initializer_range"]
    written = 0
    for name, shape, qtype in plan:
        if qtype == "F32":
            arr = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            if "ffn_gate_inp" in name:
                arr = (std * rng.standard_normal(shape)).astype(np.float32)
            w.write_tensor_data(arr)
            written += arr.nbytes
            continue
        rows, cols = int(np.prod(shape[:-1])), shape[-1]
        per_row = cols // 256
        # one tensor's bytes, made a few thousand rows at a time, written in one call: gguf's
        # writer takes a tensor whole (an expert stack of Qwen3-30B-A3B is under 200 MB)
        data = np.empty((rows, per_row * gguf.GGML_QUANT_SIZES[Q[qtype]][1]), np.uint8)
        for r in range(0, rows, ROWS_AT_ONCE):
            k = min(ROWS_AT_ONCE, rows - r)
            data[r : r + k] = random_blocks(qtype, k * per_row, std, rng).reshape(k, -1)
        w.write_tensor_data(data)
        written += data.nbytes
        del data
    w.close()
    return {"path": out, "layers": layers, "bytes": written}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=0, help="a slice of this many layers (0: all 48)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    info = write(args.out, args.layers or None, args.seed)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
