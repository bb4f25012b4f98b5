"""Writing the tuned plan: the ``oomdoctor train`` YAML (:func:`write_config`) or, with ``tune --emit TRAINER``, the
config of the user's own trainer (TRL, HF Trainer, axolotl, accelerate; :func:`write_emitted`). Every file starts with
the same header (:func:`header_lines`: who wrote it, the tune result's summary, the command that runs it) and is
written atomically under a free default name (``oomdoctor.files.free_path``) unless a path is given.

The ``oomdoctor train`` YAML comes from the train renderer (every key commented). For a foreign trainer the tuned plan
already is the plan as that trainer runs it (``plan.trainer``, ``oomdoctor.plan.targets``: tune searched only what the
trainer can run and priced it as the trainer's step runs). The document comes from ``oomdoctor.execute.trainers`` —
the same builder the simulated engine replays the trl and hf trainers from. Its header also lists every knob of the
plan with the key that carries it in the file (or how the trainer runs it), the library versions the price assumes,
and what to fill in.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomdoctor.errors import BadInput
from oomdoctor.execute.trainers import FOREIGN, DocumentRequest, command, document
from oomdoctor.files import free_path, holds_weights, write_text_atomic
from oomdoctor.memory.runtime import ALLOC_CONF_VAR
from oomdoctor.plan import Plan
from oomdoctor.plan.targets import RULES, applies, priced_versions, refusals, version_notes
from oomdoctor.plan.techniques import DEFAULTS, TECHNIQUES, TRAINERS
from oomdoctor.resources import TINY_DATASET, TINY_TOKENIZER, bundled_path, is_bundled
from oomdoctor.train.config import TrainConfig
from oomdoctor.train.config.render import comment_lines
from oomdoctor.tune.result import DEFAULT_OUTPUT, TuneResult

#: The bundled sample dataset the emitted config points at unless ``--dataset`` is given (a ``bundled:`` name:
#: resolves after a wheel install, from any directory).
SAMPLE_DATASET = TINY_DATASET
#: Tokenizer used with ``init: random`` configs (config-only models) unless ``--tokenizer`` is given.
SAMPLE_TOKENIZER = TINY_TOKENIZER

#: ``--emit`` values: ``oomdoctor`` (the ``oomdoctor train`` YAML, the default) and the foreign trainers.
EMIT_TARGETS: tuple[str, ...] = TRAINERS
#: The tool each foreign trainer is, in prose.
TOOL_NAMES: dict[str, str] = {
    "trl": "TRL",
    "hf": "transformers' Trainer",
    "axolotl": "axolotl",
    "accelerate": "an accelerate launch config",
}
#: The file suffix each foreign trainer's document has.
SUFFIXES: dict[str, str] = {"trl": ".yaml", "hf": ".json", "axolotl": ".yaml", "accelerate": ".yaml"}


@dataclass(frozen=True)
class Emitted:
    """One foreign config."""

    target: str
    """``trl``, ``hf``, ``axolotl`` or ``accelerate``."""
    text: str
    """The file's content."""
    knobs: tuple[str, ...]
    """Every knob of the plan with the key that carries it in the file (or how the trainer runs it)."""
    notes: tuple[str, ...] = ()
    """What to fill in, how to launch, and versions that differ from the priced ones."""

    def command(self, path: str | os.PathLike) -> str:
        """How to run the written file."""
        return run_command(self.target, path)


def header_lines(written_by: str, summary: Sequence[str], run: str, *more: str, tool: str | None = None) -> list[str]:
    """The first lines of every file ``tune`` writes: ``Written by `WRITTEN_BY` for TOOL.``, the tune result's
    ``summary`` (:meth:`TuneResult.summary_lines`), ``more`` (what the file is priced as), then ``Run: RUN`` (the
    command that runs it, the file called THIS)."""
    return [f"Written by `{written_by}`" + (f" for {tool}" if tool else "") + ".", *summary, *more, f"Run: {run}"]


def run_command(target: str, path: str | os.PathLike) -> str:
    """The command that runs a ``target`` config written to ``path``."""
    if target not in FOREIGN:
        raise BadInput(f"--emit {target!r}: use one of {', '.join(EMIT_TARGETS)}")
    return command(target, shlex.quote(str(path)))


def _lookup(data: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    """The value at a dotted key of nested mappings (found, value)."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _show(v: Any) -> str:
    if isinstance(v, tuple):
        return ",".join(v)
    if isinstance(v, dict):  # its own keys are listed on the lines of the knobs they carry
        return "{...}" if v else "{}"
    if isinstance(v, (list, bool)) or v is None:
        return json.dumps(v)
    return str(v)


def knob_lines(plan: Plan, data: dict[str, Any]) -> list[str]:
    """One line per knob that means something for ``plan``: ``name value -> key: value, ...`` for the keys of its
    rule that ``data`` holds, else ``name value -> how the trainer runs it``."""
    rules = RULES[plan.trainer]
    lines = []
    for t in TECHNIQUES:
        if not applies(t.name, plan):
            continue
        rule = rules[t.name]
        value = getattr(plan, t.name)
        found = [(k, v) for k in rule.keys for ok, v in [_lookup(data, k)] if ok]
        said = ", ".join(f"{k}: {_show(v)}" for k, v in found)
        if not said:
            said = "the trainer's default (no key)" if value == DEFAULTS[t.name] or not rule.how else rule.how
        lines.append(f"{t.name} {_show(value)} -> {said}")
    return lines


def emit(req: DocumentRequest, header: tuple[str, ...] = ()) -> Emitted:
    """The document of ``req.plan.trainer`` for the plan, with ``header`` lines first (the tune result). BadInput for
    ``oomdoctor`` (:func:`write_config` writes that YAML) and for a plan the trainer cannot run."""
    plan = req.plan
    if plan.trainer not in FOREIGN:
        raise BadInput(f"--emit {plan.trainer!r}: the foreign trainers are {', '.join(FOREIGN)}")
    refused = refusals(plan, req.spec.model_type)
    if refused:
        raise BadInput(
            f"{TOOL_NAMES[plan.trainer]} cannot run {plan.label()}: " + "; ".join(map(str, refused)),
            f"tune with --emit {plan.trainer}: it searches only what that trainer runs",
        )
    doc = document(req)
    knobs = tuple(knob_lines(plan, doc.data))
    notes = tuple(doc.notes) + tuple(version_notes(plan))
    versions = ", ".join(f"{d} {v}" for d, v in priced_versions(plan))
    lines = header_lines(
        f"oomdoctor tune --emit {plan.trainer}",
        header,
        run_command(plan.trainer, "THIS" + SUFFIXES[plan.trainer]),
        f"Priced as {versions} run{'s' if len(priced_versions(plan)) == 1 else ''} this step.",
        tool=TOOL_NAMES[plan.trainer],
    )
    if plan.trainer == "hf":
        data = dict(doc.data)
        data["oomdoctor"] = {"about": lines, "knobs": list(knobs), "notes": list(notes)}
        return Emitted("hf", json.dumps(data, indent=2) + "\n", knobs, notes)
    lines.append("Every knob of the plan and the key that carries it:")
    lines += [f"  {k}" for k in knobs]
    if notes:
        lines.append("To fill in, and notes:")
        lines += [f"  - {n}" for n in notes]
    import yaml

    text = "".join(f"{ln}\n" for ln in comment_lines(lines))
    text += yaml.safe_dump(doc.data, sort_keys=False, default_flow_style=False, width=120)
    return Emitted(plan.trainer, text, knobs, notes)


# ---------------------------------------------------------------------------------------------- oomdoctor train


def default_output_path(directory: str | os.PathLike = ".") -> Path:
    """``./oomdoctor-plan.yaml``, or the first free ``oomdoctor-plan-N.yaml`` when it exists (never overwrite)."""
    return free_path(Path(directory) / DEFAULT_OUTPUT)


def render_config(
    result: TuneResult, model_ref: str, *, dataset: str | None = None, tokenizer: str | None = None, **extra: Any
) -> str:
    """The ``oomdoctor train`` YAML for the tuned plan, through the train renderer (every key commented).

    A hub id or a weights directory becomes ``model.path`` (pretrained); a bare config (``config.json`` or a
    directory without weights; ``bundled:tiny/model/config.json`` stays a ``bundled:`` name) becomes ``init: random``
    with a tokenizer. ``gpu_mem`` is the tuned capacity so that ``oomdoctor train --dry-run`` checks the same
    budget."""
    from oomdoctor.train.config import config_from_plan, render_yaml

    # a bundled name stays as written (oomdoctor train resolves it wherever the package is installed)
    ref, weights = model_location(model_ref, keep_bundled=True)
    config_only = not weights
    kwargs: dict[str, Any] = dict(extra)
    if config_only:
        kwargs.update(init="random", tokenizer=tokenizer or SAMPLE_TOKENIZER)
    else:
        if tokenizer:
            kwargs["tokenizer"] = tokenizer
    kwargs.setdefault("dataset", dataset or SAMPLE_DATASET)
    kwargs.setdefault("gpu_mem", result.capacity_bytes)
    if result.device == "cpu":  # priced for the CPU: the run goes there, gpu_mem caps its live tensor bytes
        kwargs.setdefault("device", "cpu")
    cfg = config_from_plan(ref, result.plan, **kwargs)
    lines = header_lines("oomdoctor tune", result.summary_lines(), result.run_command("THIS.yaml"))
    if not dataset and "dataset" not in extra:
        lines.append(f"dataset.path is the bundled sample ({SAMPLE_DATASET}): point it at your data.")
    if config_only and not tokenizer:
        lines.append(
            f"model: built from the config with random weights and the bundled sample tokenizer "
            f"({SAMPLE_TOKENIZER}) - a smoke run; point model.path at real weights to fine-tune."
        )
    return render_yaml(cfg, header="\n".join(lines))


def write_config(
    result: TuneResult,
    model_ref: str,
    path: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
    **render_kw: Any,
) -> Path:
    """Write the YAML atomically (temp file + rename in the same directory) and set ``result.config_path``.

    ``path=None``: :func:`default_output_path` (a fresh name, never overwriting). An explicit path that exists is
    refused (BadInput) unless ``overwrite``."""
    out = write_text_atomic(
        path if path is not None else default_output_path(),
        render_config(result, model_ref, **render_kw),
        overwrite=overwrite,
    )
    result.config_path = str(out)
    return out


# ---------------------------------------------------------------------------------------------- from a tune result


def schedule() -> dict[str, Any]:
    """The ``oomdoctor train`` defaults of the keys every HF-based trainer shares (no memory effect)."""
    d = TrainConfig()
    out: dict[str, Any] = {"learning_rate": d.learning_rate}
    if d.max_steps is not None:
        out["max_steps"] = d.max_steps
    else:
        out["num_train_epochs"] = d.num_train_epochs
    out.update(
        lr_scheduler_type=d.lr_scheduler_type,
        warmup_steps=d.warmup_steps,
        weight_decay=d.weight_decay,
        max_grad_norm=d.max_grad_norm,
        seed=d.seed,
        logging_steps=d.logging_steps,
        save_steps=d.save_steps,
        save_total_limit=d.save_total_limit,
    )
    return out


def model_location(model_ref: str, *, keep_bundled: bool) -> tuple[str, bool]:
    """(what a written config names the model by, whether weights are there) for ``tune``'s MODEL: a hub id as it
    is (weights on the hub); a local file or directory as an absolute path, a ``bundled:`` name too unless
    ``keep_bundled`` (``oomdoctor train`` resolves those, another trainer does not); a config file, for a trainer
    that loads a directory (not ``keep_bundled``), as the directory holding it."""
    bundled = is_bundled(model_ref)
    p = bundled_path(model_ref) if bundled else Path(model_ref).expanduser()
    if not p.exists():
        return model_ref, True
    weights = holds_weights(p)
    if bundled and keep_bundled:
        return model_ref, weights
    p = p.resolve()
    return str(p.parent if p.is_file() and not keep_bundled else p), weights


def request_from_result(result: TuneResult, model_ref: str, dataset: str | None = None) -> DocumentRequest:
    """A :class:`DocumentRequest` for a tune result: a local or bundled model resolved to an absolute directory, a
    bundled dataset to its file (another trainer knows no ``bundled:`` names)."""
    ref, weights = model_location(model_ref, keep_bundled=False)
    return DocumentRequest(
        plan=result.plan,
        spec=result.spec,
        model=ref,
        dataset=str(bundled_path(dataset)) if dataset and is_bundled(dataset) else dataset,
        output_dir=TrainConfig().output_dir,
        schedule=schedule(),
        model_has_weights=weights,
        gpus_per_node=result.topology.gpus_per_node,
    )


def default_emit_path(target: str, directory: str | os.PathLike = ".") -> Path:
    """``./oomdoctor-TARGET.yaml`` (``.json`` for hf), or the first free ``-2``, ``-3``... sibling."""
    return free_path(Path(directory) / f"oomdoctor-{target}{SUFFIXES[target]}")


@dataclass(frozen=True)
class EmitWritten:
    """A foreign config on disk."""

    emitted: Emitted
    path: Path
    command: str
    """How to run it (with the allocator setting tune recommends)."""


def write_emitted(
    result: TuneResult,
    model_ref: str,
    path: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
    dataset: str | None = None,
) -> EmitWritten:
    """Write the document of the tuned plan's trainer (``path=None``: :func:`default_emit_path`)."""
    target = result.plan.trainer
    em = emit(request_from_result(result, model_ref, dataset), result.summary_lines())
    out = write_text_atomic(path if path is not None else default_emit_path(target), em.text, overwrite=overwrite)
    return EmitWritten(em, out, f"{ALLOC_CONF_VAR}={result.alloc_conf} " + em.command(out))


__all__ = [
    "EMIT_TARGETS",
    "SAMPLE_DATASET",
    "SAMPLE_TOKENIZER",
    "EmitWritten",
    "Emitted",
    "SUFFIXES",
    "TOOL_NAMES",
    "default_emit_path",
    "default_output_path",
    "emit",
    "header_lines",
    "knob_lines",
    "render_config",
    "request_from_result",
    "run_command",
    "schedule",
    "write_config",
    "write_emitted",
]
