#!/usr/bin/env bash
# The wheels that make tokamax, a benchmark peer (issue 4), importable on the GPU machine, which
# reaches no package registry. Run here, where PyPI is reachable:
#   bash scripts/peer_wheels.sh          # fills .whl/ (git-ignored)
# then name .whl in the device call's `carry`. `scripts/gpu_check.sh` installs whatever lies in
# .whl/ into a temporary folder on its PYTHONPATH before it runs anything, and the benchmark
# times tokamax beside cuDNN and attention_mgpu once `import tokamax` works.
#
# The pins: tokamax 0.0.12 (the newest on PyPI on 2026-12-05; it imports with jax 0.11.2) and
# those of its requirements that the GPU machine's image lacks (its package list is in the
# device tool's KINDS.md; jaxtyping, flax, tqdm, absl-py and numpy are there). The machine's
# python3 is CPython 3.12 on x86-64, hence the platform flags.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WHEELS=(tokamax==0.0.12 einshape==1.0 qwix==0.1.8 pydantic==2.14.4 pydantic-core==2.50.5
        annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
        typeguard==2.13.3 immutabledict==4.3.1 tensorboardx==2.6.5)
rm -rf .whl && mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
ls .whl
