PY ?= python3

.PHONY: install demo test bench
install: .installed
.installed: pyproject.toml scripts/install.sh
	PYTHON=$(PY) bash scripts/install.sh
	touch .installed

demo: install
	$(PY) examples/demo.py

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) eval/bench_generate.py
