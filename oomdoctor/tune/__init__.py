"""The ``tune`` verb: search the plan that fits (``search``), verify it, emit it (``tuner``)."""
