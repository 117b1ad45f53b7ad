"""Published config.json files (tests/real_configs/), shrunk in size with every flag kept, and tiny
random checkpoints built from them with transformers' own classes.

`shrink(published("gpt-oss-20b"))` keeps what makes a family what it is (rope scaling block,
`layer_types` / `no_rope_layers` patterns, sliding windows and attention chunks, biases, dense
leading layers, multipliers, MTP layers, tied embeddings, the architectures spelling, auto_map)
and shrinks only sizes: layers, hidden, heads, head_dim (keeping the q-width to hidden ratio),
experts, intermediate sizes, vocab, positions and windows (keeping their relations, e.g. an odd
window stays odd, a window equal to max_position_embeddings stays equal).

`build(config, path, tokenizer_dir)` writes a checkpoint: the model from transformers' class,
every 1-D parameter and persistent buffer and every bias randomised (norm weights, biases, sinks,
router and correction biases start at 1/0 and would hide a dropped one), `save_pretrained`, then
the published-style config.json put back (so the engine and the reference both read the file a
user has), and the multi-token-prediction layer a real checkpoint carries added as extra tensors.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

CONFIG_DIR = Path(__file__).parent / "real_configs"
VOCAB = 512  # the test tokenizer's size (checkpoints.train_tokenizer)
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk")  # moe_topk: LongCat-Flash


def published(name: str) -> dict:
    """The published config.json of one model (file names: tests/real_configs/*.json)."""
    return json.loads((CONFIG_DIR / f"{name}.json").read_text())


# DeepSeek-V2 (236B) differs from V2-Lite's file in these values only (as published; its file is
# not among the twelve, see real_configs/README.md): q LoRA, 160 experts in 8 groups of which
# group_limited_greedy keeps 3, routed_scaling_factor 16.
DEEPSEEK_V2 = {
    "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536, "n_group": 8,
    "n_routed_experts": 160, "num_attention_heads": 128, "num_key_value_heads": 128,
    "num_hidden_layers": 60, "q_lora_rank": 1536, "routed_scaling_factor": 16.0, "topk_group": 3,
    "topk_method": "group_limited_greedy", "transformers_version": "4.39.3",
}  # fmt: skip


def deepseek_v2() -> dict:
    """DeepSeek-V2's config: V2-Lite's keys with DeepSeek-V2's published values."""
    return {**published("deepseek-v2-lite"), **DEEPSEEK_V2}


@dataclass(frozen=True)
class Sizes:
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2  # for GQA models; MHA stays MHA
    experts: int = 8
    max_top_k: int = 4
    expert_inter: int = 32
    dense_inter: int = 96
    shared_inter: int = 48
    positions: int = 512  # max_position_embeddings
    original_positions: int = 128  # original_max_position_embeddings (rope scaling, LongRoPE switch)
    window: int = 32  # sliding windows, attention chunks, Llama 4's floor_scale
    # Multi-head latent attention (DeepSeek): the latent, the q LoRA bottleneck and per-head
    # dims without / with position and of values (the published 512 / 1536 / 128 / 64 / 128).
    kv_lora_rank: int = 32
    q_lora_rank: int = 48
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    # DeepSeek Sparse Attention's indexer: heads, head width and the tokens a query keeps (fewer
    # than the test prompts, so the selection happens)
    index_n_heads: int = 16
    index_head_dim: int = 16
    index_topk: int = 12


def shrink(config: dict, sizes: Sizes = Sizes(), **overrides) -> dict:
    """A copy of a published config with sizes shrunk and every flag kept; `overrides` last."""
    out = json.loads(json.dumps(config))
    out.pop("quantization_config", None)  # weight formats are another issue: tested unquantized
    if "text_config" in out:  # a multimodal wrapper: shrink its text tower, and the vision one
        out["text_config"] = _shrink_text(out["text_config"], sizes)
        if "vision_config" in out:
            out["vision_config"] = _shrink_vision(out["vision_config"])
        _float32(out)
    else:
        out = _shrink_text(out, sizes)
    out.update(overrides)
    return out


def _float32(c: dict) -> None:
    for key in ("torch_dtype", "dtype"):
        if key in c:
            c[key] = "float32"


def _shrink_text(c: dict, s: Sizes) -> dict:
    c.pop("quantization_config", None)  # a text tower's own (Kimi-K2.5's int4 experts): as above
    # Llama 4's published files say attn_temperature_tuning: 4; transformers >= 5 accepts only a bool
    # (AutoConfig raises on the int), so the flag is kept as its truth value.
    if type(c.get("attn_temperature_tuning")) is int:
        c["attn_temperature_tuning"] = bool(c["attn_temperature_tuning"])
    layers_key = "num_layers" if "num_layers" in c else "num_hidden_layers"  # LongCat-Flash: num_layers
    old_layers = c[layers_key]
    _shrink_layers(c, s.layers, old_layers, layers_key)
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    old_hidden = c["hidden_size"]
    c["hidden_size"], c["num_attention_heads"] = s.hidden, s.heads
    if "num_key_value_heads" in c:
        c["num_key_value_heads"] = s.heads if kv == heads else s.kv_heads
    if c.get("head_dim"):
        ratio = heads * c["head_dim"] / old_hidden  # q width : hidden, e.g. 3 for GLM-4.5-Air
        new_head_dim = max(8, round(ratio * s.hidden / s.heads / 8) * 8)
        if c.get("rotary_dim"):  # MiniMax's legacy partial rotary: the same share of the head
            c["rotary_dim"] = c["rotary_dim"] * new_head_dim // c["head_dim"]
        c["head_dim"] = new_head_dim
    _shrink_widths(c, s)
    _shrink_experts(c, s)
    _shrink_positions(c, s)
    _shrink_token_ids(c)
    vocab = c["vocab_size"]
    c["vocab_size"] = VOCAB + vocab % 8  # an odd vocabulary (Granite's 49155) stays odd
    c["initializer_range"] = 0.1  # clearer top-1 margins for greedy comparisons
    _float32(c)
    return c


def _shrink_layers(c: dict, n: int, old: int, key: str = "num_hidden_layers") -> None:
    c[key] = n
    for key in ("layer_types", "no_rope_layers", "attn_type_list"):  # periodic patterns: a prefix keeps them
        if c.get(key):
            c[key] = c[key][:n]
    if c.get("moe_layers") is not None:
        c["moe_layers"] = [i for i in c["moe_layers"] if i < n]
    if c.get("mlp_only_layers"):
        c["mlp_only_layers"] = [i for i in c["mlp_only_layers"] if i < n]
    if "max_window_layers" in c:
        c["max_window_layers"] = round(n * c["max_window_layers"] / old)
    if c.get("first_k_dense_replace"):
        c["first_k_dense_replace"] = min(c["first_k_dense_replace"], n - 1)


def _shrink_widths(c: dict, s: Sizes) -> None:
    is_moe = any(c.get(k) for k in EXPERT_KEYS)
    if "intermediate_size" in c:
        # Without moe_intermediate_size, an MoE's intermediate_size is its expert width.
        expert_width = is_moe and "moe_intermediate_size" not in c
        c["intermediate_size"] = s.expert_inter if expert_width else s.dense_inter
    for key in (
        "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "index_n_heads", "index_head_dim", "index_topk",
    ):  # fmt: skip
        if c.get(key):  # a null q_lora_rank (no q LoRA, V2-Lite) stays null
            c[key] = getattr(s, key)
    if c.get("qk_head_dim"):  # GLM-5 states the sum
        c["qk_head_dim"] = s.qk_nope_head_dim + s.qk_rope_head_dim
    for key, size in (
        ("moe_intermediate_size", s.expert_inter),
        ("shared_expert_intermediate_size", s.shared_inter),
        ("shared_intermediate_size", s.shared_inter),
        ("intermediate_size_mlp", s.dense_inter),
        ("ffn_hidden_size", s.dense_inter),  # LongCat-Flash's dense MLPs
        ("expert_ffn_hidden_size", s.expert_inter),  # and its experts
    ):
        if c.get(key):
            c[key] = size


def _shrink_experts(c: dict, s: Sizes) -> None:
    num = next((c[k] for k in EXPERT_KEYS if c.get(k)), 0)
    if not num:
        return
    groups = c.get("n_group") or 1
    experts = max(s.experts, 2 * groups) if groups > 1 else s.experts
    for key in EXPERT_KEYS:
        if c.get(key):
            c[key] = experts
    if c.get("zero_expert_num"):  # LongCat-Flash's identity experts, in their ratio to the real ones
        c["zero_expert_num"] = max(1, experts * c["zero_expert_num"] // num)
    for key in TOP_K_KEYS:
        if c.get(key):
            c[key] = min(c[key], s.max_top_k, max(1, experts // 2))


def _shrink_positions(c: dict, s: Sizes) -> None:
    old_max = c.get("max_position_embeddings", 2048)
    c["max_position_embeddings"] = s.positions
    for key in ("original_max_position_embeddings", "initial_context_length"):
        if key in c:
            c[key] = s.original_positions
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(c.get(key), dict):
            c[key] = _shrink_rope(c[key], c, s)
    window = c.get("sliding_window")
    if window:
        c["sliding_window"] = s.positions if window >= old_max else s.window - (window % 2)
    for key in ("attention_chunk_size", "floor_scale"):
        if c.get(key):
            c[key] = s.window


def _shrink_rope(rope: dict, c: dict, s: Sizes) -> dict:
    rope = dict(rope)
    if "original_max_position_embeddings" in rope:
        rope["original_max_position_embeddings"] = s.original_positions
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    rotary = int(head_dim * (rope.get("partial_rotary_factor") or c.get("partial_rotary_factor") or 1.0))
    for key in ("short_factor", "long_factor"):
        if key in rope:
            rope[key] = _resample(rope[key], rotary // 2)
    return rope


def _resample(values: list[float], n: int) -> list[float]:
    """n values spread over the published list (SOURCES.md: Phi-3.5's lists are truncated)."""
    if n == 1:
        return [values[0]]
    src = torch.tensor(values, dtype=torch.float64)
    x = torch.linspace(0, len(values) - 1, n, dtype=torch.float64)
    lo = x.floor().long().clamp(max=len(values) - 1)
    hi = (lo + 1).clamp(max=len(values) - 1)
    out = src[lo] + (src[hi] - src[lo]) * (x - lo)
    return [round(v, 6) for v in out.tolist()]


def _shrink_token_ids(c: dict) -> None:
    """Special token ids mapped into the small vocabulary, keeping which of them coincide."""
    mapping: dict[int, int] = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = c.get(key)
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        new = [mapping.setdefault(i, len(mapping) + 1) for i in ids]
        c[key] = new if isinstance(value, list) else new[0]


def _shrink_vision(v: dict) -> dict:
    v = dict(v)
    v.update(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
        projector_output_dim=32,
    )  # fmt: skip
    if "vt_hidden_size" in v:  # Kimi-K2.5's MoonViT and its projector
        v.update(
            vt_hidden_size=32, vt_intermediate_size=64, vt_num_hidden_layers=1, vt_num_attention_heads=2,
            mm_hidden_size=32, init_pos_emb_height=4, init_pos_emb_width=4, init_pos_emb_time=2,
        )  # fmt: skip
        v.pop("_attn_implementation", None)  # flash_attention_2 is not on this machine
    return v


# ---- building a checkpoint --------------------------------------------------------------------
def build(config: dict, path: str, tokenizer_dir: str, seed: int = 0, original_format: bool = True) -> str:
    """A tiny random checkpoint of `config` at `path` (see the module docstring). `original_format`
    False saves transformers' in-memory tensor names (fused 3-D experts) instead of the hub's."""
    os.makedirs(path, exist_ok=True)
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(seed)
    hf = transformers.AutoConfig.from_pretrained(path)
    arch = config["architectures"][0]
    cls = getattr(transformers, arch, None) or transformers.AutoModelForCausalLM
    if cls is transformers.AutoModelForCausalLM and "text_config" in config:
        cls = transformers.AutoModelForImageTextToText  # Kimi-K2.5 (its auto_map names remote code)
    auto = cls in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText)
    model = cls.from_config(hf) if auto else cls._from_config(hf)
    model = model.float().eval()
    randomize_small(model, seed)
    model.save_pretrained(path, save_original_format=original_format)
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2))  # the published style
    if config.get("model_type") == "kimi_k25":
        _hub_names_kimi_k25(path)
    text = config.get("text_config", config)
    mtp = text.get("num_nextn_predict_layers") or text.get("num_mtp_modules")  # MiniMax: 3 modules
    if mtp:
        add_mtp_layers(path, text["num_hidden_layers"], mtp)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(path, name))
    return path


def _hub_names_kimi_k25(path: str) -> None:
    """transformers 5.25 saves Kimi-K2.5's text layers as `language_model.model.blocks.<i>` (its
    vision tower's `blocks` rename reversed over every key) and the projector's norm under
    `model.`; the published shards say `language_model.model.layers.<i>` and `mm_projector.`."""
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    fixed = {
        k.replace("language_model.model.blocks.", "language_model.model.layers.").replace(
            "model.mm_projector.", "mm_projector."
        ): v
        for k, v in tensors.items()
    }
    save_file(fixed, file, metadata={"format": "pt"})


def randomize_small(model: torch.nn.Module, seed: int) -> None:
    """Norm weights, biases, sinks, router and correction biases: shaken so a dropped one shows."""
    g = torch.Generator().manual_seed(seed)
    persistent = [
        (n, b) for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] not in _non_persistent(model, n)
    ]
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *persistent]:
            # position_bias: DeepSeek-V4's per-slot compressor gate bias (initialised to zero)
            if t.is_floating_point() and (t.dim() == 1 or name.endswith(("bias", "position_bias"))):
                t.add_(torch.randn(t.shape, generator=g) * 0.1)
            elif name.endswith("tid2eid"):  # DeepSeek-V4's hash routing table: distinct experts a token
                experts = model.config.get_text_config().n_routed_experts
                t.copy_(
                    torch.stack(
                        [torch.randperm(experts, generator=g)[: t.shape[1]] for _ in range(t.shape[0])]
                    )
                )


def _non_persistent(model: torch.nn.Module, name: str) -> set[str]:
    owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    return set(owner._non_persistent_buffers_set)


def add_mtp_layers(path: str, num_layers: int, count: int) -> None:
    """The multi-token-prediction layers a GLM-4.5 / DeepSeek-V3 checkpoint carries after its last
    decoder layer (transformers drops them): a copy of the last layer's tensors plus the MTP head
    pieces, in a second file listed by a safetensors index, as in the published shards."""
    main = load_file(os.path.join(path, "model.safetensors"))
    last = f"model.layers.{num_layers - 1}."
    hidden = main["model.embed_tokens.weight"].shape[1]
    extra = {}
    for i in range(num_layers, num_layers + count):
        prefix = f"model.layers.{i}."
        extra.update({prefix + k[len(last) :]: v.clone() for k, v in main.items() if k.startswith(last)})
        extra[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden)
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            extra[prefix + f"{norm}.weight"] = 1 + 0.1 * torch.randn(hidden)
        extra[prefix + "shared_head.head.weight"] = main["model.embed_tokens.weight"].clone()
        extra[prefix + "embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
    add_second_shard(path, main, extra)


def add_second_shard(path: str, main: dict[str, torch.Tensor], extra: dict[str, torch.Tensor]) -> None:
    """`path`'s model.safetensors (holding `main`) becomes the first of two shards, `extra` the
    second, listed by a safetensors index: how published checkpoints carry their MTP layers."""
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, first))
    save_file(extra, os.path.join(path, second), metadata={"format": "pt"})
    weight_map = {k: first for k in main} | {k: second for k in extra}
    index = {"metadata": {}, "weight_map": weight_map}
    (Path(path) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
