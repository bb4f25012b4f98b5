"""oomdoctor: an OOM doctor and auto-tuner for fine-tuning Hugging Face LLMs on limited GPU memory.

Data path, top-down: ``spec`` (model spec from a config) -> ``plan`` (training plan) ->
``memory`` (one module per component, summed into a typed breakdown) -> ``search``/``tune`` -> ``train``.
Nothing in this package imports typer or rich except ``oomdoctor.cli``; torch/transformers/peft/bitsandbytes
are imported lazily inside the functions that need them.
"""

__version__ = "0.1.0"
