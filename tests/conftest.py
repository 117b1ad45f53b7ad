import os

import pytest
from checkpoints import FAMILIES, make_checkpoint, train_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tokenizer"))
    train_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, tokenizer_dir):
    """checkpoint(family, **config_overrides) -> directory, made once per distinct request."""
    made: dict[tuple, str] = {}

    def make(family: str, seed: int = 0, **overrides) -> str:
        key = (family, seed, tuple(sorted(overrides.items())))
        if key not in made:
            assert family in FAMILIES, family
            path = str(tmp_path_factory.mktemp(family))
            made[key] = make_checkpoint(family, path, tokenizer_dir, seed, **overrides)
        return made[key]

    return make
