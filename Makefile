# flashflow: the commands of the README.
#
#   make test              ruff, then the CPU tests in the project's own .venv (kernels through Triton's
#                          interpreter)
#   make test BROWSER=1    the same, with the explorer's browser test (installs Chromium, see below)
#   make browser           only the browser test's dependencies
#   make bench / make info the attention benchmark / the kernel resource report (GPU machine)
#
# Everything Python goes into $(VENV); nothing is installed system-wide except Debian's Chromium,
# and only when asked for (BROWSER=1 or `make browser`).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BROWSER ?=

# Stamps: an install step runs again only when its inputs change, not on every `make test`.
TEST_STAMP := $(VENV)/.stamp-test
BROWSER_STAMP := $(VENV)/.stamp-browser
GPU_STAMP := $(VENV)/.stamp-gpu

.PHONY: venv install-test browser test test-gpu bench info clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)

venv: $(PY)

# The pinned CPU stack (torch CPU build, triton, numpy, pytest), then the package without deps
# so pip cannot swap the pinned torch for another build.
$(TEST_STAMP): requirements-ci.txt pyproject.toml | $(PY)
	$(PY) -m pip install -q --no-cache-dir -r requirements-ci.txt
	$(PY) -m pip install -q --no-cache-dir --no-deps -e .
	touch $@

install-test: $(TEST_STAMP)

# Debian's Chromium (system-wide, through apt) and playwright (into $(VENV)).
$(BROWSER_STAMP): .ci/setup_browser.sh | $(TEST_STAMP)
	bash .ci/setup_browser.sh $(PY)
	touch $@

browser: $(BROWSER_STAMP)

# With BROWSER=1 the browser test must run: FLASHFLOW_BROWSER=1 turns its skip into a failure.
ifneq ($(BROWSER),)
test: $(BROWSER_STAMP)
test: export FLASHFLOW_BROWSER=1
endif
# Triton's and Inductor's caches and every temporary file go into $(VENV) too (by default they land
# in ~/.triton and /tmp: Inductor's precompiled headers alone are ~300 MB there).
test: $(TEST_STAMP)
	$(VENV)/bin/ruff check --no-cache flashflow tests
	mkdir -p $(VENV)/tmp
	TRITON_INTERPRET=1 TRITON_HOME=$(abspath $(VENV)) TORCHINDUCTOR_CACHE_DIR=$(abspath $(VENV))/torchinductor \
		TMPDIR=$(abspath $(VENV))/tmp $(PY) -m pytest -q -p no:cacheprovider tests

# On a machine with a CUDA GPU: the package with its declared dependencies (the CUDA torch
# build pip picks there) and the GPU tests.
$(GPU_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

test-gpu: $(GPU_STAMP)
	$(PY) -m pytest -q -m gpu tests

bench: $(GPU_STAMP)
	$(VENV)/bin/flashflow bench

info: $(GPU_STAMP)
	$(VENV)/bin/flashflow info

clean-venv:
	rm -rf $(VENV)
