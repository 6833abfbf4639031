#!/usr/bin/env bash
# The venv tests/test_frameworks.py runs the agent frameworks in (their dependencies
# conflict with the project's): FRAMEWORK_VENV, /work/venvs/frameworks by default.
# Kept when it already holds what tests/frameworks/requirements.txt asks for.
# One build at a time: a second call (.ci/run's background build, then the framework
# tests' own call) waits for the first on FRAMEWORK_VENV.lock and finds the venv made.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${FRAMEWORK_VENV:-/work/venvs/frameworks}
wanted=tests/frameworks/requirements.txt
stamp="$venv/.requirements"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [ -x "$venv/bin/python" ] && cmp -s "$wanted" "$stamp"; then
    echo "framework venv $venv is up to date"
    exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --progress-bar off -r "$wanted"
cp "$wanted" "$stamp"
echo "framework venv $venv made from $wanted"
