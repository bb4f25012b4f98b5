"""What each transformer block of a model saves for backward, measured: one forward of the real Hugging Face blocks on
fake tensors (no weights, no device), for the analytic engine where its per-block formulas do not know the block.

The analytic engine prices blocks from formulas written for the layer types it knows (``memory/activations.py``:
Llama-like attention + MLP blocks and the families it was checked on against this replay). Other blocks — Mamba and
other state-space mixers of the hybrids, parallel attention/MLP blocks with their own norms, multi-op activations,
QK-norms, custom kernels — are priced from a measurement instead: the model as the plan builds it (executor's
``build_model``: peft, quantization stand-ins, dtypes, attention implementation) runs the forward of its blocks under
the plan's autocast on fake tensors with a :class:`~oomdoctor.execute.tracking.LiveBytes` tracker, recording the
activation bytes autograd saves for backward in each block and after the last one (the final norm). The forward
stops at the output head: the head and the loss are priced by their own formulas.

Block 0, the blocks before the repetition and one repeating unit are replayed when transformers' config says how
blocks differ (``engines/kinds.layer_kinds``), every block otherwise; at micro-batch 1 and 2 (what grows with the
batch is the difference, the rest is weight-sized: gradients, peft's merged expert weights), at the plan's sequence length
rounded up to a power of two (the token share scaled back linearly), with the plan's gradient checkpointing (a
checkpointed block keeps its input, a formula, and recomputes the rest inside its measured backward). Results are cached in memory and on disk (``blocks/`` under ``$OOMDOCTOR_CACHE``, else
``$XDG_CACHE_HOME/oomdoctor``, else ``~/.cache/oomdoctor``), keyed by the model config, the plan's settings at
micro-batch 1 and the versions of torch, transformers and peft.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from oomdoctor.engines.kinds import extend, replay_depth
from oomdoctor.memory.measured import BlockBytes, BlockSaves
from oomdoctor.plan import Plan

if TYPE_CHECKING:
    from oomdoctor.model.spec import ModelSpec

#: Bump when what is measured changes: cached measurements of another version are not read.
VERSION = 17


#: Model types without a hand builder whose blocks the analytic formulas price: their MoE formulas (written for
#: transformers' grouped experts) are checked against the simulated engine (tests/test_moe.py).
FORMULA_TYPES: frozenset[str] = frozenset({"qwen3_moe"})
#: Above this many experts, plans that run transformers' eager experts keep the formulas: the replay runs the
#: per-expert Python loop of every replayed block twice (DeepSeek-V3's 256 experts: minutes per plan, where the
#: formulas price these weight-dominated experts within 1 %: tests/test_moe.py).
EAGER_REPLAY_MAX_EXPERTS = 64


def measures_blocks(spec: "ModelSpec", plan: "Plan") -> bool:
    """Whether the analytic engine prices ``spec``'s blocks from a measurement: decoder types without a hand builder
    (``model/architectures.BUILDERS``, whose blocks the formulas were written for) and not in :data:`FORMULA_TYPES`
    (transformers' eager experts included, up to :data:`EAGER_REPLAY_MAX_EXPERTS`: a balanced router sizes their
    tokens in the replay, ``engines/routing``), and every plan with bf16 adapters run by oomdoctor's executor (for
    another trainer's bf16 adapters, TRL's QLoRA, the formulas price the adapter dtype as that trainer's replay runs
    it: ``engines/trainers``) or a tiled MLP (``execute/tiled``: the formulas price whole-sequence MLPs). The measured plan runs on one device
    without offload (:func:`measured_plan`), so every topology and plan is measurable."""
    from oomdoctor.execute.build import runs_eager_experts
    from oomdoctor.model.architectures import BUILDERS

    if spec.arch_kind != "decoder":
        return False
    if spec.num_experts > EAGER_REPLAY_MAX_EXPERTS and runs_eager_experts(spec, plan):
        return False
    formulas = spec.model_type in BUILDERS or spec.model_type in FORMULA_TYPES
    bf16_adapters = plan.uses_lora and plan.adapter_dtype == "bf16" and plan.trainer == "oomdoctor"
    return not formulas or bf16_adapters or plan.tiled_mlp


def measured_plan(plan: "Plan") -> "Plan":
    """The plan the measurement runs, one per set of knobs that decide what a block saves (method, precision, attention,
    checkpointing, tiled MLP, sequence length rounded up to a power of two, LoRA targets/head/rank/dropout/dtype
    (with ``lora_on_head`` peft gets explicit names, which changes its MoE conversion in the blocks), int8 or
    4-bit, in pure bf16 whether peft's k-bit preparation upcasts the quantized base's norms and biases to fp32
    (``kbit_upcast``: the blocks' dtypes), the trainer: pure bf16 runs under autocast outside oomdoctor's own step):
    micro-batch 1 (the second measurement runs it at 2), one GPU, no offload; the optimizer, accumulation, topology,
    LoRA's scale, the 4-bit data type, double quantization and the upcast of an fp32-loaded base (a no-op) do not
    touch the blocks and take their defaults (one cache entry for them all)."""
    from oomdoctor.model.execution import upcast_changes_bytes
    from oomdoctor.plan.techniques import DEFAULTS

    keep = ("method", "precision", "attn", "gradient_checkpointing", "seq_len", "quant", "tiled_mlp", "trainer")
    if plan.uses_lora:
        keep += ("lora_r", "lora_dropout", "lora_targets", "lora_on_head", "adapter_dtype")
    if upcast_changes_bytes(plan):
        keep += ("kbit_upcast",)
    canonical = {k: v for k, v in DEFAULTS.items() if k not in keep and k in Plan.__dataclass_fields__}
    if plan.quant == "fp4":
        canonical["quant"] = "nf4"  # same shapes, same dequantized compute
    return replace(plan, seq_len=measured_seq_len(plan.seq_len), **canonical)


def measured_seq_len(seq_len: int) -> int:
    """The sequence length measured for ``seq_len``: the next power of two (at least 64), so that the searches over
    sequence lengths (``tune --seq-len max``) share a few measurements; the bytes are scaled back
    (``BlockSaves.scale``)."""
    return max(64, 1 << max(seq_len - 1, 0).bit_length())


def _key(spec: "ModelSpec", plan: "Plan") -> str:
    from importlib.metadata import version

    libs = {lib: version(lib) for lib in ("torch", "transformers", "peft")}  # their code decides what is saved
    doc = {"v": VERSION, "libs": libs, "config": spec.config, "layers": spec.num_layers, "plan": plan.settings()}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:32]


#: Environment variable naming the cache directory (default ``$XDG_CACHE_HOME/oomdoctor``, else ``~/.cache/oomdoctor``).
CACHE_ENV = "OOMDOCTOR_CACHE"


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]) / "blocks"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "oomdoctor" / "blocks"


def block_saves(spec: "ModelSpec", plan: "Plan") -> BlockSaves | None:
    """The measured :class:`BlockSaves` of ``spec`` under ``plan`` (cached); None when the executor cannot build or
    run the model as a causal LM (vision-language classes whose text side transformers builds only inside the
    multimodal model): the formulas price it then, with their note."""
    # the spec's config is not part of its equality (ModelSpec.config): two configs of one name/shape differ here
    return _cached(spec, measured_plan(plan), json.dumps(spec.config, sort_keys=True, default=str))


def _bytes_doc(b: BlockBytes) -> dict:
    return {"per_block": list(b.per_block), "final": b.final, "forward_transient": b.forward_transient,
            "backward_transient": b.backward_transient, "backward_over_gradients": b.backward_over_gradients}


def _bytes_of(doc: dict) -> BlockBytes:
    return BlockBytes(tuple(int(x) for x in doc["per_block"]), int(doc["final"]), int(doc["forward_transient"]),
                      int(doc["backward_transient"]), int(doc["backward_over_gradients"]))


@lru_cache(maxsize=512)
def _cached(spec: "ModelSpec", plan: "Plan", _config: str) -> BlockSaves | None:
    path = cache_dir() / f"{_key(spec, plan)}.json"
    try:
        doc = json.loads(path.read_text())
        return BlockSaves(_bytes_of(doc["one"]), _bytes_of(doc["two"]), bool(doc["checkpointed"]),
                          int(doc["seq_len"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        saves = BlockSaves(measure_block_bytes(spec, plan), measure_block_bytes(spec, replace(plan, micro_batch=2)),
                           plan.gradient_checkpointing, plan.seq_len)
    except Exception:  # noqa: BLE001 - a model the executor cannot build or replay: the formulas price it
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"model": spec.name, "one": _bytes_doc(saves.one), "two": _bytes_doc(saves.two),
                                   "checkpointed": saves.checkpointed, "seq_len": saves.seq_len}))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs the next run a replay
    return saves


class _StackDone(Exception):
    """Raised by the output head's forward pre-hook: the head and the loss are priced by their formulas."""


def measure_block_bytes(spec: "ModelSpec", plan: "Plan") -> BlockBytes:
    """One forward of the blocks of ``spec`` as ``plan`` builds them, on fake tensors, and the backward of the
    blocks from the final norm's output (see the module docstring).

    A block's share is the bytes of the activation storages autograd saves for backward while the block runs
    (``torch.autograd.graph.saved_tensors_hooks``), each storage counted once, for the first block that saves it:
    a block's input is the previous block's output, counted where it is saved (by a norm that keeps its input);
    what exists before the first block (rotary tables, attention masks) is the formulas' shared forward tensors;
    weights and autocast's weight casts are not activations (``parameters``/``master_weights`` for the tracker; casts of
    parameters outside autocast are).
    Transients: the peak of a block's forward above what it leaves, and the peak of its backward above the bytes
    alive when it starts — its weights' gradients included: the analytic engine's top-block moment holds the
    head's gradients only (full fine-tuning of hybrid MoE blocks + GC: -2.2 % with them excluded, 0.0 % included)."""
    from contextlib import ExitStack

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from oomdoctor.engines.replay import (TrackingHooks, _cuda_policy_mode_cls, _wrap_checkpoint_functions,
                                          cuda_autocast_answers, hf_data_paths)
    from oomdoctor.engines.routing import balanced_routing
    from oomdoctor.engines.simulate import _fake_gaps, _meta_model, _retie
    from oomdoctor.execute.bnb_standin import CONTEXT_HELD
    from oomdoctor.execute.build import find_layers, make_batch
    from oomdoctor.execute.step import TrainStep
    from oomdoctor.execute.tracking import LiveBytes
    from oomdoctor.model.execution import runs_autocast

    q, p = replay_depth(spec, plan)
    built = _meta_model(spec, plan, q + p + 1 if p else None, True)
    model = built.model
    with FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False), _fake_gaps(), \
            balanced_routing(spec, plan):
        model.to_empty(device="cpu")
        _retie(model)
        batch = make_batch(spec, plan, "cpu")
        lb = LiveBytes(round_to=512, param_copy_category="master_weights")
        lb.track_module(model)
        layers = find_layers(model)
        n = len(layers)
        per_block = [0] * (n + 1)  # the blocks, then the final norm
        fwd_t, bwd_t, bwd_net = [0] * n, [0] * n, [0] * n
        grads_at_start = [0]
        # a storage is (address, birth): an address freed during the forward is reused by a later storage
        seen: set[tuple[int, int]] = set()
        current, start, stack_out = [-1], [0], []
        backward, bwd_block = [False], [-1]  # in the measured backward; the block whose backward runs

        # what a block saves: activations, and without autocast the casts of its parameters too (peft's bf16 copies
        # of fp32 expert adapters, ``ParamWrapper``); under autocast weight casts are AMP copies, priced as such
        saved_categories = ("activations",) if runs_autocast(plan) else ("activations", "master_weights")

        def storage_id(t) -> tuple[int, int] | None:
            key = t.untyped_storage()._cdata
            rec = lb.records.get(key)
            return (key, rec.birth) if rec is not None else None

        def pack(t):
            if 0 <= current[0] and isinstance(t, torch.Tensor) and lb.category_of(t) in saved_categories:
                sid = storage_id(t)
                if sid not in seen:
                    seen.add(sid)
                    per_block[current[0]] += lb.counted_bytes(t)
            return t

        def held(t):  # an int8 matmul's input, kept on its autograd context (execute/bnb_standin.CONTEXT_HELD)
            pack(t)

        def enter(i: int):
            def hook(_m, args, kwargs):
                if backward[0]:
                    return  # a checkpointed block's recompute
                x = args[0] if args else kwargs.get("hidden_states")
                if i == 0:  # what exists before the blocks (rotary tables, masks) is priced as shared, not here
                    seen.update((key, rec.birth) for key, rec in lb.records.items())
                    seen.discard(storage_id(x) if isinstance(x, torch.Tensor) else None)
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    x.register_hook(lambda _g: bwd_leave(i))  # the block's input gradient: its backward is done
                current[0] = i
                lb.reset_peak()
            return hook

        def leave(i: int):
            def hook(_m, _a, out):
                if backward[0]:
                    return
                fwd_t[i] = lb.peak - lb.current
                current[0] = n if i == n - 1 else current[0]
                y = out[0] if isinstance(out, (tuple, list)) else out
                if isinstance(y, torch.Tensor) and y.requires_grad:
                    y.register_hook(lambda _g: bwd_enter(i))  # the block's output gradient: its backward starts
            return hook

        def head_reached(_m, args):
            stack_out.append(args[0])
            raise _StackDone

        # tensor hooks, not module backward hooks: those hold the block's output gradient until its backward ends
        # (and so turn autograd's in-place gradient accumulation into a copy), which the real step does not
        def bwd_enter(i: int):
            if bwd_block[0] >= 0:  # block i's output is block i+1's input: its gradient ends block i+1's backward
                bwd_leave(bwd_block[0])
            bwd_block[0], start[0] = i, lb.current
            grads_at_start[0] = lb.current_categories()["gradients"]
            lb.reset_peak()

        def bwd_leave(i: int):
            if bwd_block[0] == i:
                bwd_t[i] = max(bwd_t[i], lb.peak - start[0])
                made = lb.current_categories()["gradients"] - grads_at_start[0]  # this block's weight gradients
                bwd_net[i] = max(bwd_net[i], lb.peak - start[0] - made)
                bwd_block[0] = -1

        hooks = []
        for i, layer in enumerate(layers):
            hooks += [layer.register_forward_pre_hook(enter(i), with_kwargs=True),
                      layer.register_forward_hook(leave(i))]
        hooks.append(built.head_module.register_forward_pre_hook(head_reached))
        policy_cls = _cuda_policy_mode_cls()
        # the recompute in backward runs under the CUDA policy again (torch-function modes are off in backward)
        restore = _wrap_checkpoint_functions(model, lb, policy_cls, classify=False) if plan.gradient_checkpointing \
            else []
        with ExitStack() as stack:
            stack.enter_context(hf_data_paths())
            stack.enter_context(cuda_autocast_answers())
            stack.enter_context(policy_cls())
            stack.enter_context(lb)
            # under checkpointing the kept block inputs (and bnb's context-held int8 inputs) are formulas
            observers = [] if plan.gradient_checkpointing else [held]
            CONTEXT_HELD.extend(observers)
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    step = TrainStep(model, None, plan, hooks=TrackingHooks(lb, plan, head=None, target="cuda"))
                    try:
                        step.forward_backward(batch)
                    except _StackDone:
                        pass
                    else:
                        raise RuntimeError(f"{spec.name}: the forward never reached its output head")
            finally:
                for observe in observers:
                    CONTEXT_HELD.remove(observe)
            out = stack_out[0]
            backward[0] = True
            with lb.phase("backward"):
                out.backward(torch.ones_like(out))
            if bwd_block[0] >= 0:  # block 0's input needs no gradient (LoRA without checkpointing): ends here
                bwd_leave(bwd_block[0])
        for h in hooks:
            h.remove()
        for mod, fn in restore:
            mod._gradient_checkpointing_func = fn
        lb.remove_hooks()
    saves = extend(tuple(per_block[:-1]), q, p, spec.num_layers)
    return BlockBytes(saves, per_block[-1], forward_over_saves(saves, extend(tuple(fwd_t), q, p, spec.num_layers)),
                      max(bwd_t), max(bwd_net))


def forward_over_saves(saves: tuple[int, ...], transients: tuple[int, ...]) -> int:
    """The forward's peak inside a block above what every block saves: block ``i`` peaks at what blocks ``0..i``
    saved plus its own transient, so a wide block low in the stack (DeepSeek's dense first blocks) peaks with
    fewer saves alive than the last block would (0 when no block peaks above the saves at the end of the forward)."""
    total, below, over = sum(saves), 0, 0
    for saved, transient in zip(saves, transients):
        below += saved
        over = max(over, below + transient - total)
    return over
