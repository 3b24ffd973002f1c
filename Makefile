PY ?= python3

.PHONY: install demo test test-oldest test-latest bench gpu-wheels gpu-check
install: .installed
.installed: pyproject.toml scripts/install.sh scripts/constraints.txt
	PYTHON=$(PY) bash scripts/install.sh
	touch .installed

demo: install
	$(PY) examples/demo.py

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) eval/bench_generate.py

# the suite on the oldest supported Transformers (the rest as pinned), in a throwaway virtual environment
test-oldest:
	PYTHON=$(PY) bash scripts/test_oldest.sh

# the suite on the newest release of every dependency (torch too: its CUDA build, on the CPU), in a throwaway virtual environment
test-latest:
	PYTHON=$(PY) bash scripts/test_latest.sh

# on this machine, before a lent GPU run: the pinned Transformers as a wheel for the GPU image's
# Python (its torch, accelerate and the rest are the image's), into .whl/ (ignored; carried)
gpu-wheels:
	$(PY) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux2014_x86_64 -d .whl "$$(grep '^transformers==' scripts/constraints.txt)"

# on the lent GPU machine (carry .whl): CUDA tests, then eval/bench_gpu.py in about 5 minutes
gpu-check:
	bash scripts/gpu_check.sh
