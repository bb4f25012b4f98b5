"""The ``diagnose`` verb: price a matrix of plans (``report``), the changes that make one fit (``advice``),
the curated plan matrix (``matrix``) and pictures (``plot``)."""
