#!/usr/bin/env bash
# Compares dptrain with PyTorch (Gloo, CPU) on this machine: training throughput, allreduce bus
# bandwidth and time to the first step, each with the ratio (see bench/README.md).
#   bash bench/compare_torch.sh [--dptrain PATH] [--parts train,comm,startup] [--json]
# The driver uses only Python's standard library; PYTHON picks the interpreter that runs it. The
# PyTorch side runs under --torch-python (default /usr/bin/python3, Debian's python3-torch, which
# this script installs when it is missing).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# Debian's python3-torch, installed when missing (not where --torch-python names another).
case " $* " in
  *" --torch-python"*) ;;
  *) bash "$here/../scripts/deps.sh" torch ;;
esac
exec "${PYTHON:-python3}" "$here/compare_torch.py" "$@"
