"""``python -m bench``: the benchmark runner (:mod:`bench.runner`)."""

from bench.runner import main

raise SystemExit(main())
