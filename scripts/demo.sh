#!/usr/bin/env bash
# Install trustscope, train a short DPPO run on the toy world with logging on, and serve the dashboard over it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/trustscope demo "$@"
