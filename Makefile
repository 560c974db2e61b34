# The two set-up commands (see README): `make demo` and `make test`. Both install missing
# Debian packages, configure and build first.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: deps configure build demo test format clean

deps:
	@scripts/deps.sh

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS)

configure: deps $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	$(BUILD)/dptrain launch recipes/quickstart.json --nproc 2

test: build
	scripts/check-format.sh
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 900

format:
	clang-format -i $$(git ls-files '*.cpp' '*.hpp' '*.cu' '*.cuh')

clean:
	rm -rf $(BUILD)
