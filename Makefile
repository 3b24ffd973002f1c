PY ?= python3

.PHONY: install demo test test-latest bench
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

# the suite on the newest release of every dependency, in a throwaway virtual environment
test-latest:
	PYTHON=$(PY) bash scripts/test_latest.sh
