"""Wrong input fails loudly, with a message naming the bad value; other requests still complete."""

import json
import os
import shutil

import pytest
from checkpoints import prompts_of_lengths
from safetensors.torch import load_file, save_file

from expertmesh import LLM, SamplingParams
from expertmesh.models.loader import WeightLoadError

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.mark.timeout(60)
def test_prompt_longer_than_max_model_len_fails_alone(checkpoint, caplog):
    llm = LLM(checkpoint("mixtral"), max_model_len=32, kv_cache_memory_bytes=1 << 22)
    short, long_, short2 = prompts_of_lengths([5, 40, 8], seed=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in (short, long_, short2)], GREEDY, use_tqdm=False)
    assert outs[1].error and "40 tokens" in outs[1].error and "max_model_len=32" in outs[1].error
    assert outs[1].outputs == []
    assert [len(outs[i].outputs[0].token_ids) for i in (0, 2)] == [4, 4]
    assert outs[0].error is None and outs[2].error is None
    assert llm.llm_engine.blocks.num_free == llm.llm_engine.blocks.num_blocks


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.timeout(60)
def test_unknown_architecture_lists_supported(checkpoint, tmp_path):
    path = _copy(checkpoint("mixtral"), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["MysteryForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="MysteryForCausalLM.*supported.*MixtralForCausalLM"):
        LLM(str(path), kv_cache_memory_bytes=1 << 22)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("edit", ["drop", "extra", "reshape"])
def test_strict_weight_loading(checkpoint, tmp_path, edit):
    path = _copy(checkpoint("phimoe"), tmp_path / "m")
    weights = load_file(path / "model.safetensors")
    key = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    if edit == "drop":
        del weights[key]
        param = "model.layers.1.block_sparse_moe.experts.w2"
        match = f"missing weights for: {param} \\(shards \\['\\(3, None\\)'\\]\\)"
    elif edit == "extra":
        weights["model.layers.0.self_attn.surprise.weight"] = weights[key].clone()
        match = "surprise.weight.*matches no parameter"
    else:
        weights[key] = weights[key][:, :-1].contiguous()
        match = (
            "key 'model.layers.1.block_sparse_moe.experts.3.w2.weight' in .*model.safetensors has shape "
            "\\(64, 95\\); parameter .*experts.w2' expects \\(64, 96\\)"
        )
    save_file(weights, path / "model.safetensors")
    with pytest.raises((WeightLoadError, ValueError), match=match):
        LLM(str(path), kv_cache_memory_bytes=1 << 22)


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="tensor_paralel_size"):
        LLM("unused", tensor_paralel_size=2)


@pytest.mark.timeout(60)
def test_bad_engine_arguments_name_the_value(checkpoint):
    path = checkpoint("mixtral")
    with pytest.raises(ValueError, match="all2all_backend='fastest'.*naive"):
        LLM(path, all2all_backend="fastest")
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds"):
        LLM(path, max_model_len=100000)
    with pytest.raises(ValueError, match="dtype='float8'"):
        LLM(path, dtype="float8")
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        LLM(path, tensor_parallel_size=0)


@pytest.mark.timeout(60)
def test_several_ranks_without_a_launcher_show_the_torchrun_command(checkpoint, monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node=4"):
        LLM(checkpoint("mixtral"), tensor_parallel_size=2, data_parallel_size=2)


def test_missing_local_path_and_offline_hub_are_clear(monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/nonexistent/model/dir")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="could not fetch model 'someone/some-moe'.*offline"):
        LLM("someone/some-moe")


@pytest.mark.timeout(60)
def test_token_prompts_work_without_a_tokenizer(checkpoint, tmp_path):
    path = _copy(checkpoint("llama"), tmp_path / "m")
    for name in os.listdir(path):
        if name.startswith(("tokenizer", "special_tokens")):
            os.remove(path / name)
    llm = LLM(str(path), kv_cache_memory_bytes=1 << 22)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    # A text prompt fails alone (the invariant: a finished request with its error), the next one works.
    bad, good = llm.generate(
        ["text needs a tokenizer", {"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False
    )
    assert "no tokenizer" in bad.error and bad.outputs == []
    assert good.outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.timeout(60)
def test_tp_that_does_not_fit_the_heads_names_each_number_under_its_own_label(checkpoint, monkeypatch):
    # 4 query heads, 2 KV heads: TP=3 fits neither. The message used to swap the two labels.
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    path = checkpoint("mixtral")
    with pytest.raises(
        ValueError, match=r"^num_attention_heads=4 is not divisible by tensor_parallel_size=3.*\[1, 2, 4\]"
    ):
        LLM(path, tensor_parallel_size=3)  # before any process group or torchrun check
    path = checkpoint("mixtral", num_attention_heads=12, num_key_value_heads=4, head_dim=16)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=3 neither divides num_key_value_heads=4 nor is a multiple"
    ):
        LLM(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="distributed_timeout_seconds=0 must be a number > 0"):
        LLM(path, distributed_timeout_seconds=0)
