"""Where a model's files come from: a local directory, the hub, or the embedded default."""

from __future__ import annotations

import os
from collections.abc import Callable

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "default_model")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
# Other file formats that resolve to a checkpoint directory: name -> (claims(model), model_dir(model)).
# A format registers itself from above (models/gguf registers GGUF files when it is imported, which
# the engine builder does), so this module imports nothing above config/.
SOURCES: dict[str, tuple[Callable[[str], bool], Callable[[str], str]]] = {}


def register_source(name: str, claims: Callable[[str], bool], model_dir: Callable[[str], str]) -> None:
    """A model format: `claims(model)` says whether a path is one, `model_dir(model)` turns it into a
    directory holding config.json (and whatever its loader reads)."""
    SOURCES[name] = (claims, model_dir)


def resolve_model(model: str | None, revision: str | None = None) -> str:
    """A local directory holding config.json, fetching a hub id with huggingface_hub if needed
    (for a GGUF file or a directory of one: the directory made from its metadata)."""
    if model is None:
        model = DEFAULT_MODEL_DIR
    for claims, model_dir in SOURCES.values():  # GGUF (models/gguf): config and tokenizer from its metadata
        if claims(model):
            return model_dir(model)
    if os.path.isdir(model):
        if not os.path.exists(os.path.join(model, "config.json")):
            raise FileNotFoundError(f"model directory {model!r} has no config.json")
        return model
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise FileNotFoundError(f"model path {model!r} does not exist")
    return _download(model, revision)


def _download(repo_id: str, revision: str | None) -> str:
    from huggingface_hub import snapshot_download  # slow to import; only a hub id needs it

    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=_HUB_PATTERNS)
    except Exception as exc:  # offline, unknown repo, gated: one clear message either way
        reason = " ".join(str(exc).split())
        raise RuntimeError(
            f"could not fetch model {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: {reason}). "
            "If this machine is offline, download it elsewhere and pass its local directory as model=."
        ) from exc
