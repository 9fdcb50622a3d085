#!/usr/bin/env bash
# Installs what the browser test of the dataflow explorer needs: Debian's Chromium (system-wide,
# through apt-get; sudo when not root) and the Python `playwright` package (into PYTHON's
# environment). Idempotent: each part is skipped when already present. Playwright's own browser
# download (`playwright install`) is never used: the test points playwright at /usr/bin/chromium.
#
# Usage: .ci/setup_browser.sh [PYTHON]   (PYTHON defaults to $PY, then python3);
#        `make browser` and `make test BROWSER=1` run it with the project's .venv.
set -euo pipefail

PY="${1:-${PY:-python3}}"
PLAYWRIGHT_VERSION="${PLAYWRIGHT_VERSION:-1.65.2}"

if [ ! -x /usr/bin/chromium ]; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then
        SUDO="sudo"
    fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core
fi

if ! "$PY" -c "import playwright.sync_api" >/dev/null 2>&1; then
    "$PY" -m pip install -q "playwright==${PLAYWRIGHT_VERSION}"
fi

/usr/bin/chromium --version 2>/dev/null  # (Debian's wrapper script warns on stderr)
# One throwaway headless start: the first one on a machine builds font and profile caches,
# which can take longer than a test's wait.
timeout 120 /usr/bin/chromium --headless --no-sandbox --disable-gpu --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --dump-dom about:blank >/dev/null 2>&1 || true
"$PY" -c "import importlib.metadata as m; print('playwright', m.version('playwright'))"
