"""Adapters that let trustscope log runs of other trainers. One module per framework; each imports its framework
only when used, so importing this package costs nothing.

- :mod:`trustscope.integrations.trl`: ``attach(trainer, logdir)`` for TRL's ``GRPOTrainer`` (extra ``[trl]``).
"""

INTEGRATIONS = {"trl": "trustscope.integrations.trl"}
"""Framework name -> module path of its adapter."""
