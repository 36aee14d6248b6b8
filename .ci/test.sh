#!/usr/bin/env bash
# The project's test command (README "Test it"). Creates .venv, installs the CPU build of torch FIRST
# (an unpinned torch pulls a multi-GB CUDA build), then the core with its dev extra and every package of
# this repository in editable mode, then runs pytest over the core's tests/ and each package's tests/.
#
#   .ci/test.sh              everything
#   .ci/test.sh -x -k name   extra arguments go to every pytest run
#
# Environment: PYTHON (interpreter for the venv, default python3), VENV (default .venv),
# SKIP_INSTALL=1 (reuse an existing venv as it is).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
PY="$VENV/bin/python"

# Every distribution in the repository besides the core: the template plus each backends/* and
# plugins/* folder that has a pyproject.toml (new packages are picked up without editing this file).
packages=(examples/plugin-template)
for dir in backends/*/ plugins/*/; do
    if [ -f "${dir}pyproject.toml" ]; then packages+=("${dir%/}"); fi
done

if [ "${SKIP_INSTALL:-0}" != 1 ] || [ ! -x "$PY" ]; then
    [ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
    "$PY" -m pip install --quiet torch==2.13.0
    editable=()
    for pkg in "${packages[@]}"; do
        # With the package's `test` extra where it defines one (e.g. TileLang for the NVIDIA compile-only checks).
        if grep -q '^test *=' "$pkg/pyproject.toml"; then editable+=(-e "$pkg[test]"); else editable+=(-e "$pkg"); fi
    done
    "$PY" -m pip install --quiet -e '.[dev]' "${editable[@]}"
fi

test_dirs=(tests)
for pkg in "${packages[@]}"; do
    if [ ! -d "$pkg/tests" ]; then
        echo "error: $pkg has no tests/ folder; every package keeps its tests next to its code" >&2
        exit 1
    fi
    test_dirs+=("$pkg/tests")
done

reports=$(mktemp -d)
trap 'rm -rf "$reports"' EXIT
failed=()
for dir in "${test_dirs[@]}"; do
    echo "=== pytest $dir"
    # One run per folder: packages may reuse test file names, and each folder must collect tests.
    set +e
    "$PY" -m pytest -q -p no:cacheprovider --junitxml="$reports/$(echo "$dir" | tr '/' '_').xml" "$dir" "$@"
    rc=$?
    set -e
    case $rc in
        0) ;;
        5) echo "error: pytest collected no tests in $dir (exit 5)" >&2; failed+=("$dir (no tests)") ;;
        *) failed+=("$dir (exit $rc)") ;;
    esac
done

# One closing line over all runs.
"$PY" - "$reports" <<'PY'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

totals = dict(tests=0, failures=0, errors=0, skipped=0)
for report in Path(sys.argv[1]).glob("*.xml"):
    for suite in ET.parse(report).getroot().iter("testsuite"):
        for key in totals:
            totals[key] += int(suite.get(key, 0))
bad = totals["failures"] + totals["errors"]
passed = totals["tests"] - bad - totals["skipped"]
print(f"total: {passed} passed, {bad} failed, {totals['skipped']} skipped")
PY

if [ ${#failed[@]} -ne 0 ]; then
    echo "FAILED: ${failed[*]}" >&2
    exit 1
fi
