# Two entry points for people: `make run` and `make test` (see README).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEPS := $(VENV)/.deps-stamp
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: run test build test-rust test-loom test-python lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS): requirements-dev.txt | $(PY)
	@# the remote-tier tests (tests/test_remote.py) start a real redis-server on loopback
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

build: $(DEPS)
	$(VENV)/bin/maturin develop --release --quiet

run: build
	$(VENV)/bin/kvpool simulate

test: build test-rust test-loom test-python

test-rust:
	cargo test -p kvpool --release

# loom models of the lock-free paths (rust/kvpool/tests/loom.rs); own target dir so the cfg flag
# does not invalidate the normal build; debug assertions on, so the state-word checks of
# block.rs run in every explored interleaving.
test-loom:
	RUSTFLAGS="--cfg kvpool_loom" LOOM_MAX_PREEMPTIONS=3 CARGO_TARGET_DIR=target/loom \
		CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true \
		cargo test -p kvpool --release --test loom

test-python: build
	$(PY) -m pytest -q

lint: build
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(VENV)/bin/ruff check python tests benches
	$(PY) -m mypy.stubtest kvpool._core --allowlist stubtest-allowlist.txt

bench:
	cargo bench -p kvpool

clean:
	rm -rf $(VENV) target
