"""The plan as the config of another trainer, and the code that builds that trainer from it.

One module per trainer (the ``trainer`` knob; what each can run is ``oomdoctor.plan.targets``):

- ``trl``: the YAML ``trl sft --config FILE`` reads (ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig);
- ``hf``: a TrainingArguments JSON plus the model/peft/bitsandbytes/data keys of the script that runs it
  (``python -m oomdoctor.execute.trainers.hf FILE``: transformers' ``Trainer``, nothing of oomdoctor's in the step);
- ``axolotl``: a YAML in axolotl's config schema for ``axolotl train FILE``;
- ``accelerate``: a launch config for ``accelerate launch --config_file FILE train.py``.

Each ``document(req)`` returns a :class:`oomdoctor.execute.trainers.common.Document`: the data the file holds and
the notes a reader needs (placeholders, how to launch). ``tune --emit`` writes them (``oomdoctor.tune.emit``); the
simulated engine replays the trl and hf trainers built from the same documents, so what is emitted is what was
priced.
"""

from __future__ import annotations

from importlib import import_module

from oomdoctor.execute.trainers.common import Document, DocumentRequest

#: The foreign trainers, each a module of this package with ``document(req)`` and ``COMMAND`` (imported when used:
#: ``python -m oomdoctor.execute.trainers.hf`` must not find its module already imported by this package).
FOREIGN: tuple[str, ...] = ("trl", "hf", "axolotl", "accelerate")


def _module(trainer: str):
    return import_module(f"oomdoctor.execute.trainers.{trainer}")


def command(trainer: str, path: str) -> str:
    """The command that runs ``trainer``'s document written at ``path`` (already shell-quoted)."""
    return _module(trainer).COMMAND.format(path=path)


def document(req: DocumentRequest) -> Document:
    """The config of ``req.plan.trainer`` for the plan."""
    return _module(req.plan.trainer).document(req)


__all__ = ["FOREIGN", "Document", "DocumentRequest", "command", "document"]
