"""tools/restructure.py (issue 34's moves): its rewriting of imports, dotted names and paths, on
text written here, is right and idempotent, and the repository is fully moved (--check finds
nothing to do: no module or path of the old layout is left)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("restructure", ROOT / "tools" / "restructure.py")
restructure = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(restructure)

PY = ROOT / "tests" / "example.py"  # where the text is said to live (outside expertmesh/cpu/)

CASES = [
    ("from expertmesh.layers import cpu_kernels\n", "from expertmesh.cpu import cpu_kernels\n"),
    (
        "    from expertmesh.layers import cpu_gemm, linear  # noqa: E402\n",
        "    from expertmesh.cpu import cpu_gemm  # noqa: E402\n"
        "    from expertmesh.layers import linear  # noqa: E402\n",
    ),
    ("from expertmesh.layers import native_desc as nd\n", "from expertmesh.cpu import native_desc as nd\n"),
    ("from expertmesh import model_config\n", "from expertmesh.config import model_config\n"),
    ("from expertmesh.layers.cpu_kernels import CpuKernels\n",
     "from expertmesh.cpu.cpu_kernels import CpuKernels\n"),
    ("from expertmesh.model_config import ModelConfig\n",
     "from expertmesh.config.model_config import ModelConfig\n"),
    ("from expertmesh.config import ParallelConfig\n", "from expertmesh.config import ParallelConfig\n"),
    ('patch("expertmesh.layers.huge_pages.advise")\n', 'patch("expertmesh.cpu.huge_pages.advise")\n'),
    ("see layers/cpu_kernels.py and csrc/gemm.c\n", "see cpu/cpu_kernels.py and cpu/csrc/gemm.c\n"),
    ("expertmesh/csrc/attention.c, expertmesh/model_source.py\n",
     "expertmesh/cpu/csrc/attention.c, expertmesh/config/model_source.py\n"),
    ('expertmesh = ["default_model/*", "csrc/*.c"]\n', 'expertmesh = ["default_model/*", "cpu/csrc/*.c"]\n'),
    ("hf_config.py, expertmesh.layers.cpu_kernels_x\n", "hf_config.py, expertmesh.layers.cpu_kernels_x\n"),
]  # fmt: skip


@pytest.mark.parametrize("old, new", CASES)
def test_rewrite_is_right_and_idempotent(old, new):
    assert restructure.rewrite(old, PY) == new
    assert restructure.rewrite(new, PY) == new


def test_inside_cpu_csrc_stays_relative_and_the_kernel_source_is_found():
    path = ROOT / "expertmesh" / "cpu" / "cpu_kernels.py"
    old = 'SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_kernels.c"  # csrc/gemm.c\n'
    new = 'SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_kernels.c"  # csrc/gemm.c\n'
    assert restructure.rewrite(old, path) == new == restructure.rewrite(new, path)


def test_the_repository_has_the_new_layout():
    assert restructure.pending_moves() == []
    assert restructure.main(["--check"]) == 0
