#!/usr/bin/env bash
# The test command: readies .venv (scripts/setup.sh) and runs `python -m pytest -q`.
# Arguments go to pytest, e.g. `bash scripts/test.sh -m "not interpret"`.
# FAH_NO_SETUP=1 skips the venv and runs a Python that already has jax (see scripts/setup.sh).
set -euo pipefail
# shellcheck source=scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
fah_setup test
cd "$FAH_ROOT"
"$FAH_PY" -c 'import pytest, hypothesis' >/dev/null 2>&1 \
  || fah_die "'$FAH_PY' lacks pytest or hypothesis: pip install pytest hypothesis pytest-timeout"
rc=0
"$FAH_PY" -m pytest -q "$@" || rc=$?
if (( rc == 5 )); then
  fah_die "pytest collected no tests (exit code 5)"
fi
exit "$rc"
