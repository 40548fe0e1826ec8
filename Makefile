# The two commands of the README: `make demo` and `make test`. Each sets up .venv first.
PY      := .venv/bin/python
STAMP   := .venv/.installed
TORCH   := torch==2.13.0

.PHONY: demo test bench bench-auto docs setup clean

setup: $(STAMP)

# torch is pinned and installed first so pip takes the local CPU build, never a CUDA download.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]' $(TORCH)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m sbpflow demo

# the suite in parallel processes (pytest-xdist): one more than the cores, at most 4; many
# tests wait on rank threads or processes, so 3 on CI's 2 cores beat 2 (535 s vs 600 s
# here; one process: 965-1040 s)
WORKERS := $(shell n=$$(( $$(nproc 2>/dev/null || echo 1) + 1 )); [ $$n -gt 4 ] && n=4; echo $$n)

test: $(STAMP)
	$(PY) -m pytest -q -x -n $(WORKERS) --durations=10

bench: $(STAMP)
	$(PY) benchmarks/boxing.py
	$(PY) benchmarks/train_gpt.py

bench-auto: $(STAMP)
	$(PY) benchmarks/auto_search.py --quick
	$(PY) benchmarks/auto_fidelity.py

# the docs site (mkdocs-material + mkdocstrings, in the dev and docs extras) into site/;
# strict: a broken link, a missing reference or a docstring warning fails the build
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf .venv build site *.egg-info
