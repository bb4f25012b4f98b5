"""`oomdoctor train`: run a plan for real (config, data, model build, OOM guard, checkpoints).

The recipe is :mod:`oomdoctor.train.loop` (``train()`` and ``TrainLoop``: setup, step, save); each module of the
library it calls has one job:

- ``config/`` — the YAML <-> plan vocabulary; ``preflight`` — what a config cannot run, checked before anything
  heavy;
- ``sizing`` — budget, ``micro_batch_size: auto``, the memory prediction, the steps of a run, host RAM for offload;
- ``setup`` — the job's topology and everything a run sets up before its first step, into a ``run.Run``;
- ``data`` / ``evaluate`` — tokenized samples, collation, the eval loss;
- ``resume`` — ``RunState`` (``trainer_state.json``), the fingerprint of a run, continuing a checkpoint;
- ``checkpoint`` / ``rundir`` / ``restart`` — checkpoint files, the run directory, the OOM-restart marker;
- ``oom`` — what an OOM the guard (``oomdoctor.execute.oom.OOMGuard``) cannot recover does;
- ``signals`` — Ctrl-C: finish the step, save, stop; ``report`` — metrics sinks;
- ``outputs`` — the final model, ``TrainResult`` and ``summary.json``; ``dryrun`` — ``train --dry-run``.

Only :mod:`oomdoctor.train.config` is torch-free by contract; everything else imports torch/transformers lazily or at
module level and is imported by the CLI inside the command body.
"""
