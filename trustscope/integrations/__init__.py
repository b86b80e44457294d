"""Adapters that attach trustscope to other trainers, one module per framework (the framework imported lazily,
so importing this package costs nothing).

- :mod:`trustscope.integrations.trl`: ``attach(trainer, logdir)`` for TRL's ``GRPOTrainer`` (extra ``[trl]``).
- :mod:`trustscope.integrations.verl`: verl's policy-loss plugin and logging hook (extra ``[verl]``).
"""

INTEGRATIONS = {"trl": "trustscope.integrations.trl", "verl": "trustscope.integrations.verl"}
"""Framework name -> module path of its adapter."""
