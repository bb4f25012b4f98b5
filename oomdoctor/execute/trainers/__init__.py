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

from oomdoctor.execute.trainers import accelerate, axolotl, hf, trl
from oomdoctor.execute.trainers.common import Document, DocumentRequest

#: The document builder of each foreign trainer (``oomdoctor``'s own YAML is ``oomdoctor.train.config``'s).
DOCUMENTS = {"trl": trl.document, "hf": hf.document, "axolotl": axolotl.document, "accelerate": accelerate.document}
#: The command that runs each trainer's document (``{path}``: the file).
COMMANDS = {"trl": trl.COMMAND, "hf": hf.COMMAND, "axolotl": axolotl.COMMAND, "accelerate": accelerate.COMMAND}


def document(req: DocumentRequest) -> Document:
    """The config of ``req.plan.trainer`` for the plan."""
    return DOCUMENTS[req.plan.trainer](req)


__all__ = ["COMMANDS", "DOCUMENTS", "Document", "DocumentRequest", "document"]
