#!/usr/bin/env bash
# A virtual environment with the pinned openai client for tests/e2e_openai_client.rs, in
# target/pyenv (inside the repo; nothing is cached elsewhere).
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! target/pyenv/bin/python -c "import openai" 2>/dev/null; then
  python3 -m venv target/pyenv
  target/pyenv/bin/pip install --quiet --no-cache-dir --disable-pip-version-check -r tests/openai_client/requirements.txt
fi
target/pyenv/bin/python -c "import openai; print('openai', openai.__version__)"
