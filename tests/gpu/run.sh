#!/usr/bin/env bash
# The GPU checks in one go, for a machine with an NVIDIA GPU: every GPU test (each kernel against
# the CPU op table, the models on the GPU against the CPU, gpt-tiny training in fp32/bf16/fp16,
# NCCL with one rank), then the GPU benchmarks (GPT-2 124M training in bf16 and fp32 with MFU,
# bf16 again on the mma.sync attention kernels,
# a per-op profile of bf16 training, NCCL all-reduce, PyTorch's training of the same model as
# the peer the figures are read against, and a per-op profile of fp32 training). Results go to
# OUT_DIR as JSON and logs.
# The whole script, kill grace included, ends within DPTRAIN_GPU_BUDGET_S (default 540 s: under
# 560 s, with room for the few unbounded steps): each test file has its own cap, and the
# benchmarks run only when 150 s are left after the tests.
#   tests/gpu/run.sh [--prebuilt DIR] [--out OUT_DIR] [--no-bench]
# --prebuilt DIR takes the binaries and libraries tests/gpu/bundle.sh packed; without it the
# script builds (the machine needs the packages the README's build installs, and CUDA).
# cuBLAS and NCCL come from the machine: its CUDA toolkit, or PyTorch's nvidia-* wheels.
set -uo pipefail
started=$(date +%s)
budget=${DPTRAIN_GPU_BUDGET_S:-540}
grace=5  # seconds between a step's timeout (SIGTERM) and its SIGKILL
# Seconds a step may run: its cap ($1), cut so that the step and its kill grace end within the
# budget; 0 when nothing is left.
left() {
  local l=$((started + budget - grace - $(date +%s)))
  ((l > $1)) && l=$1
  ((l < 0)) && l=0
  echo "$l"
}
# Runs a command with a cap of $1 seconds (cut by left); exit 124 without running it when fewer
# than 5 s are left.
capped() {
  local cap
  cap=$(left "$1")
  shift
  if ((cap < 5)); then
    echo "run.sh: out of time, not run: $*" >&2
    return 124
  fi
  timeout -k "$grace" "$cap" "$@"
}
# $1 as the inside of a JSON string: backslashes and quotes escaped, control characters as spaces.
json_text() { printf '%s' "$1" | tr '\n\r\t' '   ' | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g'; }
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

if [[ -n $prebuilt ]]; then
  bin=$prebuilt/bin
  # The bundle's libraries, less the RDMA stack where this machine has its own: libibverbs and
  # librdmacm load the machine's provider plugins, which must match their own version (a foreign
  # copy would leave NCCL without InfiniBand, or worse).
  bundle_libs=$(mktemp -d)
  cache=$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true)
  for lib in "$prebuilt"/lib/*; do
    name=$(basename "$lib")
    if [[ $name =~ ^(libibverbs|librdmacm|libnl-3|libnl-route-3)\. && $cache == *$'\t'"$name ("* ]]; then
      echo "run.sh: $name: this machine's, not the bundle's"
      continue
    fi
    ln -s "$lib" "$bundle_libs/$name"
  done
  # The bundle's libstdc++ (GCC 12, Debian 12) needs glibc 2.36: only where the machine's own lacks GLIBCXX_3.4.30.
  sys_cxx=$(ldconfig -p 2>/dev/null | awk '$1 == "libstdc++.so.6" && /x86-64/ && !f {print $NF; f = 1}')
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
    capped 60 find / -xdev \( -name libcublasLt.so.13 -o -name libnccl.so.2 \) 2>/dev/null)
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
  echo "cuBLASLt=${cublaslt:-not on LD_LIBRARY_PATH (the loader cache or the RUNPATH of the binary may have it)}"
  echo "OpenBLAS=${openblas:-not on LD_LIBRARY_PATH (then from the loader cache, if there)}"
  ldd "$bin/dptrain" "$bin/gpu_tests"; } >"$out/libs.txt" 2>&1
if grep -q 'not found' "$out/libs.txt"; then echo "run.sh: libraries missing (see libs.txt):" >&2; grep 'not found' "$out/libs.txt" | sort -u >&2; fi
export DPTRAIN_TEST_BINARY=$bin/dptrain DPTRAIN_TEST_SOURCE_DIR=$here
capped 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpu.txt" 2>&1 || true
capped 20 "$bin/dptrain" --version >"$out/version.txt" 2>&1 || true

# ---- preflight: cuBLASLt and NCCL are opened with dlopen at first use, so ldd above cannot vouch
# for them. Open each now as the binaries will (cuBLASLt by name on the library path, NCCL from
# DPTRAIN_NCCL_LIBRARY or by name). Without cuBLASLt every GPU test would fail on it, one by
# one: the script stops at once, saying why.
open_error() {  # why library $1 (a name or a path) cannot be opened; nothing when it can
  local py
  for py in ${DPTRAIN_PYTHON:-} python3 python; do
    command -v "$py" >/dev/null 2>&1 || continue
    timeout -k 2 10 "$py" -c '
import ctypes, sys
try:
    ctypes.CDLL(sys.argv[1])
except OSError as e:
    print(e)' "$1" 2>&1
    return 0
  done
  # No Python: the file on the library path or in the loader's cache, and what it loads itself.
  local path=$1 d cache
  if [[ $path != */* ]]; then
    path=""
    for d in ${LD_LIBRARY_PATH//:/ }; do [[ -e $d/$1 ]] && { path=$d/$1; break; }; done
    if [[ -z $path ]]; then
      cache=$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null)
      path=$(awk -v name="$1" '$1 == name && /x86-64/ && !f {print $NF; f = 1}' <<<"$cache")
    fi
  fi
  if [[ -z $path || ! -e $path ]]; then
    echo "not on LD_LIBRARY_PATH nor in the loader's cache"
    return 0
  fi
  ldd "$path" 2>&1 | awk '/not found/ {printf "%s needs %s (not found); ", p, $1}' p="$path"
}
preflight=""
why=$(open_error libcublasLt.so.13)
[[ -z $why ]] || preflight="${preflight}cuBLASLt (libcublasLt.so.13): $why; "
# Without NCCL the kernel and training tests still run: only its own tests fail, so it is said,
# not a stop.
nccl_lib=${DPTRAIN_NCCL_LIBRARY:-libnccl.so.2}
why=$(open_error "$nccl_lib")
[[ -z $why ]] || echo "run.sh: warning: NCCL ($nccl_lib) cannot be opened: $why" | tee "$out/preflight.txt" >&2
if [[ -n $preflight ]]; then
  { echo "run.sh: a library the binaries open at run time cannot be opened: ${preflight%; }"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH (see libs.txt)"; } | tee "$out/preflight.txt" >&2
  echo "[{\"file\": \"preflight\", \"exit_code\": 1, \"seconds\": 0, \"summary\": \"$(json_text "${preflight%; }")\"}]" >"$out/tests.json"
  exit 1
fi

# ---- tests: one gpu_tests run per source file, like ctest's entries, each with its own cap
# (seconds; together 455: bounds for a hung file, not what they take: about 100 s in all on an
# H200, which leaves the benchmarks their 150 s of the budget; files that do hang cost them).
files=(cuda_ops nn_kernels attention nccl train)
declare -A cap=([cuda_ops]=90 [nn_kernels]=45 [attention]=90 [nccl]=90 [train]=140)
results="["
failed=0
no_device=""
for src in "${files[@]}"; do
  if [[ -n $no_device ]]; then  # the first file found no device: the others would not either
    failed=$((failed + 1))
    results="$results{\"file\": \"${src}_test.cpp\", \"exit_code\": null, \"seconds\": 0, \"summary\": \"not run: the first test file found no CUDA device\"},"
    continue
  fi
  t0=$(date +%s.%N)
  capped "${cap[$src]}" "$bin/gpu_tests" "--source-file=*/${src}_test.cpp" --no-intro >"$out/test-$src.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  [[ $rc -ne 0 ]] && failed=$((failed + 1))  # 77, skipped for want of a GPU, counts too: this
                                             # script exists to run them
  summary=$(grep -E '^\[doctest\] (test cases|assertions)' "$out/test-$src.log" | tr -s ' ' | tr '\n' ' ')
  if [[ $rc -eq 124 ]] && grep -q '^run.sh: out of time, not run' "$out/test-$src.log"; then
    summary="not run: the budget was spent"
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    summary="timed out after its cap of ${cap[$src]} s (or the budget); $summary"
  elif [[ $rc -eq 77 ]] && grep -q '^skipped: no CUDA device' "$out/test-$src.log"; then
    no_device=$(grep -m 1 '^skipped: no CUDA device' "$out/test-$src.log")
    summary=$no_device
  fi
  results="$results{\"file\": \"${src}_test.cpp\", \"exit_code\": $rc, \"seconds\": $(awk "BEGIN{print $t1 - $t0}"), \"summary\": \"$(json_text "$summary")\"},"
  echo "gpu test ${src}: exit $rc  $summary"
  echo "${results%,}]" >"$out/tests.json"   # after every file: a kill later keeps it
done
echo "${results%,}]" >"$out/tests.json"
if [[ -n $no_device ]]; then
  echo "run.sh: stopped after the first test file: $no_device" | tee "$out/stopped.txt" >&2
  bench=0
fi
if [[ $bench -eq 1 && $(left 150) -lt 150 ]]; then
  echo "run.sh: benchmarks not run: $(left 150) s of the budget left, they need 150" | tee "$out/bench-skipped.txt"
  bench=0
fi

# ---- benchmarks
if [[ $bench -eq 1 ]]; then
  work=$(mktemp -d)
  # Throughput needs tokens, not meaning: random text through the byte tokenizer.
  head -c 30000000 /dev/urandom | base64 -w 100 >"$work/text.txt"
  capped 60 "$bin/dptrain" data prepare --text "$work/text.txt" --out "$work/tokens" >"$out/data.log" 2>&1
  echo "data prepare: exit $?"
  # GPT-2 124M at batch 16 x 1024 tokens, one GPU.
  sed -e "s#\"path\": \"[^\"]*\"#\"path\": \"$work/tokens\"#" -e 's#"grad_accum": [0-9]*#"grad_accum": 1#' \
    "$here/recipes/gpt2-124m.json" >"$work/gpt2.json"
  capped 240 "$bin/dptrain" bench train "$work/gpt2.json" --device cuda --precision bf16,fp32 \
    --batch-per-rank 16 --nproc 1 --steps 30 --runs-root "$work/runs" --json \
    >"$out/bench-train.json" 2>"$out/bench-train.log"
  echo "bench train: exit $?"
  # The same bf16 run on the mma.sync attention kernels (DPTRAIN_ATTENTION=mma: opt-in until
  # measured here; bench-train.json has the default WMMA kernels).
  capped 45 env DPTRAIN_ATTENTION=mma "$bin/dptrain" bench train "$work/gpt2.json" --device cuda \
    --precision bf16 --batch-per-rank 16 --nproc 1 --steps 30 --runs-root "$work/runs-mma" --json \
    >"$out/bench-train-mma.json" 2>"$out/bench-train-mma.log"
  mma_rc=$?
  echo "bench train (attention mma): exit $mma_rc"
  # The two bf16 rates side by side, without Python: split at braces, a row's precision and rate
  # fall in one piece (its only nested object, phases_ms, comes before both).
  bf16_rate() {
    [[ -f $1 ]] || return 0
    tr '{}' '[\n*]' <"$1" | grep '"precision": *"bf16"' | grep -o '"tokens_per_s": *[0-9.]*' |
      head -n 1 | grep -o '[0-9.]*$'
  }
  wmma_rate=$(bf16_rate "$out/bench-train.json")
  mma_rate=$(bf16_rate "$out/bench-train-mma.json")
  echo "bench train bf16 tokens/s: attention mma ${mma_rate:-none} / wmma ${wmma_rate:-none}$(
    [[ -n $mma_rate && -n $wmma_rate ]] && awk "BEGIN{printf \" = %.2fx\", $mma_rate / $wmma_rate}")" |
    tee "$out/attention-mma-vs-wmma.txt"
  # A profile's line for the log: how busy the stream was between its first and last op, and its
  # six slowest ops with their shares of the ops' time (the files have it all).
  profile_summary() {
    local file
    # The largest file: the op table that did the most (a run may have more than one).
    file=$(find "$1" -name '*.json' -printf '%s %p\n' 2>/dev/null | sort -rn | head -n 1 | cut -d' ' -f2-)
    [[ -n $file ]] || return 0
    echo "$2 ($(basename "$file")): busy_share $(grep -o '"busy_share": *[0-9.e+-]*' "$file" | grep -o '[0-9.e+-]*$'); slowest: $(
      grep -o '"op": "[^"]*", "calls": [0-9]*, "ms": [0-9.e+-]*, "share": [0-9.e+-]*' "$file" |
        head -n 6 | sed -E 's/"op": "([^"]*)", "calls": ([0-9]*), "ms": ([0-9.e+-]*), "share": ([0-9.e+-]*)/\1 x\2 \3 ms (\4)/' |
        paste -sd ';' -)"
  }
  # Where a bf16 step's GPU time goes, op by op (a separate short run: the events cost a little).
  # On the mma attention kernels when their run above passed and was the faster (what the
  # default would then become), else on the default ones.
  attention=auto
  if [[ $mma_rc -eq 0 && -n $mma_rate && -n $wmma_rate ]] &&
    awk "BEGIN{exit !($mma_rate > $wmma_rate)}"; then
    attention=mma
  fi
  echo "bench profile: DPTRAIN_ATTENTION=$attention"
  capped 90 env DPTRAIN_ATTENTION=$attention DPTRAIN_PROFILE="$out/profile" "$bin/dptrain" bench train "$work/gpt2.json" \
    --device cuda --precision bf16 --batch-per-rank 16 --nproc 1 --steps 10 \
    --runs-root "$work/runs-profile" --json >"$out/bench-profile.json" 2>"$out/bench-profile.log"
  echo "bench profile: exit $? ($(ls "$out/profile" 2>/dev/null | wc -l) profile file(s) in $out/profile)"
  profile_summary "$out/profile" "bench profile"
  capped 60 "$bin/dptrain" bench comm --backend nccl --nproc 1 --runs-root "$work/runs-comm" --json >"$out/bench-comm.json" 2>"$out/bench-comm.log"
  echo "bench comm: exit $?"
  # The PyTorch peer of `bench train`, so that its figures read as a ratio: bench/gpt_ddp_peer.py
  # trains the same GPT from the same recipe and tokens on the GPU (SDPA attention, fused AdamW,
  # bf16 autocast; fp32 without TF32), 30 steps of 16 x 1024. Only with 120 s left, so that it
  # never starves the steps before it. peer-train.json: a JSON array, one result per run.
  # Its Python: the first of the candidates above that has torch (found, not imported: fast).
  peer_py=""
  for py in ${DPTRAIN_PYTHON:-} python3 python /opt/torch/.venv/bin/python3 /opt/conda/bin/python; do
    command -v "$py" >/dev/null 2>&1 || continue
    if timeout -k 2 10 "$py" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)' 2>/dev/null; then
      peer_py=$py
      break
    fi
  done
  declare -A peer_cap=([bf16]=50 [fp32]=70)  # an fp32 step (no TF32) takes about 4 bf16 steps
  if (($(left 120) < 120)); then
    echo "peer train: not run: $(left 120) s of the budget left, it needs 120" | tee "$out/peer-skipped.txt"
  elif [[ -z $peer_py ]]; then
    echo "peer train: not run: no Python with torch (tried \$DPTRAIN_PYTHON, python3, python, /opt/torch/.venv, /opt/conda)" | tee "$out/peer-skipped.txt"
  else
    peer_runs="["
    : >"$out/peer-train.log"
    for precision in bf16 fp32; do
      echo "== $precision" >>"$out/peer-train.log"
      capped "${peer_cap[$precision]}" "$peer_py" "$here/bench/gpt_ddp_peer.py" "$work/gpt2.json" \
        --device cuda --precision "$precision" --batch-per-rank 16 --nproc 1 --steps 30 --json \
        >"$work/peer-$precision.json" 2>>"$out/peer-train.log"
      rc=$?
      echo "peer train $precision: exit $rc"
      [[ $rc -eq 0 ]] && peer_runs="$peer_runs$(tail -n 1 "$work/peer-$precision.json"),"
      echo "${peer_runs%,}]" >"$out/peer-train.json"  # after every run: a kill later keeps it
    done
    # dptrain / PyTorch tokens/s per precision, from both JSON files.
    "$peer_py" -c '
import json, sys
def load(path, empty):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return empty
dptrain = {r.get("precision"): r.get("tokens_per_s") for r in load(sys.argv[1], {}).get("rows", [])
           if r.get("world") == 1}
pytorch = {r.get("precision"): r.get("tokens_per_s") for r in load(sys.argv[2], [])}
def text(rate):
    return format(rate, ".0f") if rate else "none"
parts = []
for p in ("bf16", "fp32"):
    d, t = dptrain.get(p), pytorch.get(p)
    ratio = format(d / t, ".2f") + "x" if d and t else "n/a"
    parts.append(f"{p} {text(d)} / {text(t)} = {ratio}")
print("peer train: dptrain / PyTorch tokens/s, one GPU: " + ", ".join(parts))
' "$out/bench-train.json" "$out/peer-train.json" || echo "peer train: no ratio (see bench-train.json, peer-train.json)"
  fi
  # Where an fp32 step's time goes (PyTorch's fp32 is faster; bf16's profile is above): last, and
  # only with 60 s left.
  if (($(left 60) < 60)); then
    echo "bench profile fp32: not run: $(left 60) s of the budget left, it needs 60"
  else
    capped 60 env DPTRAIN_PROFILE="$out/profile-fp32" "$bin/dptrain" bench train "$work/gpt2.json" \
      --device cuda --precision fp32 --batch-per-rank 16 --nproc 1 --steps 10 \
      --runs-root "$work/runs-profile-fp32" --json >"$out/bench-profile-fp32.json" \
      2>"$out/bench-profile-fp32.log"
    echo "bench profile fp32: exit $? ($(ls "$out/profile-fp32" 2>/dev/null | wc -l) profile file(s))"
    profile_summary "$out/profile-fp32" "bench profile fp32"
  fi
fi
echo "run.sh: $failed of ${#files[@]} GPU test files failed or did not run; $(($(date +%s) - started)) s; results in $out"
exit $((failed > 0))
