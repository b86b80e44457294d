"""trustscope's benchmarks: one module a benchmark, run through one runner.

    .venv/bin/python -m bench list
    .venv/bin/python -m bench run cli report --quick
    .venv/bin/python -m bench run cli -- --repeat 3

Each ``bench/bench_<name>.py`` is the benchmark ``<name>``: its docstring says what it measures and against what
baseline, its ``main()`` parses ``sys.argv`` and returns its figures (or prints them), and an optional ``QUICK``
list gives the arguments of a small run. ``python -m bench run`` runs each in a fresh process and stores the result
as JSON under ``bench/results/`` with the machine, its load average, the git commit and the date; the tables of
``docs/performance.md`` are generated from those files (``python -m bench docs --write``).
"""
