"""config.json read as transformers reads it, after the fixes some published files need.

transformers 5 validates config fields strictly, and a few published checkpoints carry values its
classes reject although their own code reads them: Llama 4 Scout and Maverick ship
`"attn_temperature_tuning": 4` (the reference code tests it for truth; transformers wants a bool);
Kimi-K2 ships `"model_type": "kimi_k2"`, which transformers reads only with remote code.
Each fix is a named rule; a rule that changes a field logs what it changed, and a file that needs
no fix goes to `AutoConfig.from_pretrained` untouched.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

log = logging.getLogger("expertmesh")


def _truthy_temperature_tuning(part: dict) -> str | None:
    value = part.get("attn_temperature_tuning")
    if type(value) is int:  # bool is an int subclass: only a plain int is rewritten
        part["attn_temperature_tuning"] = bool(value)
        return f"attn_temperature_tuning {value} read as {bool(value)} (the reference code tests its truth)"
    return None


def _kimi_k2_as_deepseek_v3(part: dict) -> str | None:
    # Kimi-K2's published model_type (also in Kimi-K2.5's text_config) is not registered in
    # transformers, whose reading needs remote code; its auto_map names DeepseekV3Config.
    if part.get("model_type") == "kimi_k2":
        part["model_type"] = "deepseek_v3"
        return "model_type 'kimi_k2' read as 'deepseek_v3' (its auto_map's DeepseekV3Config)"
    return None


# name -> rule over one config level (the top level and its text_config, where there is one)
CONFIG_FIXES: dict[str, Callable[[dict], str | None]] = {
    "attn_temperature_tuning as bool": _truthy_temperature_tuning,
    "kimi_k2 as deepseek_v3": _kimi_k2_as_deepseek_v3,
}


def fix_config_dict(config: dict) -> list[str]:
    """Apply every rule in place to `config` and its text_config; the changes made, in words."""
    changes = []
    for part in (config, config.get("text_config")):
        if not isinstance(part, dict):
            continue
        for rule in CONFIG_FIXES.values():
            change = rule(part)
            if change:
                changes.append(change)
    return changes


def load_hf_config(model_dir: str, trust_remote_code: bool = False) -> Any:
    """The transformers config of a local checkpoint directory, published quirks fixed."""
    # transformers takes seconds to import: loaded when a config is read, not at `expertmesh --help`
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = os.path.join(model_dir, "config.json")
    raw = None
    if os.path.isfile(path):
        with open(path) as f:
            raw = json.load(f)
    changes = fix_config_dict(raw) if isinstance(raw, dict) else []
    if not changes or raw.get("model_type") not in CONFIG_MAPPING:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    for change in changes:
        log.info("config.json of %s: %s", model_dir, change)
    return CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
