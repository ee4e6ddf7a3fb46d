# shellcheck shell=bash
# Sourced (not run) by scripts/main.sh, scripts/test.sh and .ci/run. Defines `fah_setup EXTRA`,
# which readies a Python that has this project and its EXTRA (test, bench, ...), sets FAH_PY to
# it and exits the calling script with a message when it cannot.
#
# Normally it creates or reuses .venv (Python 3.12) at the repository root and installs the
# project in editable mode with the pins of .ci/constraints.txt. Pip runs only when .venv lacks
# EXTRA or pyproject.toml / the pins changed since the last install, so later runs work offline.
# Where nvidia-smi shows a driver, jax's CUDA plugin is installed too.
#
# The other way, "no setup", makes no venv and runs no pip: it runs the Python that already has
# jax, with the repository on PYTHONPATH. It is for a GPU machine with CUDA jax preinstalled and
# no internet, and it is taken without asking when there is no .venv yet and python3 (Python
# >= 3.12) already runs jax on a GPU.
#
# Environment:
#   FAH_NO_SETUP    1: no setup. 0: always the venv. Unset: as described above.
#   FAH_PYTHON      with no setup, the Python to run (default python3); otherwise the Python 3.12
#                   that creates .venv (default: `PYENV_VERSION=3.12.1 python3.12`, then
#                   `python3.12`).
#   FAH_CUDA        12, 13 or none: which jax CUDA plugin to install (default: from nvidia-smi).

FAH_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FAH_VENV="$FAH_ROOT/.venv"
FAH_CONSTRAINTS="$FAH_ROOT/.ci/constraints.txt"

fah_log() { printf '[setup] %s\n' "$*" >&2; }
fah_die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# Whether $1 is a Python >= 3.12 whose jax runs on a GPU.
_fah_has_gpu_jax() {
  "$1" -c 'import sys, jax
sys.exit(sys.version_info < (3, 12) or jax.devices()[0].platform != "gpu")' >/dev/null 2>&1
}

# Sets the array FAH_BASE to the command of a Python 3.12 to create the venv with.
_fah_base_python() {
  if [[ -n "${FAH_PYTHON:-}" ]]; then
    "$FAH_PYTHON" -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1 \
      || fah_die "FAH_PYTHON=$FAH_PYTHON is not a working Python >= 3.12"
    FAH_BASE=("$FAH_PYTHON")
  elif PYENV_VERSION=3.12.1 python3.12 -c '' >/dev/null 2>&1; then
    FAH_BASE=(env PYENV_VERSION=3.12.1 python3.12)
  elif python3.12 -c '' >/dev/null 2>&1; then
    FAH_BASE=(python3.12)
  else
    fah_die "Python 3.12 not found (tried 'PYENV_VERSION=3.12.1 python3.12' and 'python3.12'). \
Install it (e.g. 'pyenv install 3.12.1'), point FAH_PYTHON at one, or set FAH_NO_SETUP=1 to \
use a Python that already has jax."
  fi
}

# Prints the extra that brings jax's CUDA plugin (cuda12, cuda13), or nothing for CPU only.
_fah_cuda_extra() {
  local major
  case "${FAH_CUDA:-auto}" in
    none|cpu) return 0 ;;
    12|13) printf 'cuda%s\n' "$FAH_CUDA"; return 0 ;;
    auto) ;;
    *) fah_die "FAH_CUDA must be 12, 13 or none, not '$FAH_CUDA'" ;;
  esac
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  major="$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\).*/\1/p' | head -n 1)"
  [[ -n "$major" ]] || return 0
  if (( major >= 13 )); then printf 'cuda13\n'; else printf 'cuda12\n'; fi
}

# No setup: the given Python as it is, with the repository on PYTHONPATH.
_fah_use_existing() {
  FAH_PY="${FAH_PYTHON:-python3}"
  "$FAH_PY" -c 'import jax' >/dev/null 2>&1 \
    || fah_die "FAH_NO_SETUP=1, but '$FAH_PY' cannot import jax (point FAH_PYTHON at one that can)"
  export PYTHONPATH="$FAH_ROOT${PYTHONPATH:+:$PYTHONPATH}"
  fah_log "no setup: using $("$FAH_PY" -c 'import sys; print(sys.executable)') with its own jax" \
    "$("$FAH_PY" -c 'import jax; print(jax.__version__)') (FAH_NO_SETUP=0 makes .venv instead)"
}

fah_setup() {
  local extra="$1" cuda extras stamp want

  case "${FAH_NO_SETUP:-}" in
    1) _fah_use_existing; return 0 ;;
    0) ;;
    "")
      if [[ ! -e "$FAH_VENV" ]] && _fah_has_gpu_jax "${FAH_PYTHON:-python3}"; then
        _fah_use_existing
        return 0
      fi
      ;;
    *) fah_die "FAH_NO_SETUP must be 1 or 0, not '$FAH_NO_SETUP'" ;;
  esac

  if [[ ! -x "$FAH_VENV/bin/python" ]]; then
    [[ ! -e "$FAH_VENV" ]] || fah_die "$FAH_VENV exists but has no bin/python; remove it"
    _fah_base_python
    fah_log "creating $FAH_VENV with: ${FAH_BASE[*]}"
    "${FAH_BASE[@]}" -m venv "$FAH_VENV"
  fi
  FAH_PY="$FAH_VENV/bin/python"
  "$FAH_PY" -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1 \
    || fah_die "$FAH_VENV is not a working Python >= 3.12 venv; remove it and run again"

  cuda="$(_fah_cuda_extra)" || exit 1
  extras="$extra${cuda:+,$cuda}"
  # One line per installed extras set: "<extras> <hash of pyproject.toml and the pins>".
  stamp="$FAH_VENV/.fah-installed"
  want="$extras $(cat "$FAH_ROOT/pyproject.toml" "$FAH_CONSTRAINTS" | "$FAH_PY" -c \
    'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')"
  if ! grep -qxF "$want" "$stamp" 2>/dev/null; then
    fah_log "installing flash-attn-hopper[$extras] into $FAH_VENV (pins: .ci/constraints.txt)"
    "$FAH_PY" -m pip install --quiet -c "$FAH_CONSTRAINTS" -e "${FAH_ROOT}[${extras}]" \
      || fah_die "pip failed. Offline on a machine that already has jax? Run with FAH_NO_SETUP=1."
    printf '%s\n' "$want" >> "$stamp"
  fi
  # shellcheck disable=SC1091
  source "$FAH_VENV/bin/activate"
}
