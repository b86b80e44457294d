"""Adapters that attach trustscope to other trainers, one module per framework (the framework imported lazily)."""
