"""Strict weight loading from safetensors: every parameter shard filled exactly once.

Each rank opens the files (models/tensor_file.py: positioned reads, no memory map, so a slice is
resident only until it is copied into its parameter) and reads only its own slices (`get_slice`),
through the checkpoint's weight format (layers/quantization: fp8, mxfp4, gptq, awq tensors are
served as the logical weights they stand for).
A checkpoint key nobody recognises, a parameter left unfilled or filled twice is an error
naming it. Before any rank slices, every tensor's full shape and dtype are checked against a
one-rank twin of the model built on the meta device (`check_against_twin`): a tensor larger than
its parameter, or an integer tensor for a float parameter, is an error naming the key, the file
and both shapes. A NaN or infinite weight is an error naming its key (`allow_nonfinite` makes it
a warning).
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from typing import Any

import torch
from safetensors import SafetensorError
from tqdm import tqdm

from expertmesh.distributed.model_env import ModelEnv
from expertmesh.distributed.moe_plan import MoEPlan
from expertmesh.distributed.parallel_groups import ParallelGroups
from expertmesh.layers.ops import Ops
from expertmesh.layers.quantization.held import plan
from expertmesh.layers.quantization.streaming import Streaming
from expertmesh.layers.quantization.view import CheckpointView, opened
from expertmesh.layers.torch_ops import TORCH_OPS
from expertmesh.layers.weights import NonFinite, ShapeMismatch, nonfinite_allowed, whole_tensors
from expertmesh.models.checkpoint import READ_AS_IS, checkpoint_targets, layer_index
from expertmesh.models.gguf import GGUFError, GGUFTensorFile, gguf_info
from expertmesh.models.tensor_file import TensorFile
from expertmesh.spec_decode.mtp_families import mtp_checkpoint_key, mtp_family

# The MTP layer's own pieces (spec_decode/mtp.py MTPLayer; DeepSeek-V4's e_proj / h_proj / hc_head:
# mtp_v4.py); the rest of `model.layers.{n}.*` is its decoder layer, and its `embed_tokens` is a copy
# of the target's (LongCat-Flash's its own).
HEAD_PIECES = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "e_proj.", "h_proj.", "hc_head.")
SHARED_EMBEDDING = "embed_tokens."

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


def _open(path: str):
    try:
        return TensorFile(path)  # positioned reads, no memory map (models/tensor_file.py)
    except (SafetensorError, OSError) as exc:  # truncated, not safetensors at all, unreadable
        raise WeightLoadError(f"cannot read the weights file {path}: {exc}") from exc


def _gguf_opener(info: dict, dtype: Any = None):
    def open_one(path: str) -> GGUFTensorFile:
        try:
            return GGUFTensorFile(path, info, dtype)
        except (GGUFError, OSError) as exc:
            raise WeightLoadError(str(exc)) from exc

    return open_one


def load_weights(
    model: Any,
    model_dir: str,
    show_progress: bool = False,
    allow_nonfinite: bool = False,
    ops: Ops = TORCH_OPS,
) -> set[int]:
    """Fill every parameter; returns the ids of the modules that took their weights compressed while
    loading (one pass: layers/quantization/streaming.py), which the build then leaves alone."""
    gguf = gguf_info(model_dir)  # a GGUF model (models/gguf): its files, tensors under HF names
    # (its embedding and head dequantized straight into the model dtype)
    if gguf:
        files, opener = gguf["files"], _gguf_opener(gguf, model.cfg.dtype)
    else:
        files, opener = safetensors_files(model_dir), _open
    # one torch thread while loading: its ops are copies of one expert or a few hundred rows
    # (megabytes), where a second thread gains little and, with the machine busy, every op waits
    # for it to be scheduled (a GGUF load took 3x the wall time and 2x the CPU with two threads)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with opened(files, opener) as handles:
            view = _view(model, handles)
            check_against_twin(model, view)
            model.held_weights = _plan_held(model, view)
            stream = _streaming(model, ops)
            _load_view(model, view, show_progress, allow_nonfinite, stream)
        return set() if stream is None else stream.finish()
    finally:
        torch.set_num_threads(threads)


def _streaming(model: Any, ops: Ops) -> Any:
    """Compressed weights converted as they load: online quantization and held checkpoint codes."""
    fmt = model.cfg.quantization
    scheme = fmt if fmt is not None and fmt.online else None
    if scheme is None and not (model.held_weights is not None and model.held_weights.params):
        return None
    try:
        return Streaming(model, model.held_weights, scheme, ops)
    except ValueError as exc:  # a layout that cuts a quantization group (online.check_split)
        raise WeightLoadError(str(exc)) from exc


def _plan_held(model: Any, view: CheckpointView) -> Any:
    """Quantized checkpoint weights that load as codes into compressed storage (quantization/held.py)."""
    if model.cfg.quantization is None or not model.cfg.quantization.holds_compressed:
        return None
    names, experts, tie = model.family.names, _experts_lookup(model), model.cfg.tie_word_embeddings
    local_layers = set(model.model.layer_range)

    def targets_of(key: str) -> list[tuple[str, bool]]:
        """(parameter, whether it reads the key as is: a picked part of a fused tensor is not held)."""
        layer = layer_index(canonical_key(key, model))
        if skip_rule(key, model) is not None or (layer is not None and layer not in local_layers):
            return []
        targets = checkpoint_targets(canonical_key(key, model), names, experts, tie) or []
        return [(name, pick is READ_AS_IS) for name, _, pick in targets]

    try:
        return plan(model, view, targets_of)
    except ValueError as exc:
        raise WeightLoadError(str(exc)) from exc


def _view(model: Any, handles: dict) -> CheckpointView:
    """The checkpoint through its weight format (layers/quantization): logical tensors only."""
    fmt = model.cfg.quantization
    if not hasattr(fmt, "view"):  # unquantized, or quantized online after loading
        return CheckpointView(handles)
    log.info("weights: %s", fmt.describe())
    try:
        return fmt.view(handles)
    except ValueError as exc:
        raise WeightLoadError(str(exc)) from exc


def _load_view(
    model: Any, view: CheckpointView, show_progress: bool, allow_nonfinite: bool, stream: Any = None
) -> None:
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {name: set() for name in params}
    local_layers = set(model.model.layer_range)
    experts, tie = _experts_lookup(model), model.cfg.tie_word_embeddings
    skipped: Counter = Counter()
    keys = view.keys()
    for key, path in tqdm(
        keys, desc="Loading safetensors", disable=not show_progress or len(view.handles) < 2
    ):
        with nonfinite_allowed(allow_nonfinite):
            rule = skip_rule(key, model)
            if rule is not None:
                skipped[rule] += 1
                continue
            try:
                _load_key(view, key, params, loaded, local_layers, experts, model, tie, stream)
            except SafetensorError as exc:
                raise WeightLoadError(f"cannot read {key!r} from {path}: {exc}") from exc
    for rule, count in sorted(skipped.items()):
        log.info("skipped %d checkpoint tensors by rule %r", count, rule)
    _check_complete(params, loaded)


def canonical_key(key: str, model: Any) -> str:
    """The family's canonical form of `key`; with the MTP layer built, a Qwen3-Next / Qwen3.5 MTP
    key (`mtp.*`) or a LongCat-Flash one (`model.mtp.*`) as DeepSeek's `model.layers.{num_layers}.*`
    (spec_decode/mtp_families.py)."""
    if getattr(model, "mtp", None) is not None:
        mapped = mtp_checkpoint_key(model.cfg.architecture, key, model.cfg.num_layers)
        if mapped is not None:
            return model.family.names.canonical(mapped)
    return model.family.names.canonical(key)


def skip_rule(key: str, model: Any) -> str | None:
    """The named rule that consumes `key` without loading it, if any: the family's own (e.g. a
    multimodal checkpoint's vision tower), or the multi-token-prediction layers stored after the
    last decoder layer (GLM-4.5, DeepSeek-V3; Qwen3-Next's `mtp.*`), which only speculative
    decoding would use."""
    names, cfg = model.family.names, model.cfg
    canonical = canonical_key(key, model)
    rule = names.skip_rule(key) if canonical == names.canonical(key) else None  # not a loaded mtp.* key
    if rule is not None:
        return rule
    layer = layer_index(canonical)
    if layer is not None and cfg.num_layers <= layer < cfg.num_layers + cfg.num_nextn_predict_layers:
        if getattr(model, "mtp", None) is None:
            return "mtp layers (num_nextn_predict_layers / num_mtp_modules; loaded for method mtp only)"
        if layer > cfg.num_layers:
            return "mtp layers after the first (one MTP layer drafts, chained, as in vLLM)"
        own = model.mtp.embed_tokens is not None  # a later pipeline stage: no target embedding
        if canonical.startswith(f"model.layers.{layer}.{SHARED_EMBEDDING}") and not own:
            return "the MTP layer copy of embed_tokens (the target embedding is used)"
    return None


def mtp_key(key: str, model: Any) -> str:
    """A canonical key of the loaded MTP layer `model.layers.{n}.*` as its parameter name (`mtp.*`:
    its head pieces, `mtp.layer.*`: its decoder layer); any other key as it is."""
    if getattr(model, "mtp", None) is None:
        return key
    prefix = f"model.layers.{model.cfg.num_layers}."
    if not key.startswith(prefix):
        return key
    rest = key[len(prefix) :]
    return "mtp." + rest if rest.startswith((*HEAD_PIECES, SHARED_EMBEDDING)) else "mtp.layer." + rest


# ---- the one-rank twin: full shapes and dtypes, before any rank slices ------------------------------
def _twin(model: Any) -> Any:
    """The same model class and config at one rank (every layer, expert and head), on meta."""
    groups = ParallelGroups.single()
    env = ModelEnv(groups, MoEPlan.decide(groups.layout, 0), "naive", range(model.cfg.num_layers))
    with torch.device("meta"):
        return type(model)(model.cfg, env)


def check_against_twin(model: Any, view: CheckpointView) -> None:
    twin = _twin(model)
    params, experts = dict(twin.named_parameters()), _experts_lookup(twin)
    for key, path in view.keys():
        if skip_rule(key, model) is not None:
            continue
        try:
            src = view.get_slice(key)
            shape, dtype = tuple(src.get_shape()), src.get_dtype()
        except SafetensorError as exc:
            raise WeightLoadError(f"cannot read {key!r} from {path}: {exc}") from exc
        except ValueError as exc:  # a weight format's pieces that do not fit together
            raise WeightLoadError(f"{exc} (in {path})") from exc
        names = twin.family.names
        if mtp_key(canonical_key(key, model), model) != names.canonical(key):
            continue  # the MTP layer: the twin has none; its loading checks shapes
        targets = checkpoint_targets(names.canonical(key), names, experts, model.cfg.tie_word_embeddings)
        _check_key(key, path, shape, dtype, targets or [], params)


def _check_key(key: str, path: str, shape: tuple[int, ...], dtype: str, targets: list, params: dict) -> None:
    where = f"checkpoint key {key!r} in {path}"
    meta = torch.empty(shape, device="meta")
    covered, partial = 0, False
    for name, shard, pick in targets:
        param = params.get(name)
        if param is None or shard not in param.expected_shards:
            continue  # an unknown key: the loading pass names it
        if param.is_floating_point() and not dtype.startswith(("F", "BF")):
            raise WeightLoadError(f"{where} has dtype {dtype}; parameter {name!r} needs floating point")
        try:
            part = pick(meta)
            with whole_tensors():
                param.weight_loader(param, part, shard)
        except ShapeMismatch as exc:
            raise WeightLoadError(
                f"{where} has shape {shape}; parameter {name!r} expects {exc.expected}"
                + ("" if exc.found == shape else f" for each of its slices (this one is {exc.found})")
            ) from exc
        except (ValueError, IndexError, RuntimeError) as exc:
            raise WeightLoadError(f"{where} (shape {shape}) does not fit parameter {name!r}: {exc}") from exc
        if tuple(part.shape) != shape:  # a slice of a fused tensor (one expert, one half)
            partial, covered = True, covered + part.numel()
    if partial and covered != meta.numel():
        raise WeightLoadError(
            f"{where} has shape {shape}, but the model reads {covered} of its {meta.numel()} values "
            "(a tensor larger than its parameters)"
        )


def _load_key(f: Any, key: str, params, loaded, local_layers, experts, model, tie, stream=None) -> None:
    checkpoint_key, key = key, mtp_key(canonical_key(key, model), model)
    layer = layer_index(key)
    if layer is not None and not 0 <= layer < model.cfg.num_layers:
        raise WeightLoadError(
            f"checkpoint key {checkpoint_key!r} names layer {layer}, but the model has {model.cfg.num_layers}"
        )
    if layer is not None and layer not in local_layers:
        return  # another pipeline stage owns it
    targets = checkpoint_targets(key, model.family.names, experts, tie)
    if key == "model.embed_tokens.weight" and _mtp_needs_target_embedding(model):
        targets = [*targets, *(("mtp.embed_tokens.weight", s, p) for n, s, p in targets if n == key)]
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
            if stream is not None:
                stream.before(name, shard)
            param.weight_loader(param, pick(f.get_slice(checkpoint_key)), shard)
        except NonFinite as exc:
            raise WeightLoadError(
                f"checkpoint key {key!r} holds non-finite weights ({exc}); pass allow_nonfinite_weights=True "
                "to load it anyway"
            ) from exc
        except ValueError as exc:  # name the checkpoint key, not just the shapes
            raise WeightLoadError(f"checkpoint key {key!r} does not fit parameter {name!r}: {exc}") from exc
        loaded[name].add(shard)
        if stream is not None:
            stream.after(name, shard)


def _mtp_needs_target_embedding(model: Any) -> bool:
    """A Qwen3-Next / Qwen3.5 / DeepSeek-V4 MTP layer on a later pipeline stage: its checkpoint has no
    copy of the embedding under the MTP layer (Qwen's mtp_use_dedicated_embeddings false), so it
    loads the target's."""
    mtp = getattr(model, "mtp", None)
    if mtp is None or mtp.embed_tokens is None:
        return False
    return not mtp_family(model.cfg.architecture).embedding_copy


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
