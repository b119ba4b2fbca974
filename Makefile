# The two commands: `make demo` runs the demo lifecycle, `make test` runs the test suite.
# Both install what they need first (infra/setup.sh, idempotent).
.PHONY: demo test test-fast setup lint bench

setup:
	@bash infra/setup.sh

demo: setup
	.venv/bin/compass validate specs/examples/tiny.yaml
	.venv/bin/compass plan specs/examples/tiny.yaml
	.venv/bin/compass run specs/examples/tiny.yaml

test: setup
	.venv/bin/python -m pytest -q tests

# Everything not marked slow (no end-to-end flows): a few minutes, for iterating.
test-fast: setup
	.venv/bin/python -m pytest -q -m "not slow" tests

lint: setup
	.venv/bin/ruff check .

bench: setup
	.venv/bin/python benchmarks/curation_throughput.py
	.venv/bin/python benchmarks/cached_rerun.py
	.venv/bin/python benchmarks/pretrain_throughput.py --engine torch
	.venv/bin/python benchmarks/pretrain_throughput.py --engine deepspeed
	.venv/bin/python benchmarks/evaluation_throughput.py
	.venv/bin/python benchmarks/submission_overhead.py
