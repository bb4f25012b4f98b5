"""`oomdoctor train`: run a plan for real (config, data, model build, OOM guard, checkpoints).

Only :mod:`oomdoctor.train.config` is torch-free; everything else imports torch/transformers lazily or at module
level and is imported by the CLI inside the command body.
"""
