#!/usr/bin/env bash
# Run jaxft's tests: ruff, the docs build (mkdocs --strict: the API reference from the
# docstrings) and the whole suite on Python 3.11 (.venv), then the `smoke` subset on
# Python 3.12 (.venv312, newest jax allowed by pyproject.toml) when a 3.12 interpreter exists.
# Arguments are passed to the main pytest run, e.g. `scripts/test.sh -x -k launcher`.
# Exits non-zero if either run fails (pytest's exit 5, "no tests collected", included).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

log() { echo "== scripts/test.sh: $*"; }

# pip_quiet DIR ARGS...: pip install ARGS into the environment DIR, quietly; pip's output
# (warnings included) shown only when the install fails.
pip_quiet() {
    local dir=$1 out
    shift
    out=$(mktemp)
    if ! "$dir/bin/python" -m pip install -q "$@" >"$out" 2>&1; then
        cat "$out"; rm -f "$out"; return 1
    fi
    rm -f "$out"
}

# setup_venv PYTHON DIR [EXTRAS]: create DIR with PYTHON if missing, then install jaxft with
# EXTRAS (default: test).
setup_venv() {
    local python=$1 dir=$2 extras=${3:-test}
    if [ ! -x "$dir/bin/python" ]; then
        log "creating $dir with $python ($("$python" --version 2>&1))"
        "$python" -m venv "$dir" || return 1
    fi
    log "installing -e '.[$extras]' into $dir"
    pip_quiet "$dir" -e ".[$extras]"
}

# install_deps DIR: install jaxft's dependencies and test extras (read from pyproject.toml) into
# the environment DIR, not jaxft itself: this may run alongside another environment's set-up,
# while only one editable install at a time writes jaxft.egg-info into the source tree.
install_deps() {
    local dir=$1 deps
    mapfile -t deps < <("$dir/bin/python" -c '
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["test"]))')
    pip_quiet "$dir" "${deps[@]}"
}

# find_python312: print the path of a working Python 3.12 interpreter, if any.
find_python312() {
    local candidates=() root p
    if command -v pyenv >/dev/null 2>&1 && root=$(pyenv root 2>/dev/null); then
        while IFS= read -r p; do candidates+=("$p"); done \
            < <(ls -d "$root"/versions/3.12*/bin/python 2>/dev/null | sort -V -r)
    fi
    if p=$(command -v python3.12 2>/dev/null); then candidates+=("$p"); fi
    for p in ${candidates[@]+"${candidates[@]}"}; do
        if "$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; then
            echo "$p"
            return 0
        fi
    done
    return 1
}

python311=python3
if command -v python3.11 >/dev/null 2>&1 && python3.11 -c pass >/dev/null 2>&1; then
    python311=python3.11
fi

python312=$(find_python312) || python312=""
[ -n "$python312" ] || log "no Python 3.12 interpreter found; the smoke run on 3.12 is skipped"

# The suites run on $JAXFT_TEST_WORKERS pytest-xdist workers (default 2), one test file per
# worker at a time (--dist loadfile: a file's tests share its module fixtures and its figures
# file). A multi-process test mostly waits (heartbeats, deadlines, restarts), so two of them at
# once fit two cores. JAXFT_TEST_WORKERS=0: one process, the tests one by one.
workers=${JAXFT_TEST_WORKERS:-2}
xdist=(-n "$workers")
[ "$workers" = 0 ] || xdist+=(--dist loadfile)

status=0
# The 3.12 environment is set up alongside the 3.11 one (two mostly single-threaded installs),
# and finished before any test runs: the tests' timing must not share the cores with pip.
setup312_log=""
if [ -n "$python312" ]; then
    setup312_log=$(mktemp)
    { [ -x .venv312/bin/python ] || "$python312" -m venv .venv312; } && install_deps .venv312 >"$setup312_log" 2>&1 &
    setup312_pid=$!
fi
setup311_ok=0
setup_venv "$python311" .venv test,docs && setup311_ok=1
setup312_ok=0
if [ -n "$python312" ]; then
    wait "$setup312_pid" || log "installing the dependencies into .venv312 failed; trying again"
    cat "$setup312_log"; rm -f "$setup312_log"
    setup_venv "$python312" .venv312 && setup312_ok=1  # jaxft itself (the dependencies are there)
fi
if [ "$setup311_ok" = 1 ]; then
    log "ruff (lint, pyproject.toml's rules)"
    .venv/bin/python -m ruff check jaxft tests examples scripts || status=1
    log "mypy (type check, pyproject.toml's settings)"
    .venv/bin/python -m mypy || status=1
    log "docs (mkdocs build --strict: the pages and the API reference from the docstrings)"
    docs_site=$(mktemp -d)
    .venv/bin/python -m mkdocs build --strict --site-dir "$docs_site" || status=1
    rm -rf "$docs_site"
    log "full suite on $(.venv/bin/python --version 2>&1)"
    .venv/bin/python -m pytest "${xdist[@]}" --durations=25 "$@" || status=1
else
    log "FAILED to set up .venv"
    status=1
fi

if [ -n "$python312" ]; then
    if [ "$setup312_ok" = 1 ]; then
        log "smoke subset on $(.venv312/bin/python --version 2>&1)"
        .venv312/bin/python -m pytest "${xdist[@]}" -q -m smoke || status=1
    else
        log "FAILED to set up .venv312"
        status=1
    fi
fi
exit $status
