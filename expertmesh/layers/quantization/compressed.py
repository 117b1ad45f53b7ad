"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, llm-compressor's format),
read with the `compressed-tensors` package (its config models, name matching, unpacking and
dequantization), not a parser of our own.

`config_groups` map `targets` (`Linear`: every quantized linear; `re:...`: a regex over module
names) to a scheme; `ignore` names what stays unquantized (lm_head, the routers). Per quantized
linear `X`, by `format`:
- `pack-quantized`: `X.weight_packed` int32 [out, in * bits / 32] (values offset by 2^(bits-1),
  packed densely along the input dim), `X.weight_shape` [out, in], `X.weight_scale` [out, groups]
  and, asymmetric, `X.weight_zero_point` int32 packed along the output dim;
- `int-quantized` / `naive-quantized`: `X.weight` int8 [out, in], `X.weight_scale` and an int8
  `X.weight_zero_point` when asymmetric.
W = (q - zero) * scale per group (or channel, or tensor). What is read: int weights of 4 or 8 bits,
group / channel / tensor strategies, symmetric or not, weight-only (W4A16, W8A16), or with dynamic
activation quantization (W8A8 int), which is run weight-only (activations stay in the model
dtype). A rank's slice reads the packed rows it covers (whole rows: values pack along the input
dim) and the scales and zero points of those rows. Dequantized to the model dtype at load (logged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from expertmesh.layers.quantization.view import CheckpointView, LogicalTensor

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
STRATEGIES = ("group", "channel", "tensor")
PARTS = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point")
SUPPORTED = (
    f"int weights of 4 or 8 bits, strategies {list(STRATEGIES)}, symmetric or with weight_zero_point, "
    "no input activation quantization or a dynamic int one (run weight-only), formats "
    f"{list(FORMATS)}"
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def describe_scheme(scheme: Any, fmt: str | None) -> str:
    w, a = scheme.weights, scheme.input_activations
    if w is None:
        return f"no weight quantization (format {fmt!r})"
    group = f"group {w.group_size}" if w.strategy == "group" else str(w.strategy)
    sym = "symmetric" if w.symmetric else "asymmetric"
    extra = "" if w.actorder is None else f", actorder {w.actorder!r}"
    acts = (
        "none" if a is None else f"{a.type}{a.num_bits} {a.strategy} {'dynamic' if a.dynamic else 'static'}"
    )
    return f"{w.type}{w.num_bits} weights ({group}, {sym}{extra}), input activations {acts}, format {fmt!r}"


def _check_scheme(name: str, scheme: Any, fmt: str | None) -> None:
    w, a = scheme.weights, scheme.input_activations
    ok = (
        fmt in FORMATS
        and w is not None
        and w.type == "int"
        and w.num_bits in (4, 8)
        and w.strategy in STRATEGIES
        and w.actorder is None
        and w.block_structure is None
        and (fmt == "pack-quantized" or w.num_bits == 8)
        and (a is None or (a.type == "int" and a.dynamic in (True, "local")))
        and scheme.output_activations is None
    )
    if not ok:
        raise ValueError(
            f"compressed-tensors config_groups[{name!r}] ({describe_scheme(scheme, fmt)}) is not "
            f"supported; supported: {SUPPORTED}"
        )


@dataclass(frozen=True)
class CompressedTensorsFormat:
    config: Any  # compressed_tensors.quantization.QuantizationConfig
    method: str = "compressed-tensors"
    online: bool = False
    holds_compressed = True  # int codes held as stored where they map exactly (quantization/held.py)

    @classmethod
    def from_config(cls, cfg: dict) -> CompressedTensorsFormat:
        # optional dependency (compressed-tensors): only its checkpoints need it
        from compressed_tensors.quantization import QuantizationConfig

        for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
            if cfg.get(key):
                raise ValueError(
                    f"compressed-tensors {key}={cfg[key]!r} is not supported; supported: {SUPPORTED}, "
                    "without sparsity, transforms or a kv_cache_scheme"
                )
        fields = set(QuantizationConfig.model_fields)
        config = QuantizationConfig.model_validate({k: v for k, v in cfg.items() if k in fields})
        if not config.config_groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        for name, scheme in config.config_groups.items():
            _check_scheme(name, scheme, scheme.format or config.format)
        return cls(config)

    def schemes(self) -> list[tuple[str, Any, str]]:
        return [(n, s, s.format or self.config.format) for n, s in self.config.config_groups.items()]

    def describe(self) -> str:
        groups = "; ".join(describe_scheme(s, f) for _, s, f in self.schemes())
        acts = any(s.input_activations is not None for _, s, _ in self.schemes())
        return f"compressed-tensors ({groups})" + (
            ", run weight-only (activations in the model dtype)" * acts
        )

    def scheme_of(self, module: str) -> tuple[Any, str] | None:
        """The first config group whose targets name this module (`Linear`: any quantized one)."""
        # optional dependency (compressed-tensors): only its checkpoints need it
        from compressed_tensors.utils.match import match_name

        for _, scheme, fmt in self.schemes():
            if any(t == "Linear" or match_name(module, t) for t in scheme.targets):
                return scheme, fmt
        return None

    def ignored(self, module: str) -> bool:
        # optional dependency (compressed-tensors): only its checkpoints need it
        from compressed_tensors.utils.match import match_name

        return any(match_name(module, t) for t in self.config.ignore or ())

    def view(self, handles: dict[str, Any]) -> CheckpointView:
        return CompressedView(handles, self)


class CompressedTensor(LogicalTensor):
    """One quantized linear's `weight` [out, in], dequantized per requested region."""

    def __init__(self, base: str, parts: dict[str, Any], scheme: Any, fmt: str) -> None:
        self.base, self.parts, self.args, self.fmt = base, parts, scheme.weights, fmt
        packed = fmt == "pack-quantized"
        if packed:
            self.shape = tuple(int(v) for v in parts["weight_shape"][:].tolist())
        else:
            self.shape = tuple(parts["weight"].get_shape())
        shapes = {k: tuple(p.get_shape()) for k, p in parts.items()}
        words = (self.shape[0], _cdiv(self.shape[1] * self.args.num_bits, 32)) if packed else None
        if len(self.shape) != 2 or shapes["weight_scale"] != self._scale_shape() or (
            packed and shapes["weight_packed"] != words
        ):  # fmt: skip
            raise ValueError(
                f"compressed-tensors {base}: parts {shapes} do not fit a weight of shape {self.shape} "
                f"({describe_scheme(scheme, fmt)}; weight_scale should be {self._scale_shape()})"
            )
        if not self.args.symmetric and "weight_zero_point" not in parts:
            raise ValueError(f"compressed-tensors {base}: asymmetric scheme without {base}.weight_zero_point")
        group = self.args.group_size if self.args.strategy == "group" else 0
        self.held_kind = (f"int{self.args.num_bits}", group)

    def _scale_shape(self) -> tuple[int, ...]:
        out_f, in_f = self.shape
        if self.args.strategy == "group":
            return (out_f, _cdiv(in_f, self.args.group_size))
        return (out_f, 1) if self.args.strategy == "channel" else (1,)

    def _rows(self, key: str, o0: int, o1: int) -> torch.Tensor:
        return self.parts[key][:] if self.args.strategy == "tensor" else self.parts[key][o0:o1]

    def _zero_point(self, o0: int, o1: int) -> torch.Tensor | None:
        if self.args.symmetric:
            return None
        if self.fmt != "pack-quantized" or self.args.strategy == "tensor":
            return self._rows("weight_zero_point", o0, o1)
        # optional dependency (compressed-tensors): only its checkpoints need it
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        p = 32 // self.args.num_bits  # values a word, packed along the output dim
        words = self.parts["weight_zero_point"][o0 // p : _cdiv(o1, p)]
        z = unpack_from_int32(words, self.args.num_bits, (words.shape[0] * p, words.shape[1]), packed_dim=0)
        return z[o0 - o0 // p * p :][: o1 - o0]

    def codes(self, o0: int, o1: int) -> torch.Tensor:
        """Rows [o0, o1) of the int8 values q (whole rows: they pack along the input dim)."""
        if self.fmt != "pack-quantized":
            return self.parts["weight"][o0:o1]
        # optional dependency (compressed-tensors): only its checkpoints need it
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        packed = self.parts["weight_packed"][o0:o1]
        return unpack_from_int32(packed, self.args.num_bits, (o1 - o0, self.shape[1]))

    def quantized(self, rows: tuple[int, int], cols: tuple[int, int], group: int, g0: int) -> tuple:
        """W = (q - z) * s = code * s + offset: int8 codes are q; int4 codes q + 8 (uint4), offset
        -(z + 8) * s."""
        (o0, o1), (i0, i1) = rows, cols
        n, g = o1 - o0, _cdiv(i1 - i0, group)
        q = self.codes(o0, o1)[:, i0:i1].to(torch.int16)
        s = self._rows("weight_scale", o0, o1).to(torch.float32).reshape(-1, self._scale_shape()[-1])
        z = self._zero_point(o0, o1)
        z = torch.zeros_like(s) if z is None else z.to(torch.float32).reshape(s.shape)
        if self.args.strategy == "group":
            s, z = s[:, g0 : g0 + g], z[:, g0 : g0 + g]
        s, z = s.expand(n, g), z.expand(n, g)
        if self.args.num_bits == 4:
            return (q + 8).to(torch.uint8), s, -(z + 8) * s
        return q.to(torch.int8).view(torch.uint8), s, -z * s

    def materialize(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        # optional dependency (compressed-tensors): only its checkpoints need it
        from compressed_tensors.quantization.lifecycle.forward import dequantize

        (o0, o1), (i0, i1) = bounds
        scale = self._rows("weight_scale", o0, o1).to(torch.float32)
        w = dequantize(self.codes(o0, o1), scale, self._zero_point(o0, o1), self.args, dtype=torch.float32)
        return w[:, i0:i1]


class CompressedView(CheckpointView):
    """Quantized linears served as their logical `X.weight`; their parts consumed with them."""

    def __init__(self, handles: dict[str, Any], fmt: CompressedTensorsFormat) -> None:
        super().__init__(handles)
        self.fmt, self.quantized = fmt, {}
        for key in self.file_of:
            base, _, part = key.rpartition(".")
            if part in ("input_scale", "input_zero_point", "output_scale", "weight_g_idx"):
                raise ValueError(
                    f"checkpoint tensor {key!r} is not read (static activation scales, activation "
                    f"ordering); supported: {SUPPORTED}"
                )
            if part in ("weight_packed", "weight_scale") and base not in self.quantized:
                self.quantized[base] = self._scheme(key, base)

    def _scheme(self, key: str, base: str) -> tuple[Any, str]:
        if self.fmt.ignored(base):
            raise ValueError(
                f"checkpoint tensor {key!r} is quantized, but {base!r} is in the config's ignore list"
            )
        found = self.fmt.scheme_of(base)
        if found is None:
            targets = [t for _, s, _ in self.fmt.schemes() for t in s.targets]
            raise ValueError(
                f"checkpoint tensor {key!r} is quantized, but no config_groups target ({targets}) "
                f"names {base!r}"
            )
        scheme, fmt = found
        need = ["weight_packed", "weight_shape"] if fmt == "pack-quantized" else ["weight"]
        missing = [f"{base}.{n}" for n in [*need, "weight_scale"] if f"{base}.{n}" not in self.file_of]
        if missing:
            raise ValueError(f"compressed-tensors tensor {key!r} ({fmt}) comes without {missing}")
        return scheme, fmt

    def keys(self) -> list[tuple[str, str]]:
        out = []
        for key, path in super().keys():
            base, _, part = key.rpartition(".")
            if base not in self.quantized or part not in (*PARTS, "weight"):
                out.append((key, path))
            elif part == ("weight_packed" if self.quantized[base][1] == "pack-quantized" else "weight"):
                out.append((f"{base}.weight", path))
        return out

    def get_slice(self, key: str) -> Any:
        base, _, part = key.rpartition(".")
        if part != "weight" or base not in self.quantized:
            return self.stored(key)
        scheme, fmt = self.quantized[base]
        names = [*PARTS, "weight"] if fmt != "pack-quantized" else PARTS
        parts = {n: self.stored(f"{base}.{n}") for n in names if f"{base}.{n}" in self.file_of}
        return self.serve(key, CompressedTensor(base, parts, scheme, fmt))
