#!/bin/sh
# Install the frameworks whose own parsers read `shardwise plan --emit` output (pyproject's
# `frameworks` extra; tests/integration), without their dependency trees so that torch stays
# the pinned CPU build: --no-deps, and --no-build-isolation with DS_BUILD_OPS=0 for DeepSpeed's
# sdist. Run inside the project's virtual environment, after the dev install (about 2 minutes).
set -eu
python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['frameworks'], sep='\n')" > .venv/frameworks.txt
DS_BUILD_OPS=0 pip install -q --no-deps --no-build-isolation -r .venv/frameworks.txt
python -c "import torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
# The launchers' own readers (pyproject's `launchers` extra: SkyPilot, the Kubeflow training
# operator's SDK, shellcheck) in an environment of their own, .venv/launchers: their
# dependency trees pin click and uvicorn below the project's (tests/integration/test_launchers.py)
python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['launchers'], sep='\n')" > .venv/launchers.txt
python -m venv .venv/launchers && .venv/launchers/bin/pip install -q -r .venv/launchers.txt
