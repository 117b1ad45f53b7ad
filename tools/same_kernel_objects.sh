#!/usr/bin/env bash
# Whether a change to expertmesh/cpu/csrc/ leaves the compiled kernels unchanged, byte for byte:
# builds cpu_kernels.c at REV (default HEAD) and in the working tree for six ISA variants (the host,
# -mno-avx512f, AVX2, generic x86-64, AVX-512 F/BW/VL/DQ, Sapphire Rapids) at -O3, and compares
# every section's contents and relocations (objdump -s -r). For refactors that move or rename
# code without changing it (a file split, a local variable renamed): exit 0 when every variant is
# identical. Usage: tools/same_kernel_objects.sh [REV]
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:-HEAD}
cc=${CC:-gcc}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/old"
git archive "$rev" expertmesh/cpu/csrc | tar -x -C "$tmp/old"
variants=("-march=native" "-march=native -mno-avx512f" "-march=x86-64-v3" "-march=x86-64 -Wno-psabi"
  "-march=x86-64-v4" "-march=sapphirerapids")
status=0
for i in "${!variants[@]}"; do
  for side in old new; do
    src=expertmesh/cpu/csrc/cpu_kernels.c
    [ "$side" = old ] && src="$tmp/old/$src"
    # shellcheck disable=SC2086
    "$cc" -O3 -fopenmp -fPIC ${variants[$i]} -c "$src" -o "$tmp/$side.o"
    objdump -s -r "$tmp/$side.o" | tail -n +3 >"$tmp/$side.txt"
  done
  if cmp -s "$tmp/old.txt" "$tmp/new.txt"; then
    echo "same      ${variants[$i]}"
  else
    echo "DIFFERENT ${variants[$i]}"
    status=1
  fi
done
exit $status
