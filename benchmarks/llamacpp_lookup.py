"""llama.cpp's greedy decoding with and without its prompt-lookup drafts (llama-cpp-python's
LlamaPromptLookupDecoding), driven by bench_spec_decode.py; runs under llama-cpp-python's own venv.

Reads one JSON request a line on stdin ({"prompt": [token ids], "max_tokens": n, "lookup": bool}),
answers one JSON line ({"seconds": s, "tokens": [ids]}). Each call decodes max_tokens tokens
greedily from a fresh context (no EOS stop), as the expertmesh cells do with ignore_eos.

    /work/peers/llamacpp/bin/python benchmarks/llamacpp_lookup.py FILE.gguf --threads 2 --k 4 --ngram 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="num_pred_tokens (the draft length)")
    ap.add_argument("--ngram", type=int, default=4, help="max_ngram_size (longest suffix looked up)")
    ap.add_argument("--n-ctx", type=int, default=512)
    args = ap.parse_args()
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    common = dict(n_ctx=args.n_ctx, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    engines = {
        False: Llama(args.gguf, **common),
        True: Llama(
            args.gguf, **common,
            draft_model=LlamaPromptLookupDecoding(max_ngram_size=args.ngram, num_pred_tokens=args.k),
        ),
    }  # fmt: skip
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        llm = engines[bool(req["lookup"])]
        tokens: list[int] = []
        start = time.perf_counter()
        for token in llm.generate(req["prompt"], temp=0.0, top_k=1, reset=True):
            tokens.append(int(token))
            if len(tokens) >= req["max_tokens"]:
                break
        print(json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
