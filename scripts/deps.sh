#!/usr/bin/env bash
# Installs the Debian packages dptrain needs to build and test; quiet and quick when all are there.
#   bash scripts/deps.sh          what the build and the tests need
#   bash scripts/deps.sh torch    the peer the benchmarks under bench/ compare with (PyTorch, CPU)
set -euo pipefail
packages=(build-essential cmake ninja-build pkg-config libgloo-dev libcli11-dev nlohmann-json3-dev
  libssh-dev libssl-dev libfmt-dev doctest-dev libopenblas-dev openssh-server openssh-client
  clang-format man-db groff-base)
[ "${1:-}" = torch ] && packages=(python3-torch)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
