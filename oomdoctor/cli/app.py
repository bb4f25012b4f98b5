"""The typer application object; each command lives in its own module under ``oomdoctor.cli``."""

import typer

app = typer.Typer(
    name="oomdoctor",
    help=(
        "OOM doctor and auto-tuner for fine-tuning Hugging Face LLMs on limited GPU memory.\n\n"
        "diagnose: what a training plan costs, from the config alone.  tune: the plan that fits, with the largest "
        "micro-batch and the same effective batch.  train: run it, recovering from OOM without losing a step.  "
        "explain: read a real CUDA OOM message and say why it happened."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
