#!/usr/bin/env bash
# Install what the tests need, lint, and run the tests (pyproject.toml leaves the slow and heavy ones to .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
