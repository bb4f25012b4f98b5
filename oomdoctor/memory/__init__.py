"""Memory formulas: one module per component, each a pure function of (ModelSpec, Plan) returning bytes,
summed into a :class:`MemoryBreakdown` by ``oomdoctor.memory.analytic``. Engines: ``oomdoctor.engines``."""

from oomdoctor.memory.breakdown import MemoryBreakdown

__all__ = ["MemoryBreakdown"]
