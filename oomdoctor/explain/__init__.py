"""The ``explain`` verb: read a real OOM message and say why it happened and what to change."""
