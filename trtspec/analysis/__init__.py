"""From records to decisions, with no model in sight: the record schema (``records``), what a
verdict compares (``extract``: pairs, the primary metric, the speedup statistic) over which
independent units (``units``), the statistics (``stats``; ``gof`` for the exactness tests and
audits), the verdict and its gates (``decide``, ``gates``, ``goodput``), the cost model, and
what a deployment applies (``crossover``, ``memory``, ``policy``, ``schedules``)."""
