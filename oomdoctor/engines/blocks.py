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

Block 0 and one repeating unit of blocks are replayed when the config says how blocks repeat (``block_period``),
every block otherwise; at micro-batch 1 (what a block saves is linear in the batch), at the plan's sequence length,
with the plan's gradient checkpointing (a checkpointed block keeps its input, a formula, and recomputes the rest
inside its measured backward). Results are cached in memory and
on disk (``blocks/`` under ``$OOMDOCTOR_CACHE``, else ``$XDG_CACHE_HOME/oomdoctor``, else ``~/.cache/oomdoctor``),
keyed by the model config, the plan's settings at micro-batch 1 and the versions of torch, transformers and peft.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oomdoctor.model.spec import ModelSpec
    from oomdoctor.plan import Plan

from oomdoctor.memory.activations import BlockSaves

#: Bump when what is measured changes: cached measurements of another version are not read.
VERSION = 7


#: Model types without a hand builder whose blocks the analytic formulas price: their MoE formulas are checked
#: against the simulated engine under every precision (tests/test_moe.py), where the replay runs bf16 experts only.
FORMULA_TYPES: frozenset[str] = frozenset({"qwen3_moe"})


def measures_blocks(spec: "ModelSpec", plan: "Plan") -> bool:
    """Whether the analytic engine prices ``spec``'s blocks from a measurement: decoder types without a hand builder
    (``model/architectures.BUILDERS``, whose blocks the formulas were written for) and not in :data:`FORMULA_TYPES`,
    when the replay can run the plan (else the formulas, with their note)."""
    from oomdoctor.engines.simulate import not_simulated
    from oomdoctor.memory.context import experts_implementation
    from oomdoctor.model.architectures import BUILDERS

    if spec.arch_kind != "decoder" or spec.model_type in BUILDERS or spec.model_type in FORMULA_TYPES:
        return False
    if spec.num_experts and experts_implementation(plan) == "eager":
        return False
    return not_simulated(measured_plan(plan)) is None


def measured_plan(plan: "Plan") -> "Plan":
    """The plan the measurement runs: the knobs that decide what a block saves (checkpointing included), at
    micro-batch 1, one GPU, no offload; optimizer and accumulation do not touch the blocks."""
    return plan.with_(micro_batch=1, grad_accum=1, offload_activations=False,
                      optimizer_in_backward=False, world_size=1, strategy="single", optimizer="adamw",
                      offload_optimizer=False, offload_params=False, loss="standard")


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


def block_saves(spec: "ModelSpec", plan: "Plan") -> BlockSaves:
    """The measured :class:`BlockSaves` of ``spec`` under ``plan`` (cached)."""
    return _cached(spec, measured_plan(plan))


#: Model types whose blocks are all built alike with no per-block list in their config.
HOMOGENEOUS_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba", "falcon_h1"})


def block_period(spec: "ModelSpec") -> int | None:
    """Blocks per repeating unit when the config says how blocks differ: the period of its per-block lists
    (``layer_types``, ``layers_block_type``), Jamba's attention/expert periods, 1 for
    :data:`HOMOGENEOUS_TYPES`; None when it cannot be read from the config (the replay then runs every block)."""
    from math import lcm

    from oomdoctor.execute.build import LAYER_LIST_KEYS

    cfg, L = spec.config, spec.num_layers
    periods = []
    for k in LAYER_LIST_KEYS:
        v = cfg.get(k)
        if isinstance(v, list) and len(v) == L and v:
            periods.append(next(p for p in range(1, L + 1) if L % p == 0 and all(v[i] == v[i % p] for i in range(L))))
    if isinstance(cfg.get("attn_layer_period"), int) and isinstance(cfg.get("expert_layer_period"), int):
        periods.append(lcm(cfg["attn_layer_period"], cfg["expert_layer_period"]))
    if not periods:
        return 1 if spec.model_type in HOMOGENEOUS_TYPES else None
    return lcm(*periods)


def replay_depth(spec: "ModelSpec") -> int:
    """Blocks the measurement replays: one repeating unit after block 0 (which differs under LoRA: its input needs
    no gradient) when :func:`block_period` knows it, else every block."""
    p, L = block_period(spec), spec.num_layers
    return p + 1 if p is not None and L % p == 0 and p + 1 < L else L


def extend(measured: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Per-block bytes of all ``num_layers`` blocks from a replay of block 0 and one repeating unit (block ``i >= 1``
    is of the kind of replayed block ``((i - 1) mod p) + 1``)."""
    p = len(measured) - 1
    if p <= 0 or len(measured) == num_layers:
        return measured
    return (measured[0],) + tuple(measured[((i - 1) % p) + 1] for i in range(1, num_layers))


@lru_cache(maxsize=512)
def _cached(spec: "ModelSpec", plan: "Plan") -> BlockSaves:
    path = cache_dir() / f"{_key(spec, plan)}.json"
    try:
        doc = json.loads(path.read_text())
        return BlockSaves(tuple(int(x) for x in doc["per_block"]), int(doc["final"]), int(doc["forward_transient"]),
                          int(doc["backward_transient"]), bool(doc["checkpointed"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    saves = measure_block_saves(spec, plan)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"model": spec.name, "per_block": list(saves.per_block), "final": saves.final,
                                   "forward_transient": saves.forward_transient,
                                   "backward_transient": saves.backward_transient,
                                   "checkpointed": saves.checkpointed}))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs the next run a replay
    return saves


class _StackDone(Exception):
    """Raised by the output head's forward pre-hook: the head and the loss are priced by their formulas."""


def measure_block_saves(spec: "ModelSpec", plan: "Plan") -> BlockSaves:
    """One forward of the blocks of ``spec`` as ``plan`` builds them, on fake tensors, and the backward of the
    blocks from the final norm's output (see the module docstring).

    A block's share is the bytes of the activation storages autograd saves for backward while the block runs
    (``torch.autograd.graph.saved_tensors_hooks``), each storage counted once, for the first block that saves it:
    a block's input is the previous block's output, counted where it is saved (by a norm that keeps its input);
    what exists before the first block (rotary tables, attention masks) is the formulas' shared forward tensors;
    weights and autocast's weight casts are not activations (``parameters``/``master_weights`` for the tracker).
    Transients: the peak of a block's forward above what it leaves, and the peak of its backward above the bytes
    alive when it starts, gradients of weights excluded (priced as gradients)."""
    from contextlib import ExitStack

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from oomdoctor.engines.replay import (TrackingHooks, _cuda_policy_mode_cls, _wrap_checkpoint_functions,
                                          cuda_autocast_answers, hf_data_paths)
    from oomdoctor.engines.simulate import _fake_gaps, _meta_model, _retie
    from oomdoctor.execute.build import find_layers, make_batch
    from oomdoctor.execute.step import TrainStep
    from oomdoctor.execute.tracking import LiveBytes

    depth = replay_depth(spec)
    built = _meta_model(spec, plan, depth if depth < spec.num_layers else None, True)
    model = built.model
    with FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False), _fake_gaps():
        model.to_empty(device="cpu")
        _retie(model)
        batch = make_batch(spec, plan, "cpu")
        lb = LiveBytes(round_to=512, param_copy_category="master_weights")
        lb.track_module(model)
        layers = find_layers(model)
        n = len(layers)
        per_block = [0] * (n + 1)  # the blocks, then the final norm
        fwd_t, bwd_t = [0] * n, [0] * n
        seen: set[int] = set()
        current, start, stack_out = [-1], [0], []

        def pack(t):
            if 0 <= current[0] and isinstance(t, torch.Tensor) and lb.category_of(t) == "activations":
                key = t.untyped_storage()._cdata
                if key not in seen:
                    seen.add(key)
                    per_block[current[0]] += lb.counted_bytes(t)
            return t

        def enter(i: int):
            def hook(_m, args, kwargs):
                if i == 0:  # what exists before the blocks (rotary tables, masks) is priced as shared, not here
                    x = args[0] if args else kwargs.get("hidden_states")
                    seen.update(lb.records)
                    seen.discard(x.untyped_storage()._cdata if isinstance(x, torch.Tensor) else None)
                current[0] = i
                lb.reset_peak()
            return hook

        def leave(i: int):
            def hook(_m, _a, _o):
                fwd_t[i] = lb.peak - lb.current
                current[0] = n if i == n - 1 else current[0]
            return hook

        def head_reached(_m, args):
            stack_out.append(args[0])
            raise _StackDone

        def bwd_enter(_m, _g):
            start[0] = lb.current
            lb.reset_peak()

        def bwd_leave(i: int):
            def hook(_m, _gi, _go):
                grads = lb.categories_at(lb.peak_event)["gradients"] - lb.categories_at(start_event[0])["gradients"]
                bwd_t[i] = max(0, lb.peak - start[0] - grads)
            return hook

        start_event = [0]

        def bwd_enter_i(m, g):
            start_event[0] = lb.events
            bwd_enter(m, g)

        hooks = []
        for i, layer in enumerate(layers):
            hooks += [layer.register_forward_pre_hook(enter(i), with_kwargs=True),
                      layer.register_forward_hook(leave(i)),
                      layer.register_full_backward_pre_hook(bwd_enter_i),
                      layer.register_full_backward_hook(bwd_leave(i))]
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
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                step = TrainStep(model, None, plan, hooks=TrackingHooks(lb, plan, head=None, target="cuda"))
                try:
                    step.forward_backward(batch)
                except _StackDone:
                    pass
                else:
                    raise RuntimeError(f"{spec.name}: the forward never reached its output head")
            out = stack_out[0]
            with lb.phase("backward"):
                out.backward(torch.ones_like(out))
        for h in hooks:
            h.remove()
        for mod, fn in restore:
            mod._gradient_checkpointing_func = fn
        lb.remove_hooks()
    return BlockSaves(extend(tuple(per_block[:-1]), spec.num_layers), per_block[-1], max(fwd_t), max(bwd_t),
                      plan.gradient_checkpointing)
