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

.PHONY: run test build wheel wheel-from-sdist test-deps redis-server test-rust test-loom test-python test-vllm test-vllm-033 test-vllm-034 vllm-venv-kvpool vllm034-venv-kvpool test-models test-models-slow lint bench bench-index-peers clean

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

# an abi3 manylinux wheel and an sdist, into dist/ (the wheel from target/, the sdist needs no
# build). --compatibility pypi: the lowest manylinux tag the extension complies with, checked by
# maturin's auditwheel (check: fail, never bundle or fall back to a plain linux tag); then
# .ci/check_dist.py checks the tag and that the wheel holds only the library.
wheel: $(RUN_DEPS)
	@echo "== building the wheel (release, manylinux, abi3) and the sdist into dist/"
	@rm -f dist/kvpool-*.whl dist/kvpool-*.tar.gz
	@$(VENV)/bin/maturin build --release --compatibility pypi --auditwheel check --out dist \
		>$(VENV)/wheel.log 2>&1 || (cat $(VENV)/wheel.log >&2; exit 1)
	@$(VENV)/bin/maturin sdist --out dist >>$(VENV)/wheel.log 2>&1 || (cat $(VENV)/wheel.log >&2; exit 1)
	@$(PY) .ci/check_dist.py dist

# the sdist builds on its own: pip builds a wheel from dist/'s sdist in a temporary folder
# (maturin of this venv, a clean cargo target: a few minutes), then the same checks. pip alone
# would tag it linux_x86_64 (maturin's PEP 517 default: a local build); the build-args ask for
# the manylinux check that `make wheel` runs.
wheel-from-sdist: wheel
	@echo "== building a wheel from the sdist (clean build, a few minutes)"
	@out="$$(mktemp -d)" && $(PY) -m pip wheel -q --disable-pip-version-check --no-deps \
		--no-build-isolation -C build-args="--compatibility pypi --auditwheel check" \
		-w "$$out" dist/kvpool-*.tar.gz >$(VENV)/sdist.log 2>&1 \
		|| (cat $(VENV)/sdist.log >&2; exit 1); $(PY) .ci/check_dist.py "$$out" --wheel; rc=$$?; rm -rf "$$out"; exit $$rc

test: test-deps build test-rust test-loom test-python

test-rust:
	cargo test -p kvpool --release

# loom models of the lock-free paths (rust/kvpool/tests/loom.rs, and the index's shared table in
# rust/kvpool/src/index/table.rs, its shards' copies in rust/kvpool/src/index/shard.rs, the
# batched release in rust/kvpool/src/release.rs, the block store's
# bulk reference count in rust/kvpool/src/bulk_arc.rs); own target dir so the cfg flag
# does not invalidate the normal build; debug assertions on, so the state-word checks of
# block.rs run in every explored interleaving.
test-loom:
	RUSTFLAGS="--cfg kvpool_loom" LOOM_MAX_PREEMPTIONS=3 CARGO_TARGET_DIR=target/loom \
		CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true \
		cargo test -p kvpool --release --test loom
	RUSTFLAGS="--cfg kvpool_loom" LOOM_MAX_PREEMPTIONS=3 CARGO_TARGET_DIR=target/loom \
		CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true \
		cargo test -p kvpool --release --lib index::table
	RUSTFLAGS="--cfg kvpool_loom" LOOM_MAX_PREEMPTIONS=3 CARGO_TARGET_DIR=target/loom \
		CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true \
		cargo test -p kvpool --release --lib index::shard
	RUSTFLAGS="--cfg kvpool_loom" LOOM_MAX_PREEMPTIONS=3 CARGO_TARGET_DIR=target/loom \
		CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true \
		cargo test -p kvpool --release --lib release::
	RUSTFLAGS="--cfg kvpool_loom" LOOM_MAX_PREEMPTIONS=3 CARGO_TARGET_DIR=target/loom \
		CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true \
		cargo test -p kvpool --release --lib bulk_arc::

test-python: test-deps build
	$(PY) -m pytest -q

# kvpool under the real Scheduler of both vLLM versions it supports (0.33.x, 0.34.x), on CPU
# (tests/vllm): one venv each, .venv-vllm (0.33.0, which test-models uses too) and
# .venv-vllm-034 (0.34.0). Both pin torch 2.14.0, whose CUDA build (with its nvidia-* wheels,
# about 9 GB) imports without a GPU. uv installs each from PyPI in about a minute, once per
# machine (the stamps), from its one cache (uv's default, ~/.cache/uv, or UV_CACHE_DIR): every
# file is hardlinked from it, so the cache and both venvs take about 11 GB together (the second
# venv 1.3 GB of its own), not 2 x 9 plus the cache. vLLM 0.34.0 pins flashinfer-python 0.7.3,
# which is not on PyPI: uv takes 0.7.4 instead (tests/vllm/uv-overrides-034.txt; flashinfer is
# never imported on CPU). kvpool goes in with maturin develop (the warm cargo target of
# `make build`).
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.33.0
VLLM_STAMP := $(VLLM_VENV)/.vllm-stamp
VLLM034_VENV ?= .venv-vllm-034
VLLM034_VERSION ?= 0.34.0
VLLM034_STAMP := $(VLLM034_VENV)/.vllm-stamp
VLLM_TEST_ENV := VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1

# $(call install_vllm,VENV,VERSION,more uv arguments): the venv, uv in it, vLLM and the test tools
define install_vllm
	@echo "== installing vllm==$(2) (torch 2.14.0) into $(1) with uv (about a minute; 9 GB, hardlinked from uv's cache)"
	@$(PYTHON) -m venv $(1)
	@$(1)/bin/python -m pip install -q --disable-pip-version-check uv >$(1)/install.log 2>&1 \
		|| (cat $(1)/install.log >&2; exit 1)
	@$(1)/bin/uv pip install -q --python $(1)/bin/python --link-mode hardlink "vllm==$(2)" $(3) \
		"pytest>=8" xxhash "hypothesis>=6.100" "numpy>=1.24" >>$(1)/install.log 2>&1 \
		|| (cat $(1)/install.log >&2; exit 1)
	@touch $@
endef

# $(call install_kvpool,VENV): kvpool into a vLLM venv (maturin develop, the warm cargo target)
define install_kvpool
	@echo "== installing kvpool into $(1)"
	@VIRTUAL_ENV=$(abspath $(1)) PATH=$(abspath $(1))/bin:$$PATH $(VENV)/bin/maturin develop --release \
		>$(1)/build.log 2>&1 || (cat $(1)/build.log >&2; exit 1)
endef

$(VLLM_STAMP): $(RUN_DEPS)
	$(call install_vllm,$(VLLM_VENV),$(VLLM_VERSION))

$(VLLM034_STAMP): $(RUN_DEPS) tests/vllm/uv-overrides-034.txt
	$(call install_vllm,$(VLLM034_VENV),$(VLLM034_VERSION),--override tests/vllm/uv-overrides-034.txt)

vllm-venv-kvpool: $(VLLM_STAMP)
	$(call install_kvpool,$(VLLM_VENV))

vllm034-venv-kvpool: $(VLLM034_STAMP)
	$(call install_kvpool,$(VLLM034_VENV))

# both versions, one after the other (each run prints its own pytest summary)
test-vllm: test-vllm-033 test-vllm-034

test-vllm-033: vllm-venv-kvpool
	@echo "== tests/vllm under vLLM $(VLLM_VERSION) ($(VLLM_VENV))"
	$(VLLM_TEST_ENV) $(VLLM_VENV)/bin/python -m pytest -q tests/vllm

test-vllm-034: vllm034-venv-kvpool
	@echo "== tests/vllm under vLLM $(VLLM034_VERSION) ($(VLLM034_VENV))"
	$(VLLM_TEST_ENV) $(VLLM034_VENV)/bin/python -m pytest -q tests/vllm

# ruff format decides the layout of every Python file (100 columns, pyproject.toml); mypy checks
# the package and its stub ([tool.mypy]); clippy denies an unsafe block without `// SAFETY:`.
PY_SOURCES := python tests benches examples .ci

# Real models on kvpool (tests/models, docs/engine.md): tiny random-weight Qwen3, Gemma 3 text and
# Qwen3-Next through kvpool.integrations.transformers, every logit against the model's own
# forward, on CPU with the numpy kernel backend. In the vLLM venv: vLLM brings torch and
# transformers. The emulated-backend variants (the kernels' CUDA sources on the CPU, a few
# minutes) are marked slow: make test-models-slow, outside .ci/run.
test-models: vllm-venv-kvpool
	HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python -m pytest -q -m "not slow" tests/models

test-models-slow: vllm-venv-kvpool
	HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/python -m pytest -q -m slow tests/models

lint: $(DEPS) build
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(VENV)/bin/ruff format --check $(PY_SOURCES)
	$(VENV)/bin/ruff check $(PY_SOURCES)
	$(PY) -m mypy
	$(PY) -m mypy.stubtest kvpool._core --allowlist stubtest-allowlist.txt

bench:
	cargo bench -p kvpool

# KVIndex beside the routers' own indexes (Dynamo's dynamo-kv-router, SGLang's smg-radix-tree and
# kv-index, from crates.io) on one recorded Mooncake stream: benches/index_peers, its own workspace
# and Cargo.lock, so that neither build, lint nor CI compiles the peers. ARGS="--instances 1000
# --rounds 3" narrows a run (see benches/index_peers/src/main.rs); benches/RESULTS.md has the table.
bench-index-peers:
	cd benches/index_peers && cargo run --release --quiet -- $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM034_VENV) target dist
