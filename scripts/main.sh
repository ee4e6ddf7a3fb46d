#!/usr/bin/env bash
# Quick start: readies .venv (scripts/setup.sh) and runs `python -m flash_attn_hopper`, which
# checks a small kernel against the reference (through the interpreter on a CPU) and, on a Hopper
# GPU, runs a short benchmark. Arguments go to `python -m flash_attn_hopper`.
# FAH_NO_SETUP=1 skips the venv and runs a Python that already has jax (see scripts/setup.sh).
set -euo pipefail
# shellcheck source=scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
fah_setup bench
cd "$FAH_ROOT"
exec "$FAH_PY" -m flash_attn_hopper "$@"
