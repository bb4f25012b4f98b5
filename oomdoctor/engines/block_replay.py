"""One replay of a model's blocks on fake tensors, block by block: the mechanics under the block measurement
(``engines/blocks.py``, which decides what to replay and combines the replays).

A :class:`BlockReplay` builds the model as the plan trains it (the executor's ``build_model``: peft, quantization
stand-ins, dtypes, attention implementation, checkpointing) once, materializes it as fake tensors, and runs the
forward of its blocks up to the output head and their backward from the final norm's output as many times as asked
(:meth:`BlockReplay.run`: a micro-batch and a sequence length each), each run under a fresh
:class:`~oomdoctor.execute.tracking.LiveBytes` tracker. Per block it records the activation bytes autograd saves
(``saved_tensors_hooks``, each storage counted once, for the first block that saves it), the peak of its forward
above what it leaves, the peak of its backward above the bytes alive when that starts (with and without the weight
gradients it makes) and the ops its forward dispatched; and the final norm's saves.

Blocks a run does not measure are passed through (:func:`_passthrough`): their output is a copy of their input with
the gradient requirement the block would give it, so the measured blocks around them see what they would see, and a
run costs only its measured blocks. A run can stop as soon as one block's forward has dispatched more ops than a
budget (:class:`LoopBudget`): blocks that loop over the tokens in Python (Mamba's selective scan) are measured at a
few tokens instead (``engines/blocks.py``).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from oomdoctor.execute.tracking import LiveBytes

if TYPE_CHECKING:  # pragma: no cover
    from oomdoctor.model.spec import ModelSpec
    from oomdoctor.plan import Plan


@dataclass(frozen=True)
class BlockRun:
    """What one replay measured, per replayed block (bottom first; zeros for blocks passed through)."""

    saves: tuple[int, ...]
    """Activation bytes autograd saved while the block ran."""
    final: int
    """Activation bytes saved between the last block and the output head (the final norm)."""
    forward: tuple[int, ...]
    """Peak of the block's forward above what it leaves."""
    backward: tuple[int, ...]
    """Peak of the block's backward above the bytes alive when it started, its weights' gradients included."""
    backward_net: tuple[int, ...]
    """The same, net of the weight gradients the block's backward made."""
    ops: tuple[int, ...]
    """Ops the block's forward dispatched (a Python loop over the tokens grows them with the sequence)."""


class LoopBudget(Exception):
    """A block's forward dispatched more ops than the run's budget (it loops over the tokens in Python)."""

    def __init__(self, block: int):
        super().__init__(f"block {block} exceeded the replay's op budget")
        self.block = block


class _StackDone(Exception):
    """Raised by the output head's forward pre-hook: the head and the loss are priced by their formulas."""


def _budget_mode(lb: LiveBytes, budget: "_Budget"):
    """A torch-function mode raising :class:`LoopBudget` at the first torch call after the running block's forward
    passed its budget of dispatched ops (counted by ``lb``): raised in Python, before the call enters C++ (an
    exception thrown from a dispatch mode inside a composite op such as ``matmul`` aborts the process)."""
    from torch.overrides import TorchFunctionMode

    class _Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if budget.limit is not None and lb.events > budget.limit:
                budget.limit = None
                raise LoopBudget(budget.block)
            return func(*args, **(kwargs or {}))

    return _Mode()


@dataclass
class _Budget:
    """The running block and the event count its forward may reach (None: no budget)."""

    block: int = -1
    limit: int | None = None


@contextmanager
def _quiet():
    """transformers' and torch's chatter while a model is built and replayed (kernel fallbacks, deprecations) is
    not the user's business: the measurement prints nothing."""
    import warnings

    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(level)


def _passthrough(layer, outputs: dict):
    """A ``forward`` for ``layer`` that returns a copy of its input (in the output structure its class returns,
    learned in ``outputs`` from a block of that class that ran) requiring grad as the block's output would: when its
    input does, or when the block has a trainable parameter. Until a block of its class has run, the block runs."""
    trainable = any(p.requires_grad for p in layer.parameters())
    cls, original = type(layer), layer.forward

    def forward(*args, **kwargs):
        if cls not in outputs:
            return original(*args, **kwargs)
        x = args[0] if args else kwargs["hidden_states"]
        y = x.clone() if x.requires_grad else x.detach().clone().requires_grad_(trainable)
        arity = outputs[cls]
        return y if arity is None else (y,) + (None,) * (arity - 1)

    return forward


class BlockReplay:
    """The model of ``spec`` as ``plan`` trains it, built once with ``num_layers`` blocks (None: all), on fake
    tensors, to :meth:`run` as often as needed. Use as a context manager (it holds the fake-tensor mode)."""

    def __init__(self, spec: "ModelSpec", plan: "Plan", num_layers: int | None):
        self.spec, self.plan, self.num_layers = spec, plan, num_layers
        self._stack = ExitStack()
        self._outputs: dict[type, int | None] = {}  # block class -> tuple length of its output (None: a tensor)

    def __enter__(self) -> "BlockReplay":
        from torch._subclasses.fake_tensor import FakeTensorMode

        from oomdoctor.engines.fake import fake_gaps, meta_model, retie
        from oomdoctor.engines.routing import balanced_routing
        from oomdoctor.execute.build import find_layers

        st = self._stack
        st.enter_context(_quiet())
        self.built = meta_model(self.spec, self.plan, self.num_layers, True)
        st.enter_context(FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False))
        st.enter_context(fake_gaps())
        st.enter_context(balanced_routing(self.spec, self.plan))
        self.built.model.to_empty(device="cpu")
        retie(self.built.model)
        self.layers = find_layers(self.built.model)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def run(
        self, micro_batch: int, seq_len: int, measured: frozenset[int] | None = None, budget: int | None = None
    ) -> BlockRun:
        """One forward of the blocks at ``micro_batch`` x ``seq_len`` tokens and the backward of the blocks from the
        final norm's output. Blocks outside ``measured`` (None: all) are passed through; ``budget``: the ops one
        block's forward may dispatch before :class:`LoopBudget` stops the run."""
        from dataclasses import replace

        model = self.built.model
        for p in model.parameters():
            p.grad = None  # what a previous run's backward left would turn this one's gradients into in-place sums
        n = len(self.layers)
        measured = frozenset(range(n)) if measured is None else measured
        originals = {}
        for i in range(n):
            if i not in measured:
                originals[i] = self.layers[i].__dict__.get("forward")
                self.layers[i].forward = _passthrough(self.layers[i], self._outputs)
        try:
            return self._run(replace(self.plan, micro_batch=micro_batch, seq_len=seq_len), budget)
        finally:
            for i, fwd in originals.items():
                if fwd is None:
                    del self.layers[i].forward
                else:
                    self.layers[i].forward = fwd

    def _run(self, plan: "Plan", budget: int | None) -> BlockRun:
        import torch

        from oomdoctor.engines.replay import (
            TrackingHooks,
            cuda_autocast_answers,
            cuda_policy_mode_cls,
            hf_data_paths,
            wrap_checkpoint_functions,
        )
        from oomdoctor.execute.bnb_standin import CONTEXT_HELD
        from oomdoctor.execute.build import make_batch
        from oomdoctor.execute.step import TrainStep
        from oomdoctor.model.execution import runs_autocast

        model, layers = self.built.model, self.layers
        batch = make_batch(self.spec, plan, "cpu")
        lb = LiveBytes(round_to=512, param_copy_category="master_weights")
        allowance = _Budget()
        lb.track_module(model)
        n = len(layers)
        per_block = [0] * (n + 1)  # the blocks, then the final norm
        fwd_t, bwd_t, bwd_net, ops = [0] * n, [0] * n, [0] * n, [0] * n
        started = [0] * n
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
                started[i] = lb.events
                allowance.block, allowance.limit = i, (lb.events + budget if budget is not None else None)
                lb.reset_peak()

            return hook

        def leave(i: int):
            def hook(_m, _a, out):
                if backward[0]:
                    return
                allowance.limit = None
                ops[i] = lb.events - started[i]
                fwd_t[i] = lb.peak - lb.current
                current[0] = n if i == n - 1 else current[0]
                self._outputs.setdefault(type(layers[i]), len(out) if isinstance(out, (tuple, list)) else None)
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
            hooks += [
                layer.register_forward_pre_hook(enter(i), with_kwargs=True),
                layer.register_forward_hook(leave(i)),
            ]
        hooks.append(self.built.head_module.register_forward_pre_hook(head_reached))
        policy_cls = cuda_policy_mode_cls()
        # the recompute in backward runs under the CUDA policy again (torch-function modes are off in backward)
        restore = (
            wrap_checkpoint_functions(model, lb, policy_cls, classify=False) if plan.gradient_checkpointing else []
        )
        # under checkpointing the kept block inputs (and bnb's context-held int8 inputs) are formulas
        observers = [] if plan.gradient_checkpointing else [held]
        try:
            with ExitStack() as stack:
                stack.enter_context(hf_data_paths())
                stack.enter_context(cuda_autocast_answers())
                stack.enter_context(policy_cls())
                stack.enter_context(lb)
                if budget is not None:
                    stack.enter_context(_budget_mode(lb, allowance))
                CONTEXT_HELD.extend(observers)
                stack.callback(lambda: [CONTEXT_HELD.remove(o) for o in observers])
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    step = TrainStep(model, None, plan, hooks=TrackingHooks(lb, plan, head=None, target="cuda"))
                    try:
                        step.forward_backward(batch)
                    except _StackDone:
                        pass
                    else:
                        raise RuntimeError(f"{self.spec.name}: the forward never reached its output head")
                out = stack_out[0]
                backward[0] = True
                with lb.phase("backward"):
                    out.backward(torch.ones_like(out))
                if bwd_block[0] >= 0:  # block 0's input needs no gradient (LoRA without checkpointing): ends here
                    bwd_leave(bwd_block[0])
        finally:
            for h in hooks:
                h.remove()
            for mod, fn in restore:
                mod._gradient_checkpointing_func = fn
            lb.remove_hooks()
        return BlockRun(tuple(per_block[:-1]), per_block[-1], tuple(fwd_t), tuple(bwd_t), tuple(bwd_net), tuple(ops))


__all__ = ["BlockReplay", "BlockRun", "LoopBudget"]
