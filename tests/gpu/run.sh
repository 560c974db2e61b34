#!/usr/bin/env bash
# The GPU checks in one go, for a machine with an NVIDIA GPU: every GPU test (each kernel against
# the CPU op table, the models on the GPU against the CPU, gpt-tiny training in fp32/bf16/fp16,
# NCCL with one rank), then the GPU benchmarks (GPT-2 124M training in bf16 and fp32 with MFU,
# a per-op profile of bf16 training, NCCL all-reduce). Results go to OUT_DIR as JSON and logs.
# Aim: under 8 minutes on one H200.
#   tests/gpu/run.sh [--prebuilt DIR] [--out OUT_DIR] [--no-bench]
# --prebuilt DIR takes the binaries and libraries tests/gpu/bundle.sh packed; without it the
# script builds (the machine needs the packages the README's build installs, and CUDA).
# cuBLAS and NCCL come from the machine: its CUDA toolkit, or PyTorch's nvidia-* wheels.
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
prebuilt="" out="$here/gpu-results" bench=1
while [[ $# -gt 0 ]]; do
  case $1 in
    --prebuilt)
      prebuilt=$2
      if [[ $prebuilt == *.tar.xz ]]; then
        unpacked=$(mktemp -d)
        tar -C "$unpacked" -xJf "$prebuilt" 2>/dev/null ||
          python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$prebuilt" "$unpacked" ||
          { echo "run.sh: cannot unpack $prebuilt" >&2; exit 1; }
        prebuilt=$(echo "$unpacked"/*)
      fi
      prebuilt=$(cd "$prebuilt" && pwd) || { echo "run.sh: no bundle at $2" >&2; exit 2; }
      shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-bench) bench=0; shift ;;
    *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
started=$(date +%s)
budget=${DPTRAIN_GPU_BUDGET_S:-480}   # whole script; keep it under the device call's limit
left() { local l=$((started + budget - $(date +%s))); ((l > $1)) && l=$1; ((l < 10)) && l=10; echo "$l"; }

if [[ -n $prebuilt ]]; then
  bin=$prebuilt/bin
  bundle_libs=$prebuilt/lib
  # The bundle's libstdc++ (GCC 12, Debian 12) needs glibc 2.36: only where the machine's own lacks GLIBCXX_3.4.30.
  sys_cxx=$(ldconfig -p 2>/dev/null | awk '$1 == "libstdc++.so.6" && /x86-64/ {print $NF; exit}')
  if [[ -z $sys_cxx ]] || ! grep -qa 'GLIBCXX_3\.4\.30' "$sys_cxx"; then bundle_libs="$bundle_libs:$prebuilt/lib-cxx"; fi
else
  cmake -S "$here" -B "$here/build-gpu" -G Ninja -DDPTRAIN_CUDA=ON -DCMAKE_BUILD_TYPE=Release >"$out/build.log" 2>&1 &&
    cmake --build "$here/build-gpu" --target dptrain gpu_tests >>"$out/build.log" 2>&1 ||
    { echo "run.sh: the build failed; see $out/build.log" >&2; tail -20 "$out/build.log" >&2; exit 1; }
  bin=$here/build-gpu
fi
# cuBLAS(Lt) and NCCL: the toolkit's, else the Python wheels' (nvidia/*/lib).
extra=""
for dir in /usr/local/cuda/lib64 /usr/local/cuda/lib; do
  [[ -e $dir/libcublasLt.so.13 ]] && extra="$extra:$dir"
done
for py in ${DPTRAIN_PYTHON:-} python3 python /opt/torch/.venv/bin/python3 /opt/conda/bin/python; do
  command -v "$py" >/dev/null 2>&1 || continue
  site=$("$py" -c 'import site; print(" ".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null || true)
  for s in $site; do
    while read -r lib; do extra="$extra:$(dirname "$lib")"; done < <(
      find "$s/nvidia" -maxdepth 4 \( -name 'libcublasLt.so.13' -o -name 'libnccl.so.2' \) 2>/dev/null)
  done
done
# Found: in a directory above, on LD_LIBRARY_PATH, or in the loader's cache (then the dynamic
# loader and dlopen find it anyway, and the slow search below is not needed).
has() {
  local d
  for d in ${extra//:/ } ${LD_LIBRARY_PATH:+${LD_LIBRARY_PATH//:/ }}; do [[ -e $d/$1 ]] && return 0; done
  local cache  # not a pipe into grep -q: with pipefail, ldconfig's SIGPIPE would read as a miss
  cache=$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null)
  [[ $cache == *$'\t'"$1 ("* ]]
}
if ! has libcublasLt.so.13 || ! has libnccl.so.2; then  # last resort: any copy on the machine
  while read -r lib; do extra="$extra:$(dirname "$lib")"; done < <(
    timeout 60 find / -xdev \( -name libcublasLt.so.13 -o -name libnccl.so.2 \) 2>/dev/null)
fi
lp=${bundle_libs:-}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}$extra
export LD_LIBRARY_PATH=${lp#:}
nccl=$(for d in ${extra//:/ }; do [[ -e $d/libnccl.so.2 ]] && echo "$d/libnccl.so.2"; done | head -1)
[[ -n $nccl && -z ${DPTRAIN_NCCL_LIBRARY:-} ]] && export DPTRAIN_NCCL_LIBRARY=$nccl
# cuBLASLt is loaded with dlopen (ldd does not list it): which copy the library path offers.
cublaslt=$(for d in ${LD_LIBRARY_PATH//:/ }; do [[ -e $d/libcublasLt.so.13 ]] && echo "$d/libcublasLt.so.13"; done | head -1)
# So is OpenBLAS, for the CPU reference.
openblas=$(for d in ${LD_LIBRARY_PATH//:/ }; do [[ -e $d/libopenblas.so.0 ]] && echo "$d/libopenblas.so.0"; done | head -1)
{ echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; echo "DPTRAIN_NCCL_LIBRARY=${DPTRAIN_NCCL_LIBRARY:-}"
  echo "cuBLASLt=${cublaslt:-not on LD_LIBRARY_PATH (the loader's cache or the binary's RUNPATH may have it)}"
  echo "OpenBLAS=${openblas:-not on LD_LIBRARY_PATH (then from the loader cache, if there)}"
  ldd "$bin/dptrain" "$bin/gpu_tests"; } >"$out/libs.txt" 2>&1
if grep -q 'not found' "$out/libs.txt"; then echo "run.sh: libraries missing (see libs.txt):" >&2; grep 'not found' "$out/libs.txt" | sort -u >&2; fi
export DPTRAIN_TEST_BINARY=$bin/dptrain DPTRAIN_TEST_SOURCE_DIR=$here
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpu.txt" 2>&1 || true
"$bin/dptrain" --version >"$out/version.txt" 2>&1 || true

# ---- tests: one gpu_tests run per source file, like ctest's entries.
results="["
failed=0
for src in cuda_ops nn_kernels attention nccl train; do
  t0=$(date +%s.%N)
  timeout -k 10 "$(left 240)" "$bin/gpu_tests" "--source-file=*/${src}_test.cpp" --no-intro >"$out/test-$src.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  [[ $rc -ne 0 ]] && failed=$((failed + 1))  # 77, skipped for want of a GPU, counts too: this
                                             # script exists to run them
  summary=$(grep -E '^\[doctest\] (test cases|assertions)' "$out/test-$src.log" | tr -s ' ' | tr '\n' ' ' | sed 's/"/\\"/g')
  results="$results{\"file\": \"${src}_test.cpp\", \"exit_code\": $rc, \"seconds\": $(awk "BEGIN{print $t1 - $t0}"), \"summary\": \"$summary\"},"
  echo "gpu test ${src}: exit $rc  $summary"
  echo "${results%,}]" >"$out/tests.json"   # after every file: a kill later keeps it
done

# ---- benchmarks
if [[ $bench -eq 1 ]]; then
  work=$(mktemp -d)
  # Throughput needs tokens, not meaning: random text through the byte tokenizer.
  head -c 30000000 /dev/urandom | base64 -w 100 >"$work/text.txt"
  "$bin/dptrain" data prepare --text "$work/text.txt" --out "$work/tokens" >"$out/data.log" 2>&1
  # GPT-2 124M at batch 16 x 1024 tokens, one GPU.
  sed -e "s#\"path\": \"[^\"]*\"#\"path\": \"$work/tokens\"#" -e 's#"grad_accum": [0-9]*#"grad_accum": 1#' \
    "$here/recipes/gpt2-124m.json" >"$work/gpt2.json"
  timeout -k 10 "$(left 240)" "$bin/dptrain" bench train "$work/gpt2.json" --device cuda --precision bf16,fp32 \
    --batch-per-rank 16 --nproc 1 --steps 30 --runs-root "$work/runs" --json \
    >"$out/bench-train.json" 2>"$out/bench-train.log"
  echo "bench train: exit $?"
  # Where a bf16 step's GPU time goes, op by op (a separate short run: the events cost a little).
  DPTRAIN_PROFILE="$out/profile" timeout -k 10 "$(left 90)" "$bin/dptrain" bench train "$work/gpt2.json" \
    --device cuda --precision bf16 --batch-per-rank 16 --nproc 1 --steps 10 \
    --runs-root "$work/runs-profile" --json >"$out/bench-profile.json" 2>"$out/bench-profile.log"
  echo "bench profile: exit $? ($(ls "$out/profile" 2>/dev/null | wc -l) profile file(s) in $out/profile)"
  timeout -k 10 "$(left 60)" "$bin/dptrain" bench comm --backend nccl --nproc 1 --runs-root "$work/runs-comm" --json >"$out/bench-comm.json" 2>"$out/bench-comm.log"
  echo "bench comm: exit $?"
fi
echo "run.sh: $failed of 5 GPU test files failed; $(($(date +%s) - started)) s; results in $out"
exit $((failed > 0))
