#!/usr/bin/env bash
# Install what the tests need, lint, and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
