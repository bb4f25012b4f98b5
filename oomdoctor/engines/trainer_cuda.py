"""The CUDA paths of a foreign trainer's step, for its replay on fake CPU tensors (``engines/trainers``).

Where the trainer's CUDA and CPU code paths differ, the replay follows CUDA (besides ``replay.CudaPolicy``):

* **torch's kernel defaults**: on CUDA, torch optimizers without an explicit ``foreach``/``fused`` (HF's
  ``adamw_torch``, ``sgd``) and ``clip_grad_norm_`` pick their foreach kernels; on a CPU device (and for fake
  tensors, whose type is not ``torch.Tensor``) the for-loop: the replay answers as CUDA does.
* **TRL's fused LM head** (trl 1.16 ``trainer/utils.py`` ``add_fused_lm_head``, ``kernels/chunked_logprob.py``):
  ``_use_triton(device)`` is true on CUDA, so (a) only the valid positions are scored — ``hidden_states[mask]``,
  a copy of the valid rows, then ``masked_scatter`` back —, not every position; (b) the Triton kernels fold each
  ``[TOKEN_CHUNK_SIZE, chunk]`` tile into buffers torch allocated before the launch (running max, sums, target
  logit; in backward the tile is overwritten with its gradient in place): the launches allocate nothing and are
  skipped (in a real-tensor run they leave finite values), where the CPU fallback (``_forward_tile``) makes fp32
  copies of every tile; (c) ``_addmm_fp32`` accumulates bf16 products with ``torch.addmm(..., out_dtype=float32,
  out=acc)``, no temporaries (CPU casts both operands to fp32): the replay runs the CPU form untracked.
* **Data-dependent sizes and answers** (fake tensors hold no values): a boolean mask selects every element (the
  batch is full and unpadded: every label is valid but the one the shift removes); ``isnan``/``isinf`` answer
  false, any other ``.item()`` of a count or a comparison answers 1 / true (TRL's ``num_valid > 0``, the metrics'
  ``.item()``); an all-ones attention mask lets SDPA run causal without a mask (``replay.hf_data_paths``).
* **TRL's activation offloading** (``models/activation_offloading.py``, torchtune's ``OffloadActivations`` with
  streams): its own code runs, with the CPU standing for the device — pinned host copies are made outside the
  tracker and counted as ``cpu_offloaded`` (their peak), a host tensor moved back ``to`` the device is a tracked
  copy, streams and events are no-ops (a stream switch allocates nothing), and storage identity (the dedup key and
  the parameter filter) is the storage itself where fake tensors have no data pointer.
* **bitsandbytes paged optimizers**: state buffers of >= 1e5 elements in unified memory (``paged_optimizer``), as
  ``execute.optim.replayed_state_buffer``.
* **Materialization**: the meta-built model gets its (fake) storage once the trainer is built (a GPU run loads it
  before): the Trainer's own move to the device is skipped for a meta model, and accelerate's (a no-op for a model
  already there) is not run.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any


def _patch_everywhere(orig, new) -> list[tuple[Any, str, Any]]:
    """Replace every module-level reference to ``orig`` in torch's modules by ``new`` (functions imported by name
    elsewhere); returns what to restore."""
    import sys

    done = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("torch") or mod is None:
            continue
        for attr, val in list(vars(mod).items()):
            if val is orig:
                setattr(mod, attr, new)
                done.append((mod, attr, orig))
    return done


@contextmanager
def cuda_kernel_defaults():
    """torch's default kernel choices as on CUDA (module docstring): optimizers without ``foreach``/``fused`` run
    foreach, ``clip_grad_norm_``'s norms run foreach."""
    import torch
    import torch.optim.optimizer as oo
    import torch.utils._foreach_utils as fu

    orig_default, orig_has = oo._default_to_fused_or_foreach, fu._has_foreach_support

    def default(params, differentiable, use_fused=False):
        if torch.jit.is_scripting() or differentiable:
            return False, False
        fused = use_fused and all(p is None or torch.is_floating_point(p) for p in params)
        return fused, not fused

    def has(tensors, device):
        return fu._device_has_foreach_support(device) and all(t is None or isinstance(t, torch.Tensor) for t in tensors)

    restore = _patch_everywhere(orig_default, default) + _patch_everywhere(orig_has, has)
    try:
        yield
    finally:
        for mod, attr, val in restore:
            setattr(mod, attr, val)


@contextmanager
def bnb_optimizers(lb):
    """bitsandbytes optimizers allocate their state as on CUDA: paged buffers of >= 1e5 elements in unified memory
    (``execute.optim.replayed_state_buffer``). The Trainer's 32-bit override of embedding weights under an 8-bit
    optimizer goes into bitsandbytes' process-wide ``GlobalOptimManager``, keyed by parameter ids and (group, index)
    positions: restored afterwards, or the next optimizer built in this process would inherit it."""
    try:
        from bitsandbytes.optim.optimizer import GlobalOptimManager, Optimizer8bit
    except ImportError:  # pragma: no cover - bitsandbytes is a dependency
        yield
        return
    from oomdoctor.execute.optim import replayed_state_buffer

    orig = Optimizer8bit.get_state_buffer
    mng = GlobalOptimManager.get_instance()
    saved = (
        dict(mng.pid2config),
        dict(mng.index2config),
        list(mng.module_weight_config_triple),
        mng.uses_config_override,
    )

    def get_state_buffer(self, p, dtype=None):
        import torch

        return replayed_state_buffer(p, dtype or torch.float32, self.is_paged, lb)

    Optimizer8bit.get_state_buffer = get_state_buffer
    try:
        yield
    finally:
        Optimizer8bit.get_state_buffer = orig
        mng.pid2config, mng.index2config, mng.module_weight_config_triple, mng.uses_config_override = saved


class _Launch:
    """A Triton kernel launch (``kernel[grid](...)``) replayed: it writes into buffers torch allocated before the
    launch, so it allocates nothing. On real tensors ``fill`` leaves finite values in the outputs."""

    def __init__(self, fill: Callable | None = None):
        self.fill = fill

    def __getitem__(self, grid):
        return self

    def __call__(self, *args, **kwargs):
        from torch._subclasses.fake_tensor import FakeTensor

        if self.fill is not None and not isinstance(args[0], FakeTensor):
            self.fill(*args)


def _fold_forward(tile, stride, targets, running_max, sum_exp, *rest):
    """What ``_forward_kernel`` leaves, as finite placeholders: max 0, sum of exponentials 1."""
    running_max.zero_()
    sum_exp.fill_(1.0)


@contextmanager
def trl_cuda_paths(lb):
    """TRL's fused LM head takes its CUDA path (module docstring): Triton's compact scoring, kernel launches that
    allocate nothing, ``_addmm_fp32`` without temporaries."""
    import types

    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from trl.kernels import chunked_logprob as cl
    from trl.trainer import utils as tu

    low = (torch.float16, torch.bfloat16)

    def addmm_fp32(acc, a, b):
        if a.dtype in low and isinstance(acc, FakeTensor):
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)  # CUDA's call (its meta kernel runs here)
        elif a.dtype in low:
            with lb.paused():  # the CPU form's fp32 operand copies do not exist on CUDA
                acc.addmm_(a.float(), b.float())
        else:
            acc.addmm_(a, b)

    saved = {
        (cl, "_use_triton"): cl._use_triton,
        (tu, "_use_triton"): tu._use_triton,
        (cl, "_forward_kernel"): cl._forward_kernel,
        (cl, "_backward_kernel"): cl._backward_kernel,
        (cl, "_addmm_fp32"): cl._addmm_fp32,
        (cl, "triton"): getattr(cl, "triton", None),
    }
    cl._use_triton = tu._use_triton = lambda device: True
    cl._forward_kernel, cl._backward_kernel = _Launch(_fold_forward), _Launch()
    cl._addmm_fp32 = addmm_fp32
    cl.triton = types.SimpleNamespace(cdiv=lambda a, b: -(-a // b))
    try:
        yield
    finally:
        for (mod, attr), val in saved.items():
            if val is None:
                delattr(mod, attr)
            else:
                setattr(mod, attr, val)


# ============================================================================ data-dependent answers


def full_batch_cls():
    """A dispatch mode answering what fake tensors cannot know as a full, unpadded batch would (module docstring):
    boolean masks select every element; ``isnan``/``isinf`` are false; other scalars read back are 1 / true."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.weak import WeakIdKeyDictionary

    aten = torch.ops.aten
    falsy = {aten.isnan.default, aten.isinf.default, aten.isneginf.default, aten.isposinf.default}
    index_puts = {aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}

    def long_indices(indices):
        out = []
        for ix in indices:
            if isinstance(ix, FakeTensor) and ix.dtype in (torch.bool, torch.uint8):
                idx = aten.nonzero_static.default(ix, size=ix.numel())
                out += list(idx.unbind(1))
            else:
                out.append(ix)
        return out

    class FullBatchAnswers(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.false = WeakIdKeyDictionary()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in falsy:
                out = func(*args, **kwargs)
                self.false[out] = True
                return out
            if func in (aten._local_scalar_dense.default, aten.is_nonzero.default) and isinstance(args[0], FakeTensor):
                x = args[0]
                if x in self.false:
                    return False if x.dtype == torch.bool else 0
                return True if x.dtype == torch.bool else (1.0 if x.dtype.is_floating_point else 1)
            if func is aten.index.Tensor and isinstance(args[0], FakeTensor):
                return func(args[0], long_indices(args[1]))
            if func in index_puts and isinstance(args[0], FakeTensor):
                return func(args[0], long_indices(args[1]), *args[2:], **kwargs)
            if func is aten.nonzero.default and isinstance(args[0], FakeTensor):
                return aten.nonzero_static.default(args[0], size=args[0].numel())
            if func is aten.masked_select.default and isinstance(args[0], FakeTensor):
                n = torch.broadcast_shapes(args[0].shape, args[1].shape).numel()
                return aten.empty.memory_format([n], dtype=args[0].dtype, device=args[0].device)
            return func(*args, **kwargs)

    return FullBatchAnswers


# ============================================================================ TRL's activation offloading


class OffloadOnHost:
    """Adapts TRL's ``OffloadActivations`` (built with the CPU as its accelerator) to a replay on the CPU (module
    docstring), while entered: its pack/unpack hooks run as written, inside a mode where the pinned host tensors they
    allocate are host memory (outside ``lb``, counted as ``cpu_offloaded`` at their peak) and a host tensor moved
    back ``to`` the device is a tracked copy; streams, events and ``record_stream`` do nothing; a fake storage's data
    pointer is its identity."""

    def __init__(self, ctx, model, lb):
        from torch.utils.weak import WeakIdKeyDictionary

        self.ctx, self.model, self.lb = ctx, model, lb
        self.live = 0
        self.peak = 0
        self.host = WeakIdKeyDictionary()
        streams = _NoStreams()
        ctx.device_module = streams
        if getattr(ctx, "use_streams", False):
            ctx.s1 = streams.Stream()
        pack, unpack = ctx.pack_hook, ctx.unpack_hook
        ctx.pack_hook = lambda t: self._run(pack, t)
        ctx.unpack_hook = lambda i: self._run(unpack, i)
        self._stack: ExitStack | None = None

    def __enter__(self) -> "OffloadOnHost":
        import torch

        st = self._stack = ExitStack()
        orig_ptr, orig_record = torch.UntypedStorage.data_ptr, torch.Tensor.record_stream

        def data_ptr(storage):
            return storage._cdata if storage.device.type == "meta" else orig_ptr(storage)

        torch.UntypedStorage.data_ptr = data_ptr
        torch.Tensor.record_stream = lambda *a, **k: None
        st.callback(setattr, torch.UntypedStorage, "data_ptr", orig_ptr)
        st.callback(setattr, torch.Tensor, "record_stream", orig_record)
        self.ctx.update_model_params(self.model)  # on a GPU the model is there before the context is built
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _run(self, fn, arg):
        with _host_copies_mode(self)():
            return fn(arg)

    def new_host(self, t) -> None:
        n = t.untyped_storage().nbytes()  # made under lb.paused: never counted (copies into it allocate nothing)
        self.host[t] = True
        self.live += n
        self.peak = max(self.peak, self.live)
        self.lb.external["cpu_offloaded"] = self.peak
        weakref.finalize(t, self._freed, n)

    def _freed(self, n: int) -> None:
        self.live -= n


def _host_copies_mode(offload: OffloadOnHost):
    import torch
    from torch.overrides import TorchFunctionMode

    class HostCopies(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in (torch.empty_like, torch.empty) and "pin_memory" in kwargs:
                kwargs = {k: v for k, v in kwargs.items() if k != "pin_memory"}
                with offload.lb.paused():
                    t = func(*args, **kwargs)
                offload.new_host(t)
                return t
            if func is torch.Tensor.to and args and args[0] in offload.host:
                return args[0].clone()
            if func is torch.Tensor.record_stream:
                return None
            return func(*args, **kwargs)

    return HostCopies


class _NoStreams:
    """A device module whose streams and events do nothing (a stream switch allocates nothing)."""

    class Stream:
        def wait_stream(self, *a, **k):
            return None

        def wait_event(self, *a, **k):
            return None

        def record_event(self, *a, **k):
            return None

        def synchronize(self):
            return None

    def __init__(self):
        self._current = self.Stream()

    def current_stream(self, *a, **k):
        return self._current

    def stream(self, _s):
        return nullcontext()

    def empty_cache(self):
        return None

    def synchronize(self, *a, **k):
        return None
