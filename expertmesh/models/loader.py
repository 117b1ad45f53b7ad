"""Strict weight loading from safetensors: every parameter shard filled exactly once.

Each rank opens the files with `safe_open` and reads only its own slices (`get_slice`).
A checkpoint key nobody recognises, a parameter left unfilled or filled twice is an error
naming it.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from typing import Any

from safetensors import safe_open
from tqdm import tqdm

from expertmesh.models.checkpoint import checkpoint_targets, layer_index

log = logging.getLogger("expertmesh")


class WeightLoadError(ValueError):
    pass


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors weights in {model_dir!r} (other formats are not supported)")
    return [os.path.join(model_dir, n) for n in files]


def _experts_lookup(model: Any):
    modules = dict(model.named_modules())

    def find(prefix: str) -> Any:
        return getattr(modules.get(prefix), "experts", None) if prefix in modules else None

    return find


def load_weights(model: Any, model_dir: str, show_progress: bool = False) -> None:
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {name: set() for name in params}
    local_layers = set(model.model.layer_range)
    experts, tie = _experts_lookup(model), model.cfg.tie_word_embeddings
    files = safetensors_files(model_dir)
    skipped: Counter = Counter()
    for path in tqdm(files, desc="Loading safetensors", disable=not show_progress or len(files) < 2):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                rule = skip_rule(key, model)
                if rule is not None:
                    skipped[rule] += 1
                    continue
                _load_key(f, key, params, loaded, local_layers, experts, model, tie)
    for rule, count in sorted(skipped.items()):
        log.info("skipped %d checkpoint tensors by rule %r", count, rule)
    _check_complete(params, loaded)


def skip_rule(key: str, model: Any) -> str | None:
    """The named rule that consumes `key` without loading it, if any: the family's own (e.g. a
    multimodal checkpoint's vision tower), or the multi-token-prediction layers stored after the
    last decoder layer (GLM-4.5, DeepSeek-V3), which only speculative decoding would use."""
    names, cfg = model.family.names, model.cfg
    rule = names.skip_rule(key)
    if rule is not None:
        return rule
    layer = layer_index(names.canonical(key))
    if layer is not None and cfg.num_layers <= layer < cfg.num_layers + cfg.num_nextn_predict_layers:
        return "mtp layers (num_nextn_predict_layers; speculative decoding is not supported)"
    return None


def _load_key(f: Any, key: str, params, loaded, local_layers, experts, model, tie) -> None:
    checkpoint_key, key = key, model.family.names.canonical(key)
    layer = layer_index(key)
    if layer is not None and not 0 <= layer < model.cfg.num_layers:
        raise WeightLoadError(
            f"checkpoint key {checkpoint_key!r} names layer {layer}, but the model has {model.cfg.num_layers}"
        )
    if layer is not None and layer not in local_layers:
        return  # another pipeline stage owns it
    targets = checkpoint_targets(key, model.family.names, experts, tie)
    key = checkpoint_key  # errors name the tensor as the checkpoint spells it
    for name, shard, pick in targets:
        if name not in params:
            if _owned_elsewhere(name, model):
                continue
            raise WeightLoadError(f"checkpoint key {key!r} matches no parameter of {type(model).__name__}")
        param = params[name]
        if shard not in param.expected_shards:
            if isinstance(shard, tuple):  # an expert another EP rank owns
                continue
            raise WeightLoadError(
                f"checkpoint key {key!r}: unexpected shard {shard!r} for parameter {name!r}"
            )
        if shard in loaded[name]:
            raise WeightLoadError(f"parameter {name!r} shard {shard!r} is filled twice (last by {key!r})")
        try:
            param.weight_loader(param, pick(f.get_slice(checkpoint_key)), shard)
        except ValueError as exc:  # name the checkpoint key, not just the shapes
            raise WeightLoadError(f"checkpoint key {key!r} does not fit parameter {name!r}: {exc}") from exc
        loaded[name].add(shard)


def _owned_elsewhere(name: str, model: Any) -> bool:
    """Embedding and head live on the first and last pipeline stage only."""
    if name.startswith("model.embed_tokens.") and model.model.embed_tokens is None:
        return True
    if name.startswith("model.norm.") and model.model.norm is None:
        return True
    return name.startswith("lm_head.") and model.lm_head is None


def _check_complete(params: dict, loaded: dict) -> None:
    missing = [
        f"{name} (shards {sorted(map(str, p.expected_shards - loaded[name]))})"
        if p.expected_shards != {None}
        else name
        for name, p in params.items()
        if p.expected_shards - loaded[name]
    ]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise WeightLoadError(f"checkpoint is missing weights for: {shown}")
