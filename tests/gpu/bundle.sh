#!/usr/bin/env bash
# Packs a CUDA build for a GPU machine that lacks this one's packages: the stripped dptrain and
# gpu_tests binaries and the shared libraries they load, except the C library and what the GPU
# machine brings itself (the CUDA driver, cuBLAS, NCCL: its PyTorch wheels hold them).
#   tests/gpu/bundle.sh BUILD_DIR OUT_DIR
# writes OUT_DIR and OUT_DIR.tar.xz (about a fifth of the size, for machines reached by copying
# files); on the GPU machine: tests/gpu/run.sh --prebuilt OUT_DIR (or OUT_DIR.tar.xz).
set -euo pipefail
build=${1:?usage: bundle.sh BUILD_DIR OUT_DIR}
out=${2:?usage: bundle.sh BUILD_DIR OUT_DIR}
for bin in dptrain gpu_tests; do
  [[ -x "$build/$bin" ]] || { echo "bundle.sh: $build/$bin is missing (build with CUDA first)" >&2; exit 2; }
done
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/lib-cxx"
for bin in dptrain gpu_tests; do
  strip -o "$out/bin/$bin" "$build/$bin"
done
# Every library either binary loads, and OpenBLAS (opened with dlopen, so ldd does not list it)
# with what it loads, less the C runtime (the GPU machine's own is newer) and the GPU stack (too
# large to carry, and there already).
# awk reads all of ldconfig's output (no exit): an early exit would end ldconfig with SIGPIPE,
# which pipefail and set -e turn into a silent exit of this script.
openblas=$(ldconfig -p | awk '$1 == "libopenblas.so.0" && /x86-64/ && !f {print $NF; f = 1}')
[[ -n $openblas ]] || { echo "bundle.sh: libopenblas.so.0 is missing here" >&2; exit 1; }
cp -L "$openblas" "$out/lib/libopenblas.so.0"
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.|libresolv\.|libcuda\.|libcublas|libcublasLt|libnccl|libcudart)'
ldd "$out/bin/dptrain" "$out/bin/gpu_tests" "$openblas" | awk '/=> \// {print $1, $3}' | sort -u |
  while read -r name path; do
    if [[ $name =~ ^(libstdc\+\+|libgcc_s)\. ]]; then cp -L "$path" "$out/lib-cxx/$name"  # fallback only: needs glibc 2.36
    elif [[ ! $name =~ $skip ]]; then cp -L "$path" "$out/lib/$name"; fi
  done
# Not grep -q: it would stop reading early, and the SIGPIPE of the commands before it would make
# the pipeline fail (pipefail), reading as "nothing missing".
missing=$(ldd "$out/bin/dptrain" "$out/bin/gpu_tests" "$openblas" | grep -v -E 'libcublas' | grep 'not found' || true)
if [[ -n $missing ]]; then
  echo "bundle.sh: a library is missing here:" >&2; echo "$missing" >&2; exit 1
fi
tar -C "$(dirname "$out")" -cJf "$out.tar.xz" "$(basename "$out")"
du -sh "$out" "$out.tar.xz"
