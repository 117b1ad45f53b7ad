"""Peak RSS while loading (VmHWM) against the steady RSS after loading, per weight format: each
load in a fresh subprocess that reports both from /proc/self/status (issue 15 item 1, issue 14).

Run as a script to print the table of docs/quantization.md ("Peak RSS while loading"):

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python tests/loading_memory.py [--hidden 1024] [--only a,b]

The checkpoints: Qwen3-30B-A3B's and gpt-oss-20b's published configs shrunk (real_checkpoints),
at a width where the expert weights dominate (default hidden 1,024, 8 experts of 1,024, 4
layers: ~420 MB of float32), converted by tests/quantized_checkpoints.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

PROBE = """
import sys
from expertmesh import LLM
def status():
    lines = (line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(v.split()[0]) for k, v in lines if k.startswith("Vm")}
if sys.argv[3]:  # build (and drop) the tiny default model first: lazy imports, the kernels'
    import gc  # library, a tokenizer, thread pools: what any LLM costs once, whatever its weights
    LLM(None, max_model_len=64, kv_cache_memory_bytes=1 << 20)
    gc.collect()
before = status()["VmRSS"]
llm = LLM(sys.argv[1], max_model_len=64, kv_cache_memory_bytes=1 << 20, quantization=sys.argv[2] or None)
steady = status()
if sys.argv[3]:  # what is held: loading leaves cyclic garbage holding transient buffers (~50 MB),
    import ctypes, ctypes.util, gc  # and glibc keeps freed heap (~40 MB for MXFP4) until trimmed
    gc.collect()
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
print(steady["VmHWM"], steady["VmRSS"], before, status()["VmRSS"])
"""


def peak_and_steady(path: str, quantization: str | None = None, timeout: int = 230) -> tuple[int, int, int]:
    """(VmHWM, VmRSS, VmRSS before building: the imports) in kB of a fresh process that builds an
    LLM of `path`, then stops."""
    return peak_steady_held(path, quantization, timeout)[:3]


def peak_steady_held(
    path: str, quantization: str | None = None, timeout: int = 230, warm: bool = False
) -> tuple[int, int, int, int]:
    """(VmHWM, VmRSS, VmRSS before building, VmRSS held) in kB of a fresh process that builds an
    LLM of `path`, then stops. With `warm`, "before" is read once the tiny default model was built
    and dropped there, and "held" once the load's garbage is collected and glibc's heap trimmed
    (without it, "held" is VmRSS). The probe runs in /tmp: the expertmesh imported is PYTHONPATH's
    or the installed one, never the current directory's."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    out = subprocess.run(
        [sys.executable, "-c", PROBE, path, quantization or "", "warm" if warm else ""],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=tempfile.gettempdir(),
    )
    if out.returncode:
        raise RuntimeError(f"loading {path} ({quantization}) failed:\n{out.stderr[-3000:]}")
    peak, steady, before, held = map(int, out.stdout.split()[-4:])
    return peak, steady, before, held


def checkpoints(root: str, tokenizer_dir: str, hidden: int, layers: int) -> dict[str, tuple[str, str | None]]:
    """format -> (checkpoint, LLM's quantization=) for every format measured."""
    from quantized_checkpoints import to_compressed_tensors, to_fp8, to_int4_packed, to_mxfp4
    from real_checkpoints import Sizes, build, published, shrink

    sizes = Sizes(layers=layers, hidden=hidden, heads=8, kv_heads=4, expert_inter=hidden, dense_inter=hidden)
    qwen = build(shrink(published("qwen3-30b-a3b"), sizes), os.path.join(root, "qwen3"), tokenizer_dir)
    gpt = build(shrink(published("gpt-oss-20b"), sizes), os.path.join(root, "gpt-oss"), tokenizer_dir)
    ref = os.path.join(root, "ref")
    out = {"float32": (qwen, None)}
    for scheme in ("int8", "int4-g32", "w4a8", "fp8"):
        out[f"online {scheme}"] = (qwen, scheme)
    out["mxfp4 (gpt-oss)"] = (to_mxfp4(gpt, os.path.join(root, "mxfp4")), None)
    out["gpt-oss float32"] = (gpt, None)
    for method in ("gptq", "awq"):
        out[f"{method} int4-g128"] = (
            to_int4_packed(qwen, os.path.join(root, method), ref, method, 128),
            None,
        )
    from compressed_tensors.quantization import QuantizationArgs

    for bits in (4, 8):
        args = QuantizationArgs(num_bits=bits, type="int", strategy="group", group_size=128, symmetric=True)
        groups = {"group_0": (["Linear"], args)}
        ct = os.path.join(root, f"ct{bits}")
        out[f"compressed-tensors int{bits}"] = (
            to_compressed_tensors(qwen, ct, ref, groups, "pack-quantized", ["lm_head", "re:.*mlp.gate$"]),
            None,
        )
    fp8 = to_fp8(qwen, os.path.join(root, "fp8"), (128, 128))
    out["fp8 checkpoint (quantization='dequantize')"] = (fp8, "dequantize")
    out["fp8 checkpoint held as stored (the default)"] = (fp8, None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--only", default="", help="comma-separated substrings of the formats to run")
    parser.add_argument("--root", default=None, help="keep the checkpoints here (made once, reused)")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(__file__))
    from checkpoints import train_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        root = args.root or tmp
        tok = os.path.join(root, "tok")
        if not os.path.exists(os.path.join(root, "done")):
            train_tokenizer(tok)
            cases = checkpoints(root, tok, args.hidden, args.layers)
            with open(os.path.join(root, "done"), "w") as f:
                json.dump(cases, f)
        else:
            with open(os.path.join(root, "done")) as f:
                cases = json.load(f)
        print("| format | peak MB | steady MB | peak / steady | imports MB |\n|---|---|---|---|---|")
        for name, (path, quant) in cases.items():
            if args.only and not any(s in name for s in args.only.split(",")):
                continue
            peak, steady, before = peak_and_steady(path, quant)
            mb = " | ".join(f"{kb / 1024:,.0f}" for kb in (peak, steady))
            print(f"| {name} | {mb} | {peak / steady:.2f}x | {before / 1024:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
