"""Benchmarks: each module a script, run from the repository root as ``.venv/bin/python -m bench.NAME``
(so ``bench._harness``, another bench and the tests' public helpers import as packages, with no change
to ``sys.path``). See ``bench/_harness.py``, docs/performance.md and docs/scale.md."""
