"""Peak RSS while loading within 1.15x of the steady state (issue 15, item 1), on a checkpoint of
1.45 GB: Phi-mini-MoE's published config at its real width (hidden 4,096, 16 experts of 960, the
whole 32,064 vocabulary, bf16) shrunk to 2 of its 32 layers, loaded in a fresh subprocess that
reports its VmHWM (the peak) and VmRSS (after loading and packing) from /proc/self/status.

Measured when written: 1,833 MB peak and steady (1.000x). Before one-pass loading the memory-mapped
file's pages stayed resident until it was closed and packing copied each weight: the benchmarks'
small MoE (421 MB of float32) peaked at 1.50x of its steady RSS then, 1.00x now."""

import json
import os
import subprocess
import sys

import pytest
import torch
from real_checkpoints import published
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

PROBE = """
import sys
from expertmesh import LLM
LLM(sys.argv[1], max_model_len=64, kv_cache_memory_bytes=1 << 20)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(int(status["VmHWM"].split()[0]), int(status["VmRSS"].split()[0]))
"""


def _write_checkpoint(path: str, tokenizer_dir: str) -> int:
    """Random bf16 weights under the hub's tensor names; returns the file's size in bytes."""
    config = dict(published("phi-mini-moe"), num_hidden_layers=2)
    config.pop("auto_map", None)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    shapes = {}
    for key, v in model.state_dict().items():  # transformers' in-memory names -> the hub's
        key = key.replace(".mlp.router.", ".block_sparse_moe.gate.")
        experts = key.rsplit(".mlp.experts.", 1)
        if len(experts) == 2:  # fused [E, 2I, H] / [E, H, I] -> per expert w1, w3 / w2
            layer, which = experts
            pieces = [("w1", 0), ("w3", 1)] if which == "gate_up_proj" else [("w2", None)]
            for e in range(v.shape[0]):
                for name, half in pieces:
                    rows = v.shape[1] // 2 if half is not None else v.shape[1]
                    shapes[f"{layer}.block_sparse_moe.experts.{e}.{name}.weight"] = (rows, v.shape[2])
        else:
            shapes[key] = tuple(v.shape)
    # Constant values: memory is what is measured, and random ones cost most of the test's time.
    tensors = {k: torch.full(shape, 0.02, dtype=torch.bfloat16) for k, shape in shapes.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(tokenizer_dir):
        with open(os.path.join(tokenizer_dir, name), "rb") as a, open(os.path.join(path, name), "wb") as b:
            b.write(a.read())
    return os.path.getsize(os.path.join(path, "model.safetensors"))


@pytest.mark.timeout(240)
def test_peak_rss_while_loading_is_within_1_15x_of_steady_state(tmp_path, tokenizer_dir):
    path = str(tmp_path / "phi-mini-moe-2-layers")
    size = _write_checkpoint(path, tokenizer_dir)
    assert size > 1 << 30
    env = dict(os.environ, OMP_NUM_THREADS="2")
    out = subprocess.run(
        [sys.executable, "-c", PROBE, path], capture_output=True, text=True, timeout=230, env=env, check=True
    )
    peak_kb, steady_kb = map(int, out.stdout.split()[-2:])
    assert steady_kb * 1024 > size  # the weights are resident (and held once)
    print(f"peak {peak_kb / 1024:.0f} MB, steady {steady_kb / 1024:.0f} MB, {peak_kb / steady_kb:.3f}x")
    assert peak_kb <= 1.15 * steady_kb, f"peak {peak_kb / 1024:.0f} MB, steady {steady_kb / 1024:.0f} MB"


def test_start_up_reads_config_json_once(checkpoint, monkeypatch):
    """The engine builder's read of config.json serves the tokenizer too (it had read it again)."""
    from expertmesh import LLM
    from expertmesh.engine import builder

    reads = []
    real = builder.load_hf_config
    monkeypatch.setattr(builder, "load_hf_config", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    llm = LLM(checkpoint("mixtral"), max_model_len=32, kv_cache_memory_bytes=1 << 22)
    assert len(reads) == 1, reads
    assert llm.get_tokenizer() is not None
