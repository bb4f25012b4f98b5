"""bitsandbytes stand-ins: linears that hold exactly the bytes bnb stores and run bnb's registered ops.

bnb's ``Params4bit`` / ``Int8Params`` do not accept fake tensors (their ``__new__``/``to`` quantize real data), so the
simulated engine replaces each quantized linear by a stand-in that is still an instance of ``bnb.nn.Linear4bit`` /
``bnb.nn.Linear8bitLt`` (peft then wraps it with its own bnb LoRA classes, including the defensive ``result.clone()``
of 4-bit layers) but keeps its quantized storage as plain module tensors, so ``to_empty`` can materialize them as
fake tensors.

Bytes per quantized ``(out, in)`` linear, as bitsandbytes 0.50 stores them (checked against a real model loaded on CPU
with ``BitsAndBytesConfig`` in tests/test_simulate_bnb.py):

* 4-bit (nf4/fp4, blocksize 64): packed weight ``uint8[(out*in+1)//2, 1]``; per-block absmax ``float32[ceil(out*in/64)]``;
  the 16-value code ``float32[16]``. With double quantization the absmax is ``uint8[ceil(out*in/64)]`` plus an
  ``offset`` ``float32[]`` and a second state: absmax ``float32[ceil(blocks/256)]`` and code ``float32[256]``
  (bitsandbytes/functional.py ``quantize_4bit``; every layer owns its code tensors).
* int8 (LLM.int8()): weight ``int8[out, in]`` and per-row scales ``SCB float32[out]`` (bitsandbytes/nn/modules.py
  ``Int8Params``).

Compute: 4-bit layers run bnb's ``MatMul4Bit``. On CUDA, bnb 0.50's ``gemm_4bit`` dequantizes the whole weight to the
compute dtype and calls ``F.linear`` when the token count ``M > 1536`` (``_gemm_4bit_custom_max_m``; the fused kernel
only serves small M): that dequantized copy lives inside the op, invisible to a dispatch mode, so with
``decompose=True`` (the default for the simulated GPU) the stand-in issues ``dequantize_4bit`` + ``linear`` as two ops
and the temporary is counted. Backward dequantizes again (``MatMul4Bit.backward``), through bnb's ops as well.
Int8 layers mirror ``MatMul8bitLt`` (the CUDA training path: fp16 cast of the input, row-wise int8 quantization,
``int8_scaled_mm``, input kept for backward, dequantized fp weight in backward) with no outlier columns (their count
depends on the data; in practice a handful of columns).
"""

from __future__ import annotations

import math
from typing import Any

#: bnb 0.50 CUDA: above this many rows gemm_4bit falls back to dequantize + F.linear (backends/cuda/ops.py).
GEMM_4BIT_CUSTOM_MAX_M = 1536
BLOCKSIZE_4BIT = 64
BLOCKSIZE_NESTED = 256
#: transformers BitsAndBytesConfig default ``llm_int8_threshold``.
INT8_THRESHOLD = 6.0


def quant_bytes_4bit(
    out_features: int, in_features: int, double_quant: bool, blocksize: int = BLOCKSIZE_4BIT
) -> dict[str, int]:
    """Exact bytes of one bnb 4-bit linear's storage, by tensor (unrounded)."""
    n = out_features * in_features
    blocks = math.ceil(n / blocksize)
    d = {"weight": (n + 1) // 2, "code": 16 * 4}
    if double_quant:
        d.update(absmax=blocks, offset=4, state2_absmax=math.ceil(blocks / BLOCKSIZE_NESTED) * 4, state2_code=256 * 4)
    else:
        d.update(absmax=blocks * 4)
    return d


def quant_bytes_int8(out_features: int, in_features: int) -> dict[str, int]:
    """Exact bytes of one bnb int8 linear's storage (unrounded)."""
    return {"weight": out_features * in_features, "SCB": out_features * 4}


#: Callbacks told of every tensor an int8 matmul keeps on its autograd context instead of ``save_for_backward`` (as
#: bnb does: ``ctx.tensors``), which ``saved_tensors_hooks`` never see: the block measurement
#: (``engines/blocks.py``) counts them as what the block keeps for backward.
CONTEXT_HELD: list = []


def _bnb():
    import bitsandbytes as bnb

    return bnb


def _make_classes():
    import torch

    bnb = _bnb()
    from bitsandbytes.functional import QuantState

    class _MatMul4BitDecomposed(torch.autograd.Function):
        """``MatMul4Bit`` with the forward's dequantize + linear as separate ops (bnb's CUDA path for M > 1536)."""

        @staticmethod
        def forward(ctx, A, B, bias, quant_state):
            W = torch.ops.bitsandbytes.dequantize_4bit.default(
                B, _absmax(quant_state), quant_state.blocksize, quant_state.quant_type, list(quant_state.shape), A.dtype
            )
            out = torch.nn.functional.linear(A, W, bias)
            del W
            ctx.state = quant_state
            ctx.B = B
            ctx.has_bias = bias is not None
            return out

        @staticmethod
        def backward(ctx, grad_output):
            grad_A = None
            if ctx.needs_input_grad[0]:
                W = bnb.functional.dequantize_4bit(ctx.B, ctx.state).to(grad_output.dtype)
                grad_A = torch.matmul(grad_output, W)
            return grad_A, None, None, None

    def _absmax(qs):
        if not qs.nested:
            return qs.absmax
        absmax = torch.ops.bitsandbytes.dequantize_blockwise.default(
            qs.absmax, qs.state2.absmax, qs.state2.code, qs.state2.blocksize, torch.float32
        )
        return absmax + qs.offset

    class Linear4bitStandIn(bnb.nn.Linear4bit):
        """A ``bnb.nn.Linear4bit`` whose quantized storage is plain tensors (fake-tensor friendly)."""

        def __init__(
            self,
            in_features,
            out_features,
            bias,
            *,
            compute_dtype,
            quant_type,
            double_quant,
            quant_dtype,
            device="meta",
            decompose=True,
        ):
            torch.nn.Module.__init__(self)
            self.in_features, self.out_features = in_features, out_features
            self.compute_dtype = compute_dtype
            self.compute_type_is_set = True
            self.quant_storage = torch.uint8
            self.quant_type = quant_type
            self.double_quant = double_quant
            self.quant_dtype = quant_dtype
            self.decompose = decompose
            self.support_avx512bf16_for_cpu = False
            n = in_features * out_features
            blocks = math.ceil(n / BLOCKSIZE_4BIT)
            w = torch.nn.Parameter(
                torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device=device), requires_grad=False
            )
            # attributes peft's dispatcher reads (lost on to_empty, not needed after wrapping)
            w.compress_statistics = double_quant
            w.quant_type = quant_type
            self.weight = w
            self.bias = (
                torch.nn.Parameter(torch.empty(out_features, dtype=compute_dtype, device=device), requires_grad=False)
                if bias
                else None
            )
            self.register_buffer(
                "absmax", torch.empty(blocks, dtype=torch.uint8 if double_quant else torch.float32, device=device)
            )
            self.register_buffer("code", torch.empty(16, dtype=torch.float32, device=device))
            if double_quant:
                self.register_buffer("offset", torch.empty((), dtype=torch.float32, device=device))
                self.register_buffer(
                    "state2_absmax",
                    torch.empty(math.ceil(blocks / BLOCKSIZE_NESTED), dtype=torch.float32, device=device),
                )
                self.register_buffer("state2_code", torch.empty(256, dtype=torch.float32, device=device))
            if torch.device(device).type != "meta":  # real tensors (CPU cross-checks, GPU runs): sane values
                with torch.no_grad():
                    self.weight.random_(0, 256)
                    self.absmax.fill_(1 if double_quant else 0.05)
                    self.code.copy_(torch.linspace(-1, 1, 16))
                    if double_quant:
                        self.offset.fill_(0.0)
                        self.state2_absmax.fill_(0.05)
                        self.state2_code.copy_(torch.linspace(-1, 1, 256))

        def quant_state(self):
            state2 = None
            if self.double_quant:
                state2 = QuantState(
                    absmax=self.state2_absmax, code=self.state2_code, blocksize=BLOCKSIZE_NESTED, dtype=torch.float32
                )
            return QuantState(
                absmax=self.absmax,
                shape=torch.Size([self.out_features, self.in_features]),
                code=self.code,
                blocksize=BLOCKSIZE_4BIT,
                quant_type=self.quant_type,
                dtype=self.quant_dtype,
                offset=self.offset if self.double_quant else None,
                state2=state2,
            )

        def forward(self, x):
            inp_dtype = x.dtype
            x = x.to(self.compute_dtype)
            bias = None if self.bias is None else self.bias.to(self.compute_dtype)
            qs = self.quant_state()
            m = x.numel() // max(x.shape[-1], 1)
            if self.decompose and m > GEMM_4BIT_CUSTOM_MAX_M and torch.is_grad_enabled() and x.requires_grad:
                out = _MatMul4BitDecomposed.apply(x, self.weight, bias, qs)
            else:
                out = bnb.matmul_4bit(x, self.weight.t(), bias=bias, quant_state=qs)
            return out.to(inp_dtype)

    class _MatMul8bitLtNoOutliers(torch.autograd.Function):
        """bnb ``MatMul8bitLt`` (CUDA training path) for a frozen int8 weight, with zero outlier columns."""

        @staticmethod
        def forward(ctx, A, CB, SCB, bias):
            input_shape = A.shape
            A2 = A.reshape(-1, A.shape[-1]) if A.dim() == 3 else A
            CA, SCA, _ = torch.ops.bitsandbytes.int8_vectorwise_quant.default(A2.to(torch.float16), 0.0)
            out = torch.ops.bitsandbytes.int8_scaled_mm.default(CA, CB, SCA, SCB, bias=bias, dtype=A2.dtype)
            del CA, SCA
            ctx.A = A2  # bnb keeps ctx.tensors = (CAt, subA, A)
            for observe in CONTEXT_HELD:
                observe(A2)
            ctx.CB, ctx.SCB = CB, SCB
            ctx.grad_shape = input_shape
            ctx.dtype_A = A2.dtype
            return out.reshape(*input_shape[:-1], CB.shape[0]) if len(input_shape) == 3 else out

        @staticmethod
        def backward(ctx, grad_output):
            grad_A = None
            if ctx.needs_input_grad[0]:
                if grad_output.dim() == 3:
                    grad_output = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
                CB = ctx.CB.to(ctx.dtype_A, copy=True).mul_(ctx.SCB.unsqueeze(1).mul(1.0 / 127.0))
                grad_A = torch.matmul(grad_output.to(ctx.dtype_A), CB).view(ctx.grad_shape)
            return grad_A, None, None, None

    class Linear8bitLtStandIn(bnb.nn.Linear8bitLt):
        """A ``bnb.nn.Linear8bitLt`` whose int8 weight and scales are plain tensors (fake-tensor friendly)."""

        def __init__(self, in_features, out_features, bias, *, device="meta", threshold=INT8_THRESHOLD):
            torch.nn.Module.__init__(self)
            self.in_features, self.out_features = in_features, out_features
            self.state = bnb.MatmulLtState()
            self.state.threshold = threshold
            self.state.has_fp16_weights = False
            self.index = None
            self.weight = torch.nn.Parameter(
                torch.empty((out_features, in_features), dtype=torch.int8, device=device), requires_grad=False
            )
            self.bias = (
                torch.nn.Parameter(torch.empty(out_features, dtype=torch.float32, device=device), requires_grad=False)
                if bias
                else None
            )
            self.register_buffer("SCB", torch.empty(out_features, dtype=torch.float32, device=device))
            if torch.device(device).type != "meta":
                with torch.no_grad():
                    self.weight.random_(-127, 128)
                    self.SCB.fill_(1.0)

        def forward(self, x):
            bias = self.bias
            if bias is not None and bias.dtype != x.dtype:
                bias = bias.to(x.dtype)
            return _MatMul8bitLtNoOutliers.apply(x, self.weight, self.SCB, bias)

    return Linear4bitStandIn, Linear8bitLtStandIn


_CLASSES: tuple | None = None


def standin_classes():
    """(Linear4bitStandIn, Linear8bitLtStandIn), created on first use (imports bitsandbytes)."""
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _make_classes()
    return _CLASSES


def bnb_targets(model) -> list[tuple[str, Any]]:
    """(path, module) of the modules transformers' bitsandbytes loading replaces in ``model``, before any is
    replaced: the one rule (``model/inventory.bnb_quantized_paths``)."""
    from oomdoctor.model.inventory import bnb_quantized_paths

    paths = bnb_quantized_paths(model)
    return [(name, mod) for name, mod in model.named_modules() if name in paths]


def linear_features(mod) -> tuple[int, int]:
    """(in, out) features of an ``nn.Linear`` or a transformers ``Conv1D`` (weight stored (in, out)), which
    transformers' bitsandbytes integration replaces alike (``replace_with_bnb_linear``)."""
    if type(mod).__name__ == "Conv1D":
        return int(mod.weight.shape[0]), int(mod.weight.shape[1])
    return mod.in_features, mod.out_features


def quantize_model_standin(model, plan, *, device: str = "meta", decompose: bool = True) -> int:
    """Replace every module transformers' bitsandbytes loading replaces (:func:`bnb_targets`) by a bnb stand-in for
    ``plan.quant``; returns how many.

    Flags the model as transformers' quantizer does (:func:`_mark_quantized`: peft picks its bnb LoRA layers by them).
    """
    from oomdoctor.execute.dtypes import torch_dtype

    return quantize_standin(
        model,
        quant=plan.quant,
        compute_dtype=torch_dtype(plan.compute_dtype),
        double_quant=plan.double_quant,
        device=device,
        decompose=decompose,
    )


def quantize_standin(
    model, *, quant: str, compute_dtype, double_quant: bool, device: str = "meta", decompose: bool = True
) -> int:
    """:func:`quantize_model_standin` from the quantization settings themselves (``quant``: int8, nf4 or fp4;
    ``compute_dtype``: the torch dtype 4-bit layers compute and dequantize in), as a ``BitsAndBytesConfig`` gives
    them to ``from_pretrained``; returns how many modules were replaced."""
    L4, L8 = standin_classes()
    targets = bnb_targets(model)
    for name, child in targets:
        fin, fout = linear_features(child)
        if quant == "int8":
            new = L8(fin, fout, child.bias is not None, device=device)
        else:
            new = L4(
                fin,
                fout,
                child.bias is not None,
                compute_dtype=compute_dtype,
                quant_type=quant,
                double_quant=double_quant,
                quant_dtype=compute_dtype,
                device=device,
                decompose=decompose,
            )
        model.set_submodule(name, new)
    _mark_quantized(model, quant)
    return len(targets)


def _mark_quantized(model, quant: str) -> None:
    """The flags transformers sets on a bnb-loaded model: ``is_loaded_in_4bit``/``_8bit`` and ``is_quantized``
    (peft and the Trainer read them), and ``config._is_quantized`` on every submodel (``quantizers/base.py``
    ``_assign_is_quantized``), which some models' code reads: Jamba's mixer calls ``dt_proj`` as a module, not
    ``dt_proj.weight @ x``, when it is set."""
    if quant == "int8":
        model.is_loaded_in_8bit = True
    else:
        model.is_loaded_in_4bit = True
    model.is_quantized = True
    from transformers.quantizers.base import _assign_is_quantized

    _assign_is_quantized(model)


def quant_state_tensors(model) -> list:
    """Tensors real bnb layers keep outside parameters/buffers (``weight.quant_state`` constants, ``weight.SCB``)."""
    out = []
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            out += [t for t in (qs.absmax, qs.code, qs.offset) if t is not None]
            if qs.state2 is not None:
                out += [t for t in (qs.state2.absmax, qs.state2.code) if t is not None]
        if getattr(p, "SCB", None) is not None:
            out.append(p.SCB)
    return out


def quantized_storage_bytes(model: Any, granularity: int = 1) -> int:
    """Bytes of every distinct storage a (real or stand-in) quantized model holds: parameters, buffers and the
    tensors of bnb ``quant_state``/``SCB`` attributes. ``granularity`` rounds each storage (512 = CUDA allocator)."""
    import torch

    from oomdoctor.execute.tracking import round_bytes

    seen: dict[int, int] = {}

    def add(t):
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen.setdefault(st._cdata, round_bytes(st.nbytes(), granularity))

    for p in model.parameters():
        add(p)
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            for v in (qs.absmax, qs.code, qs.offset):
                add(v)
            if qs.state2 is not None:
                add(qs.state2.absmax)
                add(qs.state2.code)
        add(getattr(p, "SCB", None))
    for b in model.buffers():
        add(b)
    return sum(seen.values())


__all__ = [
    "quantize_model_standin",
    "quantize_standin",
    "standin_classes",
    "quant_bytes_4bit",
    "quant_bytes_int8",
    "quantized_storage_bytes",
    "GEMM_4BIT_CUSTOM_MAX_M",
]


def quantize_model_real(model, plan, *, device: str = "cuda", std: float = 0.02) -> int:
    """Replace every module transformers' bitsandbytes loading replaces (:func:`bnb_targets`) by a REAL bitsandbytes
    layer quantized from random weights on ``device`` (one layer at a time, so the full-precision model never exists
    on the device). For the measured engine and scripts/validate_gpu.py on a CUDA GPU; ``model`` may live on the
    meta device."""
    import torch

    bnb = _bnb()
    from oomdoctor.execute.dtypes import torch_dtype

    compute = torch_dtype(plan.compute_dtype)
    targets = bnb_targets(model)
    for name, child in targets:
        fin, fout = linear_features(child)
        w = torch.empty(fout, fin, dtype=torch.float16, device=device).normal_(0, std)
        if plan.quant == "int8":
            new = bnb.nn.Linear8bitLt(
                fin, fout, child.bias is not None, has_fp16_weights=False, threshold=INT8_THRESHOLD, device="meta"
            )
            new.weight = bnb.nn.Int8Params(w.cpu(), requires_grad=False, has_fp16_weights=False)
        else:
            new = bnb.nn.Linear4bit(
                fin,
                fout,
                child.bias is not None,
                compute_dtype=compute,
                compress_statistics=plan.double_quant,
                quant_type=plan.quant,
                quant_storage=torch.uint8,
                device="meta",
            )
            new.weight = bnb.nn.Params4bit(
                w.to(compute),
                requires_grad=False,
                compress_statistics=plan.double_quant,
                quant_type=plan.quant,
                quant_storage=torch.uint8,
                module=new,
            )
        del w
        if child.bias is not None:
            new.bias = torch.nn.Parameter(torch.zeros(fout, device=device), requires_grad=False)
        model.set_submodule(name, new.to(device))  # bnb quantizes on the move to the device
    _mark_quantized(model, plan.quant)
    return len(targets)
