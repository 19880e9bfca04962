#!/usr/bin/env bash
# A virtual environment with the pinned Python packages the tests drive (the openai
# client, the Kubernetes schema validator), in target/pyenv (inside the repo; nothing is
# cached elsewhere).
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! target/pyenv/bin/python -c "import openai, kubernetes_validate, yaml" 2>/dev/null; then
  python3 -m venv target/pyenv
  target/pyenv/bin/pip install --quiet --no-cache-dir --disable-pip-version-check -r tests/python/requirements.txt
fi
target/pyenv/bin/python -c "import openai; print('openai', openai.__version__)"
