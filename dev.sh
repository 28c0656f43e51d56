#!/usr/bin/env bash
# One entry point for the two Quickstart commands:
#   bash dev.sh train   set up .venv, train ResNet34 on the bundled digits, export the weights
#   bash dev.sh test    set up .venv, run every test (unit, multi-process, kernel, notebooks)
# and, for the documentation site (mkdocs.yml, docs/):
#   bash dev.sh docs          build it into site/, strictly (a broken link or docstring fails)
#   bash dev.sh screenshots   retake docs/images/ in a real JupyterLab (tests/test_browser.py)
# Needs only python3: 3.10.9+, not 3.11.0 (pyproject.toml's requires-python; PYTHON=python3.12 picks
# another). The set-up is skipped when requirements-dev.txt is unchanged.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=${NBDDP_VENV:-.venv}

setup() {
  local stamp="$VENV/.nbddp-setup"
  local want
  want=$(cat requirements-dev.txt pyproject.toml | "$PY" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return
  fi
  # The range of pyproject.toml, said before pip says "No matching distribution" for something else.
  if ! "$PY" -c 'import sys; v = sys.version_info[:3]; sys.exit(not (v >= (3, 10, 9) and v != (3, 11, 0)))'; then
    echo "dev.sh: $("$PY" -V 2>&1) is not supported: nbddp needs Python 3.10.9+ (not 3.11.0)." >&2
    echo "        Run it with another interpreter, e.g. PYTHON=python3.12 bash dev.sh ${1:-setup}" >&2
    exit 2
  fi
  echo "== setting up $VENV (first time: a few minutes)"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q -r requirements-dev.txt
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  # The notebooks run on a kernel of this environment, whatever else is installed.
  "$VENV/bin/python" -m ipykernel install --sys-prefix --name python3 >/dev/null
  echo "$want" > "$stamp"
}

case "${1:-}" in
  train)
    setup "$1"
    shift
    exec "$VENV/bin/python" -m nbddp train --data-path data/digits --model resnet34 --image-size 32 \
      --epochs 6 --batch-size 32 --lr 0.01 --crop-scale 0.5 --no-hflip --nprocs 2 --name digits "$@"
    ;;
  test)
    setup "$1"
    shift
    # Chromium for tests/test_browser.py (Debian package); never fails, says why it skipped.
    bash scripts/install_browser.sh
    # A one-host SLURM cluster for tests/test_slurm.py (Debian's slurm-wlm, munge); never fails.
    bash scripts/install_slurm.sh
    # Notebooks shorten their training in CI but still run every code path.
    export NBDDP_SMOKE=${NBDDP_SMOKE:-1}
    # The checkout's bytecode, compiled once: with PYTHONDONTWRITEBYTECODE set (as on some servers)
    # each of the suite's hundreds of fresh interpreters (kernels, forkservers, launchers) would compile
    # nbddp again (0.13 s each). An edited file's entry is stale by its timestamp and compiled afresh.
    PYTHONDONTWRITEBYTECODE= "$VENV/bin/python" -m compileall -q -j 0 nbddp tests bench >/dev/null
    # Four test processes on 2 cores (NBDDP_TEST_PROCS=1: one): tests wait on ranks, kernels, SLURM and
    # grace periods as much as they compute; on 2026-11-29 four took 12:07 where three took 13:21 (two
    # left the machine half idle), and 11:09 where five took 11:57 (five left no core idle, but every
    # test took ~5 % more CPU, its processes contending for two cores). A file's tests stay together,
    # so module-scoped launches and kernels are shared as written; the files that take longest start
    # first, in the order tests/conftest.py gives (xdist's reordering by size turned off).
    exec "$VENV/bin/python" -m pytest -n "${NBDDP_TEST_PROCS:-4}" --dist loadfile --no-loadscope-reorder tests notebooks --nbmake "$@"
    ;;
  docs)
    setup "$1"
    shift
    if ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:3] < (3, 11, 5))'; then
      echo "dev.sh docs: the site's tools (pymdown-extensions) need Python 3.11.5+; run it with PYTHON=python3.12" >&2
      exit 2
    fi
    export NO_MKDOCS_2_WARNING=1  # the theme's notice about its successor, printed on every build
    exec "$VENV/bin/python" -m mkdocs build --strict "$@"
    ;;
  screenshots)
    setup "$1"
    shift
    bash scripts/install_browser.sh
    # The browser test copies the pictures the docs show into docs/images/ once it has passed.
    NBDDP_SCREENSHOTS=docs/images exec "$VENV/bin/python" -m pytest tests/test_browser.py -p no:cacheprovider "$@"
    ;;
  setup)
    setup "$1"
    ;;
  *)
    echo "usage: bash dev.sh train|test|docs|screenshots|setup [extra arguments]" >&2
    exit 2
    ;;
esac
