"""Write random-weight Qwen3-30B-A3B (its published config.json: tests/real_configs/) twice with the
same int4 codes and scales: as a compressed-tensors W4A16 checkpoint (llm-compressor's
`pack-quantized`, symmetric int4 in groups of 128, what the published W4A16 quants of this model
use) for expertmesh, and as a Q4_0 GGUF for llama.cpp. Streaming: each tensor is made, written to
both, and dropped; no full-precision copy in memory or on disk.

The two formats hold the same weights exactly: a group of 128 with scale s is four Q4_0 blocks of
32 with d = s (each scale is chosen exact in both bf16 and fp16: 2^-8 * (1 + k/8)), and a code
q in [-8, 7] is compressed-tensors' q + 8 packed eight to an int32 (value j of a word in bits
4j..4j+3) and Q4_0's nibble q + 8 (value j of a block in byte j's low nibble, value j + 16 in its
high one); both dequantize to q * s. The linear layers (attention and experts) are int4; the
embedding and head are bf16 in the checkpoint (the published W4A16 quants leave the head
unquantized) and F16 in the GGUF (the same values: each is drawn exact in both; llama.cpp's F16
kernels are its fast 16-bit path on CPUs), the router and norms bf16 (F32 in the GGUF).

    python benchmarks/write_qwen3_int4.py --out /work/bigfiles/qwen3-30b-a3b-w4a16
    # -> /work/bigfiles/qwen3-30b-a3b-w4a16/ (safetensors, ~16.9 GB) and qwen3-30b-a3b-w4a16.gguf (~17.7 GB)
    python benchmarks/write_qwen3_int4.py --layers 2 --out /tmp/qwen3-w4a16-2of48     # a slice, a minute
    python benchmarks/write_qwen3_int4.py --only ct --out ...   # one of the two (then --only gguf)
    python benchmarks/bench_published_size.py --file /work/bigfiles/qwen3-30b-a3b-w4a16.gguf \
        --expertmesh-model /work/bigfiles/qwen3-30b-a3b-w4a16
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time

import gguf
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from write_published_size import qwen3moe_header  # noqa: E402  (one writer of the qwen3moe keys)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "tests", "real_configs", "qwen3-30b-a3b.json")
GROUP = 128  # compressed-tensors' W4A16 preset
Q4_0_BLOCK = 32
Q = gguf.GGMLQuantizationType


# ---- one int4 weight in both layouts -------------------------------------------------------------
def int4_weight(rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random packed codes [rows, cols / 2] (byte b: value 2b in the low nibble, 2b + 1 in the high,
    each q + 8) and float32 scales [rows, cols / GROUP], exact in bf16 and fp16."""
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scales = (2.0**-8 * (1 + rng.integers(0, 8, (rows, cols // GROUP)) / 8)).astype(np.float32)
    return packed, scales


def as_q4_0(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The same weight as Q4_0 blocks, bytes [rows, cols / 32 * 18]: fp16 d, then 16 bytes whose
    low nibbles are values 0-15 of the block and high nibbles 16-31."""
    rows, cols = packed.shape[0], packed.shape[1] * 2
    values = np.empty((rows, cols), np.uint8)
    values[:, 0::2] = packed & 15
    values[:, 1::2] = packed >> 4
    blocks = values.reshape(rows, cols // Q4_0_BLOCK, Q4_0_BLOCK)
    qs = blocks[..., :16] | (blocks[..., 16:] << 4)
    d = np.repeat(scales.astype(np.float16), GROUP // Q4_0_BLOCK, axis=1)
    return np.concatenate([d.view(np.uint8).reshape(rows, -1, 2), qs], axis=-1).reshape(rows, -1)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values that are bf16 already (or are to be truncated to it) as bf16 bit patterns."""
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_random(shape: tuple[int, ...], mean: float, std: float, rng: np.random.Generator) -> np.ndarray:
    """float32 values truncated to bf16 and exact in fp16 too (the few below fp16's normal range
    flushed to zero): the GGUF's F16 / F32 copies hold the checkpoint's bf16 values."""
    x = (mean + std * rng.standard_normal(shape)).astype(np.float32)
    x = (x.view(np.uint32) & 0xFFFF0000).view(np.float32)
    x[np.abs(x) < 2.0**-14] = 0.0
    return x


# ---- a streaming safetensors shard -----------------------------------------------------------------
class Shard:
    """A safetensors file whose header (every tensor's dtype, shape and offsets) is written first,
    then each tensor's bytes in the declared order."""

    DTYPES = {"I32": 4, "BF16": 2, "I64": 8, "F32": 4}

    def __init__(self, path: str, plan: list[tuple[str, str, tuple[int, ...]]]) -> None:
        header, at = {}, 0
        for name, dtype, shape in plan:
            size = int(np.prod(shape)) * self.DTYPES[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + size]}
            at += size
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.order = [name for name, _, _ in plan]
        self.sizes = {name: header[name]["data_offsets"] for name, _, _ in plan}
        self.f = open(path, "wb")  # noqa: SIM115 -- closed by close()
        self.f.write(struct.pack("<Q", len(raw)) + raw)
        self.next = 0

    def write(self, name: str, data: np.ndarray) -> None:
        assert self.order[self.next] == name, f"{name} out of order (want {self.order[self.next]})"
        a, b = self.sizes[name]
        assert data.nbytes == b - a, f"{name}: {data.nbytes} bytes, declared {b - a}"
        self.f.write(np.ascontiguousarray(data).tobytes())
        self.next += 1

    def close(self) -> None:
        assert self.next == len(self.order), f"{len(self.order) - self.next} tensors not written"
        self.f.close()


def _linear_plan(prefix: str, rows: int, cols: int) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(f"{prefix}.weight_packed", "I32", (rows, cols // 8)),
            (f"{prefix}.weight_scale", "BF16", (rows, cols // GROUP)),
            (f"{prefix}.weight_shape", "I64", (2,))]  # fmt: skip


def _write_linear(shard: Shard, prefix: str, packed: np.ndarray, scales: np.ndarray) -> None:
    rows, cols = packed.shape[0], packed.shape[1] * 2
    shard.write(f"{prefix}.weight_packed", packed.view(np.int32))
    shard.write(f"{prefix}.weight_scale", bf16_bits(scales))
    shard.write(f"{prefix}.weight_shape", np.array([rows, cols], np.int64))


def quantization_config() -> dict:
    """compressed-tensors' own W4A16 preset (symmetric int4, groups of 128) as its config dict."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    return QuantizationConfig(
        config_groups={"group_0": scheme}, format="pack-quantized", ignore=["lm_head", "re:.*mlp.gate$"],
        quantization_status="compressed",
    ).to_dict()  # fmt: skip


# ---- the two files -------------------------------------------------------------------------------
def write(out: str, n_layers: int | None, seed: int = 0, only: str = "both", cfg: dict | None = None) -> dict:
    """Both files, or one (`only`: ct, gguf; the other's bytes go to /dev/null, the random stream
    is the same, so two runs with one each give the two files of a run with both)."""
    cfg = cfg or json.load(open(CONFIG))  # another config: the tests' shrunk one
    total = cfg["num_hidden_layers"]
    n = n_layers or total
    h, v, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    e, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
    std = cfg["initializer_range"]
    rng = np.random.default_rng(seed)
    os.makedirs(out, exist_ok=True)

    w = gguf.GGUFWriter(out.rstrip("/") + ".gguf" if only != "ct" else os.devnull, "qwen3moe")
    qwen3moe_header(w, cfg, n, gguf.LlamaFileType.MOSTLY_Q4_0)

    # (gguf name, CT name, shape [.., out, in], kind) in llama.cpp's order; kind: int4, bf16, norm
    top = [("token_embd.weight", "model.embed_tokens.weight", (v, h), "bf16"),
           ("output_norm.weight", "model.norm.weight", (h,), "norm"),
           ("output.weight", "lm_head.weight", (v, h), "bf16")]  # fmt: skip
    layers = []
    for i in range(n):
        g, m = f"blk.{i}.", f"model.layers.{i}."
        layers.append([
            (g + "attn_norm.weight", m + "input_layernorm.weight", (h,), "norm"),
            (g + "attn_q.weight", m + "self_attn.q_proj", (heads * hd, h), "int4"),
            (g + "attn_k.weight", m + "self_attn.k_proj", (kv * hd, h), "int4"),
            (g + "attn_v.weight", m + "self_attn.v_proj", (kv * hd, h), "int4"),
            (g + "attn_output.weight", m + "self_attn.o_proj", (h, heads * hd), "int4"),
            (g + "attn_q_norm.weight", m + "self_attn.q_norm.weight", (hd,), "norm"),
            (g + "attn_k_norm.weight", m + "self_attn.k_norm.weight", (hd,), "norm"),
            (g + "ffn_norm.weight", m + "post_attention_layernorm.weight", (h,), "norm"),
            (g + "ffn_gate_inp.weight", m + "mlp.gate.weight", (e, h), "router"),
            (g + "ffn_gate_exps.weight", m + "mlp.experts.{}.gate_proj", (e, inter, h), "int4"),
            (g + "ffn_up_exps.weight", m + "mlp.experts.{}.up_proj", (e, inter, h), "int4"),
            (g + "ffn_down_exps.weight", m + "mlp.experts.{}.down_proj", (e, h, inter), "int4"),
        ])  # fmt: skip
    for name, _, shape, kind in top + [t for layer in layers for t in layer]:
        if kind == "int4":
            byte_shape = (*shape[:-1], shape[-1] // Q4_0_BLOCK * 18)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), Q.Q4_0)
        elif kind == "bf16":
            byte_shape = (*shape[:-1], shape[-1] * 2)
            w.add_tensor_info(name, shape, np.dtype(np.float16), int(np.prod(shape)) * 2)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    def ct_plan(entries: list) -> list:
        plan = []
        for _, ct, shape, kind in entries:
            if kind != "int4":
                plan.append((ct, "BF16", shape))
            elif len(shape) == 3:
                plan += [p for x in range(shape[0]) for p in _linear_plan(ct.format(x), *shape[1:])]
            else:
                plan += _linear_plan(ct, *shape)
        return plan

    shards = [top] + layers
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map, written, t0 = {}, 0, time.perf_counter()
    for k, entries in enumerate(shards):
        plan = ct_plan(entries)
        weight_map.update({name: names[k] for name, _, _ in plan})
        shard = Shard(os.path.join(out, names[k]) if only != "gguf" else os.devnull, plan)
        for _, ct, shape, kind in entries:
            if kind == "int4":
                stack = shape if len(shape) == 3 else (1, *shape)
                ggml = np.empty((stack[0], stack[1], stack[2] // Q4_0_BLOCK * 18), np.uint8)
                for x in range(stack[0]):
                    packed, scales = int4_weight(stack[1], stack[2], rng)
                    _write_linear(shard, ct.format(x), packed, scales)
                    ggml[x] = as_q4_0(packed, scales)
                w.write_tensor_data(ggml.reshape(*shape[:-1], -1))
                written += ggml.nbytes
                continue
            if kind == "norm":
                values = bf16_random(shape, 1.0, 0.1, rng)
            else:  # bf16 embedding / head, router: the published init's spread
                values = bf16_random(shape, 0.0, std, rng)
            shard.write(ct, bf16_bits(values))
            if kind == "bf16":
                w.write_tensor_data(values.astype(np.float16))
            else:
                w.write_tensor_data(values)
            written += values.nbytes // (2 if kind == "bf16" else 1)
        shard.close()
        print(f"# shard {k + 1}/{len(shards)} written ({time.perf_counter() - t0:.0f} s)", flush=True)
    w.close()

    config = dict(cfg, num_hidden_layers=n, max_window_layers=n, torch_dtype="bfloat16")
    config["quantization_config"] = quantization_config()
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    return {"dir": out, "gguf": out.rstrip("/") + ".gguf", "layers": n, "gguf_tensor_bytes": written}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the checkpoint directory; the GGUF is OUT.gguf beside it")
    ap.add_argument("--layers", type=int, default=0, help="the first N layers only (0: all 48)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--only", choices=["both", "ct", "gguf"], default="both",
        help="write one of the two (the same codes as --only both): where the disk holds one at a time",
    )  # fmt: skip
    args = ap.parse_args()
    t = time.perf_counter()
    info = write(args.out, args.layers or None, args.seed, args.only)
    print(json.dumps(dict(info, seconds=round(time.perf_counter() - t, 1))))


if __name__ == "__main__":
    main()
