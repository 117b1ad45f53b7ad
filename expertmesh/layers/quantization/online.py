"""Online quantization of an unquantized checkpoint: `LLM(quantization="int8")`.

After loading, every linear layer's weight (not the router, embeddings or head) and every routed
expert's is quantized once and held compressed (layers/quantization/packed.py). Schemes, as vLLM's
`--quantization` names them, each with one float32 scale and offset per group of 128 consecutive
inputs of an output row:

- "int8": symmetric (amax / 127): 1 + 8 / 128 = 1.0625 bytes a weight;
- "int4": asymmetric (scale (max - min) / 15 and a zero point): 0.5 + 8 / 128 = 0.5625 bytes;
- "fp8": e4m3 (amax / 448), multiplied by lookup of the 256 codes: 1.0625 bytes;
- "w8a8": int8 weights as "int8", and activations quantized too, at run time, per token (row) and
  group of the same inputs (dynamic, symmetric int8, as llama.cpp's Q8_0 and vLLM's w8a8 dynamic
  per token): the products are integer sums, scaled once a group. It rounds the activations as
  well, so it is its own scheme, never the default of "int8" (docs/quantization.md);
- "w4a8": int4 weights as "int4" (0.5625 bytes), activations quantized as in "w8a8".

The first three are weight-only: activations stay in the model dtype.

A suffix picks another group: "int4-g32" (32 inputs), "int8-ch" (one scale per output channel).
"+head" quantizes the LM head too, with the same scheme ("int8+head", "w4a8-g32+head"): it is
float32 by default, as vLLM keeps it; llama.cpp's Q8_0 holds it as Q8_0. A tied head gets its own
compressed copy (the embedding's rows stay float for the lookup).

Groups are laid in the checkpoint tensor's frame, so every parallel layout quantizes a weight
alike: a layer whose input dim is split over ranks (row-parallel under TP, experts' down
projection split over the expert shards) needs each rank's slice to hold whole groups; otherwise
it is an error naming the sizes (nothing is padded).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

DEFAULT_GROUP = 128


@dataclass(frozen=True)
class OnlineScheme:
    method: str  # a key of METHODS
    group_size: int = DEFAULT_GROUP  # inputs per scale; 0: one scale per output channel
    online: bool = True
    lm_head: bool = False  # "+head": the LM head quantized too
    holds_compressed: ClassVar[bool] = False  # a checkpoint's codes: none (it quantizes dense weights)

    METHODS: ClassVar[tuple[str, ...]] = ("fp8", "int4", "int8", "w4a8", "w8a8")

    @classmethod
    def parse(cls, name: str) -> OnlineScheme:
        m = re.fullmatch(r"(\w+?)(?:-(?:g(\d+)|(ch)))?(\+head)?", str(name))
        if m is None or m.group(1) not in cls.METHODS or (m.group(2) is not None and int(m.group(2)) < 1):
            raise ValueError(
                f"quantization={name!r} is not known; known: {list(cls.METHODS)}, optionally with a group "
                "suffix ('-g32': 32 inputs a scale, '-ch': one scale per output channel) and '+head' (the "
                "LM head quantized too)"
            )
        group = 0 if m.group(3) else int(m.group(2) or DEFAULT_GROUP)
        step = {"w8a8": 4, "w4a8": 8}.get(m.group(1), 1)  # inputs the kernel's integer products take at once
        if group % step:
            raise ValueError(
                f"quantization={name!r}: {m.group(1)} needs groups of a multiple of {step} inputs (or '-ch')"
            )
        return cls(m.group(1), group, lm_head=m.group(4) is not None)

    @property
    def kind(self) -> str:
        return self.method

    @property
    def name(self) -> str:
        group = "-ch" if not self.group_size else f"-g{self.group_size}"
        return self.method + group + ("+head" if self.lm_head else "")

    def describe(self) -> str:
        group = "per output channel" if not self.group_size else f"groups of {self.group_size}"
        head = ", the LM head too" if self.lm_head else ""
        if self.method in ("w8a8", "w4a8"):
            return (
                f"online {self.method} (int{self.method[1]} weights, {group}; activations int8 per token and "
                f"group{head}), held compressed"
            )
        return f"online {self.method} weight-only ({group}{head}), held compressed"

    def check_split(self, what: str, local_in: int, shards: int) -> None:
        """A rank holding 1/shards of the input dim must hold whole groups."""
        if shards > 1 and (not self.group_size or local_in % self.group_size):
            group = "one scale per output channel" if not self.group_size else f"groups of {self.group_size}"
            raise ValueError(
                f"quantization={self.name!r} ({group}): {what} splits its input dim "
                f"{local_in * shards} over {shards} ranks, {local_in} a rank, which cuts a group; choose "
                "a group that divides it (e.g. quantization='"
                f"{self.method}-g{_largest_group(local_in)}') or a layout that does not split it"
            )


def _largest_group(n: int) -> int:
    return max(g for g in (1, 2, 4, 8, 16, 32, 64, 128) if n % g == 0)
