"""quantization_config {"quant_method": "gguf"}: what models/gguf writes into a GGUF model's config
for the block types it holds as stored. The tensors themselves (codes, scales, offsets) come from
models/gguf/tensors.py; this is only the format's declaration the registry maps the method to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GGUFFormat:
    """quantization_config {"quant_method": "gguf"}: matrices of the HELD types held as int8 / int4
    codes with a scale and offset per group (32, Q6_K 16), MXFP4 as fp4 codes with a scale per 32;
    every other type dequantized at load."""

    held_types: tuple[str, ...] = ()
    method: str = "gguf"
    online: bool = False
    holds_compressed = True

    @classmethod
    def from_config(cls, cfg: dict) -> GGUFFormat:
        return cls(tuple(cfg.get("held_types", ())))

    def describe(self) -> str:
        return f"gguf, {'/'.join(self.held_types) or 'no'} matrices held as their codes (int or fp4)"

    def name(self) -> str:
        return "gguf"

    def view(self, handles: dict[str, Any]) -> Any:
        from expertmesh.layers.quantization.view import CheckpointView

        class GGUFView(CheckpointView):
            def get_slice(self, key: str) -> Any:  # codes where the plan holds the key
                return self.serve(key, self.stored(key))

        return GGUFView(handles)
