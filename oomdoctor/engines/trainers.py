"""The simulated engine for plans a foreign trainer runs (``plan.trainer``): TRL's ``SFTTrainer`` (``trl``) and
transformers' ``Trainer`` (``hf``) replayed as they run their own step.

:func:`trainer_run` builds the trainer from the very document ``tune --emit`` writes for the plan
(``oomdoctor.execute.trainers.{trl,hf}.document``), parsed by the trainer's own parser (TRL: ``TrlParser`` over
ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig, as ``trl sft --config`` does; HF:
``HfArgumentParser(TrainingArguments)``, as the HF script does), with one piece replaced: ``from_pretrained``. The
model is built on the meta device from the spec with the kwargs the trainer would hand ``from_pretrained`` (dtype —
TRL's rule: float32 when absent —, attention implementation, ``BitsAndBytesConfig`` -> the bitsandbytes stand-ins of
``oomdoctor.execute.bnb_standin``, flagged as transformers flags a bnb-loaded model). Everything else is the
trainer's own code: ``SFTTrainer.__init__`` (PEFT wrapping, ``enable_input_require_grads``, the bf16 cast of a
quantized model's adapters, ``add_fused_lm_head``, its collator, its activation-offload context), the HF script's
``prepare_model`` (k-bit preparation, LoRA, adapter dtype), ``Trainer.train`` (gradient checkpointing enabled with
the document's kwargs), ``_prepare_for_training`` (``create_optimizer``, accelerate's ``prepare``: autocast and the
fp32 conversion of the outputs), and ``_run_epoch``: ``training_step`` / ``compute_loss`` (TRL: the
``fused_lm_head=True`` forward, its entropy / top-1 metrics and their ``gather_for_metrics``), backward,
``_clip_grad_norm``, the optimizer step, the scheduler step, ``zero_grad``. Two optimizer steps (the optimizer
state appears in the first), each with ``min(grad_accum, 2)`` micro-batches (``replay.replayed_micro_batches``),
under ``FakeTensorMode`` on ``cpu`` with ``LiveBytes`` and the CUDA policy of ``oomdoctor.engines.replay``;
extrapolated from 2 and 3 blocks by ``oomdoctor.engines.simulate`` like the executor's replay.

Not replayed: the DataLoader (a list of batches the trainer's own collator made from ``micro_batch`` rows of
``seq_len`` tokens, every label valid: a full, unpadded batch), logging, checkpoint saving, evaluation (the documents
set none), the tokenizer (the bundled tiny one: the ids only fill the batch), Liger's Triton kernels
(``hf`` + ``loss: chunked``: ``use_liger_kernel``), axolotl (not installable next to this stack) and ``accelerate``
launch scripts (the user's code): those plans get the analytic price with a note (:func:`not_replayed`), as do
sharded strategies (the Trainer needs a real process group) and fp16 (accelerate runs no fp16 autocast on a CPU
device).

Where the trainer's CUDA and CPU code paths differ, the replay follows CUDA: ``engines/trainer_cuda``.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

from oomdoctor.engines.trainer_cuda import (
    OffloadOnHost,
    bnb_optimizers,
    cuda_kernel_defaults,
    full_batch_cls,
    trl_cuda_paths,
)
from oomdoctor.errors import BadInput
from oomdoctor.memory.runtime import ALLOC_BLOCK

if TYPE_CHECKING:  # pragma: no cover
    from oomdoctor.engines.replay import RunStats
    from oomdoctor.model.spec import ModelSpec
    from oomdoctor.plan import Plan

#: Trainers whose own step the simulated engine replays.
REPLAYED: tuple[str, ...] = ("trl", "hf")
#: Token id the fake batch is made of (any id the bundled tokenizer does not pad with: every label stays valid).
FILL_TOKEN = 5


def not_replayed(plan: "Plan") -> str | None:
    """Why the simulated engine cannot replay ``plan.trainer``'s own step for ``plan`` (None: it can)."""
    if plan.trainer == "axolotl":
        return "axolotl's step is not replayed (axolotl pins older transformers/peft/trl: not installable here)"
    if plan.trainer == "accelerate":
        return "an accelerate launch config runs the user's train.py, which cannot be replayed"
    if plan.trainer not in REPLAYED:
        return "oomdoctor's own step is the executor's (oomdoctor.engines.simulate.simulate_plan)"
    if plan.trainer == "hf" and plan.loss == "chunked":
        return "Liger's fused linear cross-entropy (use_liger_kernel) runs Triton kernels, which need a CUDA GPU"
    if plan.strategy not in ("single", "ddp"):
        return f"a sharded {plan.trainer} trainer ({plan.strategy}) needs a real process group"
    if plan.precision == "fp16-mixed":
        return "accelerate runs no fp16 autocast on a CPU device"
    return None


# ============================================================================ the trainer, built from its document


def document_data(spec: "ModelSpec", plan: "Plan") -> dict[str, Any]:
    """The document ``tune --emit <plan.trainer>`` writes for the plan (its data)."""
    from oomdoctor.execute.trainers import document
    from oomdoctor.execute.trainers.common import DocumentRequest

    return document(DocumentRequest(plan, spec, model=spec.name)).data


def _overrides(plan: "Plan", output_dir: str) -> dict[str, Any]:
    """Keys a replay adds to the document, as a user adds ``--use_cpu`` on a CPU machine: the CPU device, a scratch
    output directory, nothing saved or logged, ``min(grad_accum, 2)`` micro-batches per step."""
    from oomdoctor.engines.replay import replayed_micro_batches

    return {
        "use_cpu": True,
        "output_dir": output_dir,
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        "report_to": "none",
        "gradient_accumulation_steps": replayed_micro_batches(plan),
    }


def _tokenizer():
    from transformers import AutoTokenizer

    from oomdoctor.resources import tiny_dir

    return AutoTokenizer.from_pretrained(str(tiny_dir() / "tokenizer"))


def _rows(plan: "Plan"):
    """``micro_batch`` pre-tokenized rows of ``seq_len`` tokens (the trainers prepare them as they prepare any
    tokenized dataset: TRL builds the labels and truncates, the HF script's collator pads and masks)."""
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": [[FILL_TOKEN] * plan.seq_len] * plan.micro_batch})


def model_loader(
    spec: "ModelSpec", plan: "Plan", num_layers: int | None, device: str, seed: int | None, notes: list[str]
) -> Callable[[str, dict[str, Any]], Any]:
    """``load(model_id, from_pretrained_kwargs)`` for the trainers' builders: the spec's model (``num_layers``
    blocks) on ``device`` (``meta``, or ``cpu`` with random weights) as ``from_pretrained`` would load it with those
    kwargs — dtype (``"auto"``: the config's), attention implementation (``flash_attention_2`` built as SDPA), the
    ``BitsAndBytesConfig`` as bitsandbytes stand-ins (every linear but the head; flagged, with the quantizer, as a
    bnb-loaded model: ``is_loaded_in_4bit``/``8bit``, ``is_quantized``, ``quantization_method``, ``hf_quantizer``)."""

    def load(_model_id: str, kwargs: dict[str, Any]):
        import torch

        from oomdoctor.execute.bnb_standin import quantize_standin
        from oomdoctor.execute.build import experts_kwargs, hf_config
        from oomdoctor.model.inventory import auto_model_class

        config = hf_config(spec, plan, num_layers)
        dtype = kwargs.get("dtype")
        if dtype in (None, "auto"):
            name = spec.config.get("dtype") or spec.config.get("torch_dtype") or "float32"
            dtype = getattr(torch, name)
        attn = kwargs.get("attn_implementation") or "sdpa"
        if attn == "flash_attention_2":
            attn = "sdpa"
            notes.append("flash_attention_2 replayed with SDPA's flash kernel (same O(seq) saved state)")
        if seed is not None:
            torch.manual_seed(seed)
        prev = torch.get_default_dtype()
        try:
            with torch.device(device):
                try:
                    model = auto_model_class(config).from_config(
                        config, dtype=dtype, attn_implementation=attn, **experts_kwargs(plan, config)
                    )
                except ValueError as exc:
                    if attn == "eager" or "attention implementation" not in str(exc):
                        raise
                    model = auto_model_class(config).from_config(
                        config, dtype=dtype, attn_implementation="eager", **experts_kwargs(plan, config)
                    )
        finally:
            torch.set_default_dtype(prev)
        q = kwargs.get("quantization_config")
        if q is not None:
            quant = "int8" if q.load_in_8bit else q.bnb_4bit_quant_type
            quantize_standin(
                model,
                quant=quant,
                compute_dtype=q.bnb_4bit_compute_dtype,
                double_quant=q.bnb_4bit_use_double_quant,
                device=device,
            )
            _flag_bnb_loaded(model, q)
        return model

    return load


def _flag_bnb_loaded(model, quantization_config) -> None:
    """What ``from_pretrained`` leaves on a bitsandbytes-loaded model (transformers ``quantizers/base.py``
    ``preprocess_model`` / ``postprocess_model``), which peft, the Trainer and accelerate read."""
    from transformers.quantizers import AutoHfQuantizer

    model.hf_quantizer = AutoHfQuantizer.from_config(quantization_config, pre_quantized=False)
    model.quantization_method = quantization_config.quant_method
    model.config.quantization_config = quantization_config


def build(
    spec: "ModelSpec",
    plan: "Plan",
    num_layers: int | None,
    *,
    device: str,
    output_dir: str,
    seed: int | None = None,
    notes: list[str] | None = None,
):
    """``plan.trainer``'s trainer built from its document, with the spec's model (``num_layers`` blocks) on
    ``device`` in place of ``from_pretrained``."""
    from oomdoctor.execute.trainers import hf, trl

    notes = [] if notes is None else notes
    data = document_data(spec, plan)
    load = model_loader(spec, plan, num_layers, device, seed, notes)
    kw = dict(load=load, tokenizer=_tokenizer(), train_dataset=_rows(plan), **_overrides(plan, output_dir))
    builder = trl.build_trainer if plan.trainer == "trl" else hf.build_trainer
    from datasets.utils.logging import disable_progress_bar, enable_progress_bar, is_progress_bar_enabled

    shown = is_progress_bar_enabled()
    disable_progress_bar()  # TRL tokenizes the replay's few rows: no progress bars for them
    try:
        with _trainer_construction():
            return builder(data, **kw)
    finally:
        if shown:
            enable_progress_bar()


@contextmanager
def _trainer_construction():
    """While a trainer is built: a meta model stays on meta (materialized once built, :func:`trainer_run`), and TRL's
    activation offloading finds the CPU as its accelerator (its device code then runs on the CPU,
    :class:`OffloadOnHost`)."""
    import torch
    from transformers import Trainer

    orig_move = Trainer._move_model_to_device
    orig_accel = torch.accelerator.current_accelerator

    def move(self, model, dev):
        if any(p.device.type == "meta" for p in model.parameters()):
            return None
        return orig_move(self, model, dev)

    Trainer._move_model_to_device = move
    torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cpu")
    try:
        yield
    finally:
        Trainer._move_model_to_device = orig_move
        torch.accelerator.current_accelerator = orig_accel


# ============================================================================ the engine


#: Who runs the step, for notes.
TRAINER_NAMES = {"trl": "TRL's SFTTrainer", "hf": "transformers' Trainer"}


def simulate_trainer(spec: "ModelSpec", plan: "Plan", **kwargs):
    """``oomdoctor.engines.simulate.simulate_plan`` with the trainer's own step (:func:`trainer_run`) replayed:
    2 and 3 blocks, extrapolated (``kwargs`` as ``simulate_plan``'s)."""
    import dataclasses
    import functools

    from oomdoctor.engines.simulate import simulate_plan
    from oomdoctor.plan.targets import version_notes

    notes: list[str] = []
    res = simulate_plan(spec, plan, run=functools.partial(trainer_run, notes=notes), **kwargs)
    extra = (f"replayed {TRAINER_NAMES[plan.trainer]}'s own step, built from the emitted {plan.trainer} file",)
    res.breakdown = dataclasses.replace(
        res.breakdown, notes=res.breakdown.notes + extra + tuple(dict.fromkeys(notes)) + tuple(version_notes(plan))
    )
    return res


def estimate_trainer(spec: "ModelSpec", plan: "Plan", device: str = "cuda"):
    """``estimate(spec, plan, "simulate")`` for a plan another trainer runs: its own step replayed
    (:func:`simulate_trainer`), or, where it cannot be (:func:`not_replayed`), the analytic price with a note."""
    from oomdoctor.engines.simulate import analytic_with_note

    why = not_replayed(plan)
    if why:
        return analytic_with_note(spec, plan, why, device)
    return simulate_trainer(spec, plan, device=device).breakdown


# ============================================================================ the replay


def trainer_run(
    spec: "ModelSpec",
    plan: "Plan",
    num_layers: int | None = None,
    *,
    real: bool = False,
    steps: int = 2,
    round_to: int = ALLOC_BLOCK,
    timeline: bool = False,
    seed: int = 0,
    notes: list[str] | None = None,
) -> "RunStats":
    """``steps`` optimizer steps of ``plan.trainer``'s own training loop on the spec's model (``num_layers``
    blocks), counted by ``LiveBytes`` as a CUDA run allocates (module docstring). ``real=True`` runs the same on real
    random CPU tensors (the reference the fake replay is checked against)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from oomdoctor.engines.fake import fake_gaps, retie
    from oomdoctor.engines.routing import balanced_routing
    from oomdoctor.execute.tracking import LiveBytes

    why = not_replayed(plan)
    if why:
        raise BadInput(f"the simulated engine cannot replay this plan's trainer: {why}", "use --engine analytic")
    with tempfile.TemporaryDirectory(prefix="oomdoctor-replay-") as out, ExitStack() as stack:
        # built on the meta device outside the fake mode (peft moves its new adapters next to the base weights,
        # which fake parameters refuse), then materialized inside it
        trainer = build(
            spec,
            plan,
            num_layers,
            device="cpu" if real else "meta",
            output_dir=out,
            seed=seed if real else None,
            notes=notes,
        )
        model = trainer.model
        fake = None
        if not real:
            fake = FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)
            stack.enter_context(fake)
            stack.enter_context(fake_gaps())
            stack.enter_context(balanced_routing(spec, plan))
            stack.enter_context(full_batch_cls()())
            model.to_empty(device="cpu")
            retie(model)
        trainer.accelerator.device_placement = False  # the model is on its device already (module docstring)
        batch = _batch(trainer, plan, fake)
        lb = LiveBytes(round_to=round_to, record_timeline=timeline, param_copy_category="master_weights")
        stats = _TrainerLoop(trainer, plan, lb, batch, steps=steps).run()
    from oomdoctor.execute.build import find_layers

    stats.layers = len(find_layers(model)) or num_layers or spec.num_layers
    return stats


def _batch(trainer, plan: "Plan", fake) -> dict:
    """A batch as the trainer's collator makes it from ``micro_batch`` prepared rows (as fake tensors when
    replaying on fake tensors)."""
    ds = trainer.train_dataset
    batch = trainer.data_collator([ds[i] for i in range(plan.micro_batch)])
    if fake is not None:
        batch = {k: fake.from_tensor(v) if hasattr(v, "dtype") else v for k, v in batch.items()}
    return batch


class _TrainerLoop:
    """The trainer's ``train()`` with ``_inner_training_loop`` replaced by its own pieces minus the DataLoader
    (module docstring), instrumented: phases from ``compute_loss`` (forward), ``accelerator.backward`` (backward)
    and the optimizer step (from the gradient clipping to the end of the step, through a ``TrainerCallback``)."""

    def __init__(self, trainer, plan: "Plan", lb, batch: dict, *, steps: int):
        from oomdoctor.engines.replay import TrackingHooks, replayed_micro_batches

        self.trainer, self.plan, self.lb, self.steps = trainer, plan, lb, steps
        self.n_micro = replayed_micro_batches(plan)
        self.batches = [dict(batch) for _ in range(steps * self.n_micro)]
        self.model = trainer.model
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        self.trl = plan.trainer == "trl"
        head = None if self.trl else base.get_output_embeddings()
        self.backbone = getattr(base, base.base_model_prefix, None) if self.trl else None
        self.hooks = TrackingHooks(lb, plan, head=head or self.backbone, target="cuda")
        self.head = head
        self.step_peaks: list[int] = []
        self._opt_phase = None

    # ------------------------------------------------------------------ instrumentation seams
    def _wrap(self) -> None:
        tr, hooks = self.trainer, self.hooks
        compute_loss, backward = tr.compute_loss, tr.accelerator.backward
        clip, grad_norm = tr._clip_grad_norm, tr._get_grad_norm

        def compute_loss_(*a, **k):
            with hooks.phase("forward"):
                loss = compute_loss(*a, **k)
                hooks.forward_done()
            return loss

        def backward_(loss, **k):
            with hooks.phase("backward"):
                hooks.backward_start()
                backward(loss, **k)
                hooks.backward_done()

        def clip_(*a, **k):
            self._open_step()
            return clip(*a, **k)

        def grad_norm_(*a, **k):
            self._open_step()
            return grad_norm(*a, **k)

        tr.compute_loss, tr.accelerator.backward = compute_loss_, backward_
        tr._clip_grad_norm, tr._get_grad_norm = clip_, grad_norm_
        tr.add_callback(_step_events_cls()(self))
        tr._inner_training_loop = self._inner_loop

    def _open_step(self) -> None:
        if self._opt_phase is None:
            self._opt_phase = self.hooks.phase("optimizer-step")
            self._opt_phase.__enter__()

    def _close_step(self) -> None:
        if self._opt_phase is not None:
            self._opt_phase.__exit__(None, None, None)
            self._opt_phase = None
        self.step_peaks.append(self.lb.peak)

    # ------------------------------------------------------------------ the loop
    def _inner_loop(
        self, batch_size=None, args=None, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None
    ):
        """``Trainer._inner_training_loop`` (transformers 5.24) without the DataLoader and the final logging."""
        import torch

        tr = self.trainer
        tr.accelerator.free_memory()
        tr._init_training_state(self.steps, self.steps, 1, None, trial)
        model, _ = tr._prepare_for_training(self.steps, None, None)
        tr._initial_num_input_tokens_seen = tr.state.num_input_tokens_seen
        tr._initial_global_step = tr.state.global_step
        tr._tr_loss = torch.tensor(0.0, device=args.device)
        tr._total_loss_scalar = 0.0
        tr._globalstep_last_logged = tr.state.global_step
        if self.plan.gradient_checkpointing:
            self.instruments.wrap_checkpoints()
        model.zero_grad()
        tr.control = tr.callback_handler.on_train_begin(args, tr.state, tr.control)
        tr._run_epoch(
            model=model,
            epoch=0,
            train_dataloader=self.batches,
            steps_in_epoch=len(self.batches),
            num_update_steps_per_epoch=self.steps,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
            start_time=time.time(),
            resume_from_checkpoint=None,
            epochs_trained=0,
            steps_trained_in_current_epoch=0,
        )
        return None

    def run(self) -> "RunStats":
        from oomdoctor.engines.replay import Instruments

        self.instruments = Instruments(
            self.model, self.plan, self.lb, target="cuda", head=self.head, backbone=self.backbone
        )
        self._wrap()
        with ExitStack() as stack:
            stack.enter_context(warnings.catch_warnings())
            # transformers logs the embeddings it keeps in 32-bit by their data pointers (fake tensors: 0)
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            stack.enter_context(cuda_kernel_defaults())
            stack.enter_context(bnb_optimizers(self.lb))
            if self.trl:
                stack.enter_context(trl_cuda_paths(self.lb))
                if self.plan.offload_activations:
                    stack.enter_context(
                        OffloadOnHost(self.trainer.maybe_activation_offload_context, self.model, self.lb)
                    )
            stack.enter_context(self.instruments)
            self.trainer.train()
        return self.instruments.stats(self.step_peaks)


def _step_events_cls():
    from transformers import TrainerCallback

    class StepEvents(TrainerCallback):
        """Opens/closes the optimizer-step phase and tells the tracker when the optimizer state exists."""

        def __init__(self, loop: _TrainerLoop):
            self.loop = loop

        def on_step_begin(self, args, state, control, **kwargs):
            self.loop.lb.reset_peak()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.loop._open_step()

        def on_optimizer_step(self, args, state, control, **kwargs):
            opt = self.loop.trainer.optimizer
            self.loop.hooks.optimizer_stepped(getattr(opt, "optimizer", opt), state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            self.loop._close_step()

    return StepEvents


__all__ = [
    "REPLAYED",
    "build",
    "document_data",
    "estimate_trainer",
    "model_loader",
    "not_replayed",
    "simulate_trainer",
    "trainer_run",
]
