"""A random-weight checkpoint from a config, built once with transformers' own class and cached.

The benchmarks that time one family's shape at full width (mla_decode.py, dsa_decode.py,
hybrid_slice.py) build their model here: `config.json` is written first (transformers reads the
class's config from it), the model is saved, the config is written again over what transformers
saved (it adds or rewrites fields), and a READY file holding the config and the seed marks the
directory as reusable; a different config or seed rebuilds it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def cached_checkpoint(
    path: Path, config: dict, hf_class: str, dtype: torch.dtype, seed: int = 0, tokenizer: bool = False
) -> str:
    """The checkpoint at `path` for `config` (built when missing or stale); `tokenizer`: also the
    test suite's trained 512-token tokenizer (tests/checkpoints.py)."""
    marker = path / "READY"
    stamp = {"config": config, "seed": seed}
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return str(path)
    import transformers  # slow to import: only when a checkpoint is built

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    torch.manual_seed(seed)
    cls = getattr(transformers, hf_class)
    model = cls._from_config(transformers.AutoConfig.from_pretrained(path)).to(dtype).eval()
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(config))
    if tokenizer:
        sys.path.insert(0, str(ROOT / "tests"))
        from checkpoints import train_tokenizer

        train_tokenizer(str(path))
    marker.write_text(json.dumps(stamp))
    return str(path)
