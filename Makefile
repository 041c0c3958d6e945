# AIWorks developer entry points. `make run` and `make test` install everything first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DEPS   := pyproject.toml $(wildcard requirements-*.txt)

.PHONY: install run test test-unit test-e2e test-images proto bench images clean

install: $(STAMP)

$(STAMP): $(DEPS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check pip==26.3 setuptools==84.2.1
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]' $(foreach r,$(wildcard requirements-*.txt),-r $(r))
	# xds-protos (requirements-deploy.txt) ships an old copy of opentelemetry/proto/common/v1/common_pb2.py
	# (no InstrumentationScope); whichever wheel is unpacked last wins that file. Put the tracing exporter's
	# own copy back; Envoy's protos load with it too (tests/unit/test_packaging.py checks both).
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps opentelemetry-proto==1.45.2
	touch $(STAMP)

run: install            ## install, then start the whole suite locally (Ctrl-C stops it)
	$(BIN)/aiworks up

test: install           ## install, then run every test but the image builds (installs the Debian packages needed)
	bash scripts/ensure-debian-packages.sh
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -m "not images" --durations=25

test-images: install    ## build the images with podman and run docker-compose.yml with them (slow; .ci/run runs it)
	bash scripts/ensure-debian-packages.sh
	$(BIN)/python -m pytest -m images tests/deploy

test-unit: install
	$(BIN)/python -m pytest tests/unit

test-e2e: install
	$(BIN)/python -m pytest tests/e2e

proto: install          ## regenerate the gRPC code from proto/
	$(BIN)/python scripts/gen_proto.py

images:                 ## build the service images with docker, podman or buildah (scripts/build-images.sh)
	sh scripts/build-images.sh

bench: install          ## the serving-spine benchmark (docs/benchmarks.md)
	$(BIN)/python bench/serving_spine.py

clean:
	rm -rf $(VENV) .aiworks build *.egg-info
