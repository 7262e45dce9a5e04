# Two entry points for people: `make run` and `make test` (see README).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# what `make run` needs (maturin builds, rich prints); the test targets add requirements-dev.txt
RUN_DEPS := $(VENV)/.run-deps-stamp
DEPS := $(VENV)/.deps-stamp
PIP := $(PY) -m pip install -q --disable-pip-version-check
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: run test build wheel test-deps redis-server test-rust test-loom test-python lint bench clean

$(PY):
	@$(PYTHON) -m venv $(VENV)

$(RUN_DEPS): | $(PY)
	@$(PIP) --upgrade pip >$(VENV)/pip.log 2>&1 || (cat $(VENV)/pip.log >&2; exit 1)
	@$(PIP) "maturin>=1.9.4,<2" "numpy>=1.24" "rich>=13" >>$(VENV)/pip.log 2>&1 || (cat $(VENV)/pip.log >&2; exit 1)
	@touch $@

$(DEPS): requirements-dev.txt $(RUN_DEPS)
	@echo "== installing the test and lint dependencies (requirements-dev.txt) into $(VENV)"
	@$(PIP) -r requirements-dev.txt >>$(VENV)/pip.log 2>&1 || (cat $(VENV)/pip.log >&2; exit 1)
	@touch $@

# the remote-tier tests (tests/tiers/test_remote.py) start a real redis-server on loopback
redis-server:
	@command -v redis-server >/dev/null || (echo "== installing redis-server (Debian package) for tests/tiers/test_remote.py" \
		&& apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)

test-deps: $(DEPS) redis-server

build: $(RUN_DEPS)
	@echo "== building kvpool (Rust core, release build) into $(VENV); the first build takes about a minute"
	@$(VENV)/bin/maturin develop --release >$(VENV)/build.log 2>&1 || (cat $(VENV)/build.log >&2; exit 1)

run: build
	@$(VENV)/bin/kvpool simulate

# an abi3 manylinux wheel and an sdist, into dist/ (the wheel from target/, the sdist needs no build)
wheel: $(RUN_DEPS)
	@echo "== building the wheel (release) and the sdist into dist/"
	@$(VENV)/bin/maturin build --release --out dist >$(VENV)/wheel.log 2>&1 || (cat $(VENV)/wheel.log >&2; exit 1)
	@$(VENV)/bin/maturin sdist --out dist >>$(VENV)/wheel.log 2>&1 || (cat $(VENV)/wheel.log >&2; exit 1)
	@ls dist

test: test-deps build test-rust test-loom test-python

test-rust:
	cargo test -p kvpool --release

# loom models of the lock-free paths (rust/kvpool/tests/loom.rs); own target dir so the cfg flag
# does not invalidate the normal build; debug assertions on, so the state-word checks of
# block.rs run in every explored interleaving.
test-loom:
	RUSTFLAGS="--cfg kvpool_loom" LOOM_MAX_PREEMPTIONS=3 CARGO_TARGET_DIR=target/loom \
		CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true \
		cargo test -p kvpool --release --test loom

test-python: test-deps build
	$(PY) -m pytest -q

lint: $(DEPS) build
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(VENV)/bin/ruff check python tests benches examples
	$(PY) -m mypy.stubtest kvpool._core --allowlist stubtest-allowlist.txt

bench:
	cargo bench -p kvpool

clean:
	rm -rf $(VENV) target dist
