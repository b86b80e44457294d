#!/usr/bin/env bash
# The integration tests against the oldest TRL and verl releases trustscope supports (the newest are the main
# venv's, run by scripts/test.sh). Each release goes in with --no-deps into its own folder under
# $TRUSTSCOPE_CACHE/releases (default ~/.cache/trustscope), put first on PYTHONPATH for one pytest run, so the venv
# is untouched. About 2 minutes on 2 cores.
#   bash scripts/test_releases.sh              # the fast integration tests, then verl's slow ones (below)
#   bash scripts/test_releases.sh -m slow -k ulysses   # or any pytest selection (no second verl run)
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST_TRL=1.10.0    # the lower bound of the [trl] extra (trustscope.integrations.trl.SUPPORTED_TRL)
OLDEST_VERL=0.8.0    # the lower bound of the [verl] extra (trustscope.integrations.verl.SUPPORTED_VERL)
select=("$@")
verl_slow=0
[[ ${#select[@]} == 0 ]] && select=(-m "not slow") && verl_slow=1

release() {  # release NAME VERSION -> the folder holding it
    local dir="${TRUSTSCOPE_CACHE:-$HOME/.cache/trustscope}/releases/$1-$2"
    if [[ ! -f "$dir/.complete" ]]; then
        rm -rf "$dir"
        .venv/bin/pip install --quiet --no-deps --target "$dir" "$1==$2" 2> >(grep -v "is ignored: it is neither" >&2)
        touch "$dir/.complete"
    fi
    echo "$dir"
}

trl_dir=$(release trl "$OLDEST_TRL")
PYTHONPATH="$trl_dir:$PWD${PYTHONPATH:+:$PYTHONPATH}" .venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_integration_trl.py "${select[@]}"
verl_dir=$(release verl "$OLDEST_VERL")
# verl 0.8's padding helpers import flash-attention's (CUDA) bert_padding: tests/cpu_shims hands on transformers' own
PYTHONPATH="$verl_dir:$PWD:$PWD/tests/cpu_shims${PYTHONPATH:+:$PYTHONPATH}" .venv/bin/python -m pytest -q \
    -p no:cacheprovider tests/test_integration_verl.py tests/test_verl_updates.py "${select[@]}"
if [[ $verl_slow == 1 ]]; then  # the slow verl tests too: Ray workers, several updates a step, verl's real
    # TrainingWorker with Ulysses on gloo (the V1 / TransferQueue ones skip: verl 0.8 has no V1 trainer)
    PYTHONPATH="$verl_dir:$PWD:$PWD/tests/cpu_shims${PYTHONPATH:+:$PYTHONPATH}" .venv/bin/python -m pytest -q \
        -p no:cacheprovider tests/test_integration_verl.py tests/test_verl_updates.py -m slow
fi
