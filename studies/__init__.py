"""Studies: experiments that produce the project's findings (docs/experiments.md), not speed measurements.

    .venv/bin/python -m studies.experiments run --preset sanity-v2     # the sweeps of the toy worlds
    .venv/bin/python -m studies.findings --logdir runs/sanity-v2        # the headline judged on pre-stated measures
    .venv/bin/python -m studies.eval_early_warning sweep|evaluate       # the collapse early warning's fit and test

Each module is run with ``python -m studies.<name>`` from the repository root.
"""
