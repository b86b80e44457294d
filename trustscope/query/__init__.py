"""The query layer, one job a module (its public face is :mod:`trustscope.db`).

- :mod:`~trustscope.query.catalogue`: the SQL files, what each view reads, the catalogue file every connection opens.
- :mod:`~trustscope.query.rules`: the rule parameters the views bind, per run.
- :mod:`~trustscope.query.runs`: the runs of a log directory, their readable files, broken runs.
- :mod:`~trustscope.query.partials`: the kept aggregates and their first pass (here or as Ray tasks).
- :mod:`~trustscope.query.connection`: :class:`LogDB` and :func:`connect`.
- :mod:`~trustscope.query.analyses`: the named analyses, as pandas.
- :mod:`~trustscope.query.contracts`: the views' data contracts.
"""
