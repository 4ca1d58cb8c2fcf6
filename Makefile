# AutoMoE developer entry points. `make demo` and `make test` set everything up themselves
# (Debian packages, .venv, CMake build) and are quick when nothing changed.
.PHONY: all setup build test test-imports test-sizes test-cpp test-python test-fuzz demo clean

BUILD ?= build
PY := $(CURDIR)/.venv/bin/python
export CCACHE_SLOPPINESS := pch_defines,time_macros,include_file_mtime,include_file_ctime
export CCACHE_BASEDIR := $(CURDIR)
export PYTHONPATH := $(CURDIR)/python$(if $(PYTHONPATH),:$(PYTHONPATH))

all: build

setup:
	@scripts/setup.sh

.venv/.automoe-requirements: requirements.txt
	@scripts/setup.sh

$(BUILD)/build.ninja: CMakeLists.txt .venv/.automoe-requirements | setup
	cmake -S . -B $(BUILD) -G Ninja -DPython3_EXECUTABLE=$(PY) -DCMAKE_BUILD_TYPE=Release

build: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j 2

test-cpp: build
	@test -x $(BUILD)/automoe_tests || { echo "make: C++ tests were not built (GoogleTest missing?)"; exit 1; }
	cd $(BUILD) && ctest --output-on-failure -j 2

test-python: build
	$(PY) -m pytest -q --durations=40 tests/python

# The parsers of untrusted input under libFuzzer with ASan + UBSan, briefly (scripts/fuzz.sh;
# docs/development.md says how to run them long).
test-fuzz: setup
	FUZZ_SEED=$${FUZZ_SEED:-1} scripts/fuzz.sh $(FUZZ_SECONDS)

FUZZ_SECONDS ?= 30

# The Python package's modules import each other without a cycle, function-level imports included
# (scripts/check_imports.py: standard library only, so it runs before anything is set up).
test-imports:
	python3 scripts/check_imports.py python/automoe

# No source file over 800 lines in csrc/ or python/, no C++ function over 150 (scripts/check_sizes.py;
# function extents from universal-ctags, installed by setup).
test-sizes: setup
	python3 scripts/check_sizes.py

test: test-imports test-sizes test-cpp test-python test-fuzz

demo: build
	$(PY) -m automoe.demo

clean:
	rm -rf $(BUILD) python/automoe/_C*.so python/automoe/bin
