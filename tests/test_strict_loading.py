"""Strict loading, really strict: a checkpoint tensor larger than its parameter, of an integer
dtype, or holding NaN/inf fails naming the key (and the file, and both shapes) before any rank
slices it; a truncated file is named by its path. Each case loaded silently before."""

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from expertmesh import LLM, SamplingParams
from expertmesh.models.loader import WeightLoadError

ENGINE = dict(kv_cache_memory_bytes=1 << 22, max_model_len=64)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _edited(src: str, dst, edit) -> str:
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    edit(weights)
    save_file(weights, dst / "model.safetensors")
    return str(dst)


def _grow(key: str, rows: int = 0, cols: int = 0):
    def edit(w):
        t = w[key]
        w[key] = torch.nn.functional.pad(t, (0, cols, 0, rows) if t.dim() == 2 else (0, rows)).contiguous()

    return edit


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "key,rows,cols,expected",
    [
        ("model.layers.0.self_attn.q_proj.weight", 1, 0, "(64, 64)"),  # 65 x 64: sliced silently before
        ("model.layers.1.self_attn.k_proj.weight", 0, 3, "(32, 64)"),
        ("lm_head.weight", 10, 0, "(512, 64)"),
        ("model.layers.0.mlp.experts.2.up_proj.weight", 1, 0, "(32, 64)"),
        ("model.norm.weight", 2, 0, "(64,)"),
    ],
)
def test_a_larger_tensor_names_key_file_and_both_shapes(checkpoint, tmp_path, key, rows, cols, expected):
    src = load_file(f"{checkpoint('qwen3_moe')}/model.safetensors")[key]
    found = tuple(src.shape[:1]) if src.dim() == 1 else (src.shape[0], src.shape[1])
    found = (found[0] + rows,) if src.dim() == 1 else (found[0] + rows, found[1] + cols)
    path = _edited(checkpoint("qwen3_moe"), tmp_path / "m", _grow(key, rows, cols))
    message = f"checkpoint key '{key}' in {path}/model.safetensors has shape {found}"
    with pytest.raises(WeightLoadError, match=re.escape(message) + ".*expects " + re.escape(expected)):
        LLM(path, **ENGINE)


def _fused(weights: dict, layers: int, experts: int) -> None:
    """Per-expert Mixtral tensors -> the fused 3-D layout (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    for layer in range(layers):
        pre = f"model.layers.{layer}.block_sparse_moe.experts"
        gate_up = [
            torch.cat([weights.pop(f"{pre}.{e}.w1.weight"), weights.pop(f"{pre}.{e}.w3.weight")])
            for e in range(experts)
        ]
        weights[f"{pre}.gate_up_proj"] = torch.stack(gate_up)
        weights[f"{pre}.down_proj"] = torch.stack(
            [weights.pop(f"{pre}.{e}.w2.weight") for e in range(experts)]
        )


@pytest.mark.timeout(60)
def test_fused_expert_tensors_load_and_a_larger_one_fails(checkpoint, tmp_path):
    base = checkpoint("mixtral")
    expected = LLM(base, **ENGINE).generate({"prompt_token_ids": [5, 9, 30]}, GREEDY, use_tqdm=False)
    fused = _edited(base, tmp_path / "fused", lambda w: _fused(w, 2, 8))
    got = LLM(fused, **ENGINE).generate({"prompt_token_ids": [5, 9, 30]}, GREEDY, use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids

    key = "model.layers.1.block_sparse_moe.experts.gate_up_proj"

    def one_more_row(w):
        _fused(w, 2, 8)
        w[key] = torch.nn.functional.pad(w[key], (0, 0, 0, 1)).contiguous()  # [8, 193, 64]

    path = _edited(base, tmp_path / "bigger", one_more_row)
    with pytest.raises(
        WeightLoadError, match=re.escape(f"'{key}' in {path}/model.safetensors has shape (8, 193, 64)")
    ):
        LLM(path, **ENGINE)


@pytest.mark.timeout(60)
def test_an_integer_weight_is_not_cast_silently(checkpoint, tmp_path):
    key = "model.layers.0.self_attn.o_proj.weight"
    path = _edited(
        checkpoint("llama"), tmp_path / "m", lambda w: w.update({key: (w[key] * 100).to(torch.int32)})
    )
    with pytest.raises(
        WeightLoadError, match=f"'{re.escape(key)}' in .* has dtype I32; .* needs floating point"
    ):
        LLM(path, **ENGINE)


@pytest.mark.timeout(60)
def test_non_finite_weights_fail_naming_the_key_or_warn_when_allowed(checkpoint, tmp_path, caplog):
    key = "model.layers.1.mlp.down_proj.weight"

    def poison(w):
        w[key] = torch.full_like(w[key], float("nan"))
        w["model.embed_tokens.weight"][7, 3] = float("inf")

    path = _edited(checkpoint("llama"), tmp_path / "m", poison)
    with pytest.raises(
        WeightLoadError,
        match=f"checkpoint key '({re.escape(key)}|model.embed_tokens.weight)' holds non-finite",
    ):
        LLM(path, **ENGINE)
    LLM(path, allow_nonfinite_weights=True, **ENGINE)
    assert re.search(r"\d+ values are NaN or infinite \(allowed\)", caplog.text)


@pytest.mark.timeout(60)
def test_a_truncated_file_is_named_by_its_path(checkpoint, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(checkpoint("llama"), path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightLoadError, match=f"{re.escape(str(path))}/model.safetensors"):
        LLM(str(path), **ENGINE)
