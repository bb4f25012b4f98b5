"""Model layer: a :class:`~oomdoctor.model.spec.ModelSpec` from config.json alone (``load``), the per-family
parameter inventories (``architectures``)."""
