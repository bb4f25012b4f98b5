"""The ``tune`` verb: ``tuner.tune`` runs it — ``search`` (enumerate, price, size and rank the plans), ``strategies``
(the ladder N GPUs climb), ``longest`` (``--seq-len max``), ``verify`` (GPU probe or simulated step), ``result``
(``TuneResult``, what ``--json`` prints) — and ``emit`` writes the plan for ``oomdoctor train`` or another trainer."""
