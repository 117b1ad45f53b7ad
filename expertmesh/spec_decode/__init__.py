"""Speculative decoding: draft several tokens cheaply, check them in one target forward.

config.py (vLLM's `speculative_config`), ngram.py (prompt-lookup drafts), verify.py (greedy
acceptance and the rejection sampler), stats.py (vLLM's spec_decode counters), adaptive.py
(speculation switched off per sequence while its drafts are rejected). The scheduler gives a
drafting sequence 1 + len(draft) tokens, the runner returns logits at each of them, and the engine
rolls the KV cache back past the accepted ones (docs/speculative_decoding.md).
"""

from expertmesh.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
