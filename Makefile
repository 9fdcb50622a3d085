# flashflow — the two commands of the README's quick start.
PY ?= python3
PIP = $(PY) -m pip

.PHONY: install install-test test bench info gpu-check

install:
	$(PIP) install -q -e .

install-test:
	$(PIP) install -q -r requirements-ci.txt
	$(PIP) install -q --no-deps -e .
	# Debian's Chromium + playwright for the explorer's browser test; if this machine cannot
	# install them, that one test reports itself skipped and says why.
	-bash scripts/setup_browser.sh $(PY)

# CPU tests: kernels run through Triton's interpreter against float64 references.
test: install-test
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests

bench: install
	flashflow bench

info: install
	flashflow info
