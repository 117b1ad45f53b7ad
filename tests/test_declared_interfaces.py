"""Interfaces declared once and checked, instead of probed:
- the quantized code kinds: cpu/csrc/quant_kinds.h's defines carry the number and, in their comment,
  the Python name; layers/cpu_kernels.QUANT_KINDS lists the names in number order (read from the
  header's text, no compiler needed, and from the built library where there is one);
- every weight format ModelConfig.quantization can hold satisfies model_config.WeightFormat;
- the loader's "read as is" pick is one declared function, not a name compared."""

from __future__ import annotations

import re

import pytest

from expertmesh.config.model_config import WeightFormat
from expertmesh.cpu import cpu_kernels, kernel_library
from expertmesh.layers.quantization.codes import BF16_PAIRS, KINDS
from expertmesh.layers.quantization.registry import resolve
from expertmesh.models.checkpoint import READ_AS_IS, checkpoint_targets
from expertmesh.models.mixtral import MixtralForCausalLM

HEADER = kernel_library.SOURCE.parent / "quant_kinds.h"


def _header_kinds(text: str) -> dict[int, str]:
    found = re.findall(r"#define Q_KIND_\w+ (\d+)\s*/\* ([\w-]+):", text)
    return {int(code): name for code, name in found}


def test_header_numbers_the_python_kinds():
    kinds = _header_kinds(HEADER.read_text())
    assert kinds == dict(enumerate(cpu_kernels.QUANT_KINDS))
    assert f"#define Q_KINDS {len(cpu_kernels.QUANT_KINDS)} " in HEADER.read_text()
    assert {name: kinds[code] for name, code in KINDS.items()} == {n: n for n in KINDS}
    assert {name: kinds[code] for name, code in BF16_PAIRS.items()} == {n: f"{n}-bf16" for n in BF16_PAIRS}


def test_the_parser_sees_a_mismatch():
    text = HEADER.read_text()
    assert len(_header_kinds(text)) == len(cpu_kernels.QUANT_KINDS)  # it reads every define
    bad = text.replace("#define Q_KIND_A4 5 ", "#define Q_KIND_A4 6 ")
    assert bad != text and _header_kinds(bad) != dict(enumerate(cpu_kernels.QUANT_KINDS))


def test_the_built_library_knows_every_kind():
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C compiler here: the header test above still holds")
    assert kernels.quant_kinds == cpu_kernels.QUANT_KINDS


QUANTIZATION_CONFIGS = [
    {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
    {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    {"quant_method": "mxfp4"},
]


@pytest.mark.parametrize("config", QUANTIZATION_CONFIGS, ids=lambda c: c["quant_method"])
def test_every_weight_format_is_a_weight_format(config):
    fmt = resolve(config, None)
    assert isinstance(fmt, WeightFormat) and fmt.method == config["quant_method"]
    assert fmt.holds_compressed and not fmt.online
    for online in ("dequantize", config["quant_method"] if config["quant_method"] == "fp8" else None):
        if online is not None:
            assert isinstance(resolve(config, online), WeightFormat)
    assert not resolve(config, "dequantize").holds_compressed


def test_online_schemes_are_weight_formats_that_hold_no_checkpoint_codes():
    scheme = resolve(None, "int4-g32")
    assert isinstance(scheme, WeightFormat) and scheme.online and not scheme.holds_compressed
    assert not isinstance(object(), WeightFormat)  # the protocol check can fail


def test_read_as_is_is_the_plain_targets_pick():
    names = MixtralForCausalLM.family.names
    plain = checkpoint_targets("model.layers.0.self_attn.o_proj.weight", names, None, False)
    assert [pick is READ_AS_IS for _, _, pick in plain] == [True]
    fused = checkpoint_targets("model.layers.0.mlp.gate_up_proj.weight", names, None, False)
    assert [pick is READ_AS_IS for _, _, pick in fused] == [False, False]  # halves are sliced
