"""Every build variant of the C kernels compiles on every x86 machine, whatever its CPU (issue 41).

CI runs on whichever CPU it gets (AVX2 Zen 3, AVX-512 Zen 5, Intel with AMX): the code behind
`#if defined(__AVX512VNNI__)` and the like is only compiled where the compiler is told the
feature exists, so each variant is built here with explicit -m flags (compiling for a feature
this CPU lacks is fine; only running it is not). -Wall -Werror: a warning in any variant fails.
-O0 -c: intrinsics and always_inline helpers are still checked and expanded, at a fraction of
-O3's time. Each variant's object must hold the instruction its feature adds, so a block that
no longer compiles in (a misspelt macro) fails too. The variant this CPU runs is built at -O3
and loaded by the `kernels` fixture (tests/conftest.py); the -mno-avx512f one by `generic_kernels`.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from expertmesh.cpu import kernel_library

V4 = ["-march=x86-64-v4"]  # AVX-512 F/BW/VL/DQ/CD: no BF16, VBMI or VNNI
NO_EXTRAS = ["vdpbf16ps", "vpdpbusd", "vpmultishiftqb"]  # BF16, VNNI, VBMI instructions
# name -> (flags, instructions the object must contain, instructions it must not)
VARIANTS = {
    # no AVX2 either (psabi: a note that vector arguments change ABI without AVX, not a defect)
    "generic x86-64": (["-march=x86-64", "-Wno-psabi"], [], ["ymm"]),
    "AVX2": (["-march=x86-64-v3"], ["ymm"], ["zmm"]),
    "AVX-512F only": (
        ["-march=x86-64-v3", "-mavx512f"],
        ["zmm"],
        ["vdpbf16ps", "vpdpbusd", "vpmultishiftqb"],
    ),
    "AVX-512 F/BW/VL/DQ": (V4, ["zmm"], NO_EXTRAS),
    "+BF16": ([*V4, "-mavx512bf16"], ["vdpbf16ps"], ["vpdpbusd"]),
    "+VBMI": ([*V4, "-mavx512vbmi"], ["vpmultishiftqb"], ["vdpbf16ps", "vpdpbusd"]),
    "+VNNI": ([*V4, "-mavx512vnni"], ["vpdpbusd"], ["vdpbf16ps"]),
    "+BF16+VBMI+VNNI (Zen 4/5)": (
        [*V4, "-mavx512bf16", "-mavx512vbmi", "-mavx512vnni"],
        ["vdpbf16ps", "vpdpbusd"],
        [],
    ),
    # Sapphire Rapids: AMX tiles on top; the AMX products themselves go to oneDNN (test_amx_dispatch)
    "AMX (sapphirerapids)": (["-march=sapphirerapids"], ["vdpbf16ps", "vpdpbusd", "vpmultishiftqb"], []),
}


def _compile(compiler: str, flags: list[str], out: str) -> subprocess.CompletedProcess:
    cmd = [compiler, "-O0", "-fopenmp", "-fPIC", "-Wall", "-Werror", *flags, "-c", str(kernel_library.SOURCE)]
    return subprocess.run([*cmd, "-o", out], capture_output=True, text=True)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 -m flags")
@pytest.mark.timeout(300)
def test_every_variant_compiles_without_warnings(tmp_path):
    compiler = kernel_library.compiler()
    assert compiler is not None, "no C compiler: the kernels cannot be built (set CC)"
    outs = {name: str(tmp_path / f"v{i}.o") for i, name in enumerate(VARIANTS)}
    with ThreadPoolExecutor(2) as pool:  # two at a time: CI has two cores
        results = dict(
            zip(
                VARIANTS,
                pool.map(lambda n: _compile(compiler, VARIANTS[n][0], outs[n]), VARIANTS),
                strict=True,
            )
        )
    failed = {name: r.stderr[-3000:] for name, r in results.items() if r.returncode != 0}
    assert not failed, "\n".join(f"--- {name} ---\n{err}" for name, err in failed.items())
    objdump = shutil.which("objdump")
    if objdump is None:
        return  # binutils come with the compiler on every image seen; the compile itself was checked
    for name, (_, must, must_not) in VARIANTS.items():
        text = subprocess.run([objdump, "-d", outs[name]], capture_output=True, text=True, check=True).stdout
        missing = [i for i in must if i not in text]
        assert not missing, f"{name}: no {missing} in the object: that feature's code was not compiled in"
        extra = [i for i in must_not if i in text]
        assert not extra, f"{name}: {extra} in the object, which this variant's CPU does not have"
