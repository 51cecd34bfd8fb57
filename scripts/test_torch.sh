#!/usr/bin/env bash
# Run nemo_ac's tests on another torch release, in a venv of its own (.venv-torch-<version>).
#
#   scripts/test_torch.sh 2.14.1                 # the tests marked workaround (what CI runs after `make test`)
#   scripts/test_torch.sh 2.15.0 all             # the whole suite
#   scripts/test_torch.sh 2.14.1 tests/unit/distributed/test_plan.py -k gates   # any pytest arguments
#   make test-torch TORCH=2.14.1 [TESTS=all]     # the same through make
#   scripts/test_torch.sh 2.14.1 install-only    # build the venv and check its torch, run nothing (CI, in the background)
#
# The venv gets `pip install torch==<version>` (whatever the configured package index serves: a CUDA build runs on
# CPU too), then nemo_ac editable with its [dev] extra and the dev-tool pins of constraints.txt except its torch pin.
# VENV=/path reuses an existing venv instead (it must already hold that torch). Before any test runs the script
# checks that the venv's torch is the one asked for: a resolver that "satisfies" nemo_ac's torch range by
# reinstalling another torch would otherwise test the wrong release silently.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ $# -lt 1 ]]; then
  sed -n '2,9p' "$0" >&2
  exit 2
fi
TORCH_VERSION=$1
shift
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=${VENV:-.venv-torch-$TORCH_VERSION}

# The workaround regression tests are the ones marked `workaround` (pyproject.toml): every torch failure nemo_ac
# works around, without and with its fix (SAC profiler ops and FSDP hooks, compiled regions under SAC, the compile
# thread context, the doctor end to end) and the gate table / registry they read.

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
if [[ ! -f "$VENV/.installed-$TORCH_VERSION" ]]; then
  pins=$(mktemp)
  grep -v '^torch==' constraints.txt > "$pins"
  "$VENV/bin/python" -m pip install --disable-pip-version-check --no-compile -q "torch==$TORCH_VERSION"
  "$VENV/bin/python" -m pip install --disable-pip-version-check --no-compile -q -c "$pins" "torch==$TORCH_VERSION" -e '.[dev]'
  rm -f "$pins"
  touch "$VENV/.installed-$TORCH_VERSION"
fi

"$VENV/bin/python" - "$TORCH_VERSION" <<'EOF'
import sys

import torch

wanted = sys.argv[1]
found = torch.__version__.split("+")[0]
if found != wanted:
    sys.exit(f"scripts/test_torch.sh: the venv holds torch {torch.__version__}, not {wanted}")
print(f"torch {torch.__version__} (cuda build: {torch.version.cuda}, cuda available: {torch.cuda.is_available()})")
EOF

if [[ ${1:-} == install-only ]]; then
  exit 0
fi
if [[ $# -eq 0 ]]; then
  set -- -m workaround
elif [[ $1 == all ]]; then
  shift
fi
exec "$VENV/bin/python" -m pytest -q "$@"
