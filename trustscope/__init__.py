"""trustscope: see the trust region of LLM reinforcement learning, and fix it.

Hooks log per-token rollout and trainer probabilities to Parquet (:mod:`trustscope.logger`), a DuckDB layer turns
them into diagnostics (:mod:`trustscope.db`), a Streamlit dashboard shows them (``app/``), and an integrated trainer
trains with DPPO or any other registered rule (:mod:`trustscope.train`).
"""

__version__ = "0.1.0"
