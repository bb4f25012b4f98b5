"""Build the Hugging Face model a plan trains, from a :class:`ModelSpec` alone (no weights).

Shared by the simulated engine (meta build, then materialized under ``FakeTensorMode``), the measured engine and
``scripts/validate_gpu.py`` (random init of the real shape on a GPU), the CPU cross-checks (a real tiny model) and
the ``train`` command. Importing this module has no side effects and does not import torch; every heavy import is
inside a function.

What :func:`build_model` applies, in the order a Hugging Face fine-tuning script does it:

1. ``AutoModelForCausalLM.from_config`` on ``device`` (``meta`` by default) in the plan's weight dtype
   (fp32 for ``fp32``/``*-mixed``: the fp32 weights are AMP's master copy; bf16 for ``bf16``) with the plan's
   attention implementation (``flash`` is built as ``sdpa``: on CPU the SDPA flash kernel stands in for
   flash-attn 2; both keep O(seq) state: the output and a log-sum-exp per head and row).
2. QLoRA / int8: every module transformers' bitsandbytes loading replaces (``model/inventory.bnb_quantized_paths``:
   ``nn.Linear``/``Conv1D`` but the head and what transformers keeps) becomes a bitsandbytes stand-in holding exactly
   the bytes bnb stores (``oomdoctor.execute.bnb_standin``); the model is flagged as transformers flags it
   (``is_loaded_in_4bit`` / ``is_loaded_in_8bit``, ``config._is_quantized``) so peft wraps the layers with its bnb
   LoRA classes.
3. :func:`apply_plan_techniques`, shared with real loads (``oomdoctor.execute.load``): k-bit preparation (or, with
   ``kbit_upcast: false``, only the freezing), gradient checkpointing (non-reentrant), peft LoRA, ``model.train()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from oomdoctor.errors import BadInput
from oomdoctor.model.execution import experts_implementation
from oomdoctor.model.inventory import EXPERT_KEYS
from oomdoctor.model.lora_targets import target_modules

if TYPE_CHECKING:  # pragma: no cover
    from oomdoctor.model.spec import ModelSpec
    from oomdoctor.plan import Plan

#: config.json keys that hold the number of transformer blocks, per convention.
LAYER_KEYS: tuple[str, ...] = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
#: Config keys listing one entry per block (the block kinds of hybrids and of alternating attention).
LAYER_LIST_KEYS: tuple[str, ...] = ("layer_types", "layers_block_type", "no_rope_layers")


@dataclass
class BuiltModel:
    """A model built for a plan, with what the step needs to know about it."""

    model: Any
    """The torch module (a ``PeftModel`` for LoRA/QLoRA)."""
    num_layers: int
    """Transformer blocks actually built (may be fewer than the spec's when extrapolating)."""
    dtype: Any
    """torch dtype of the unquantized weights."""
    compute_dtype: Any
    """torch dtype the matmuls run in (autocast dtype for ``*-mixed``)."""
    head_module: Any = None
    """The output head module (``lm_head``), for hooks that classify logits."""
    layer_modules: tuple = ()
    """The transformer block modules, in order."""
    attn_implementation: str = "sdpa"
    """Attention implementation actually built (``eager`` when the architecture has no SDPA path)."""


def config_with_layers(cfg: dict, num_layers: int | None) -> dict:
    """A deep copy of ``cfg`` with ``num_layers`` transformer blocks (per-layer lists such as ``layer_types``
    cut/extended periodically); a multimodal config's blocks are its ``text_config``'s. ``None`` keeps the original
    count. Deep: transformers edits nested dicts in place (it adds ``rope_theta`` to ``rope_scaling``), which would
    change the spec's config and with it every cache key derived from it (engines/blocks.py measured each block
    plan twice per process)."""
    from copy import deepcopy

    out = deepcopy(cfg)
    if num_layers is None:
        return out
    if isinstance(out.get("text_config"), dict) and not any(k in out for k in LAYER_KEYS):
        out["text_config"] = config_with_layers(out["text_config"], num_layers)
        return out
    found = False
    for k in LAYER_KEYS:
        if k in out:
            out[k] = num_layers
            found = True
    if not found:
        out["num_hidden_layers"] = num_layers
    for k in LAYER_LIST_KEYS:
        lt = out.get(k)
        if isinstance(lt, list) and lt:
            out[k] = [lt[i % len(lt)] for i in range(num_layers)]
    overrides = per_layer_overrides(cfg)
    if overrides:
        period = max(_layer_count(cfg), 1)
        out[PER_LAYER_KEY] = {str(i): overrides[i % period] for i in range(num_layers) if i % period in overrides}
    shared = out.get(KV_SHARED_KEY)
    if isinstance(shared, int) and shared and num_layers < _layer_count(cfg):
        # the first blocks of the model: those of its last blocks that reuse earlier keys/values and fall among them
        out[KV_SHARED_KEY] = max(0, num_layers - (_layer_count(cfg) - shared))
    return out


#: Gemma 3n/4: the last ``num_kv_shared_layers`` blocks reuse the keys and values of earlier blocks.
KV_SHARED_KEY = "num_kv_shared_layers"


#: transformers' heterogeneous configs: ``{"<layer index>": {attribute: value}}`` overriding the global attributes
#: of some blocks (Gemma 4's global-attention blocks: their own ``head_dim``; ``integrations/heterogeneity``).
PER_LAYER_KEY = "per_layer_config"


def per_layer_overrides(cfg: dict) -> dict[int, dict]:
    """The ``per_layer_config`` of a config dict by block index (empty when homogeneous)."""
    raw = cfg.get(PER_LAYER_KEY)
    if not isinstance(raw, dict):
        return {}
    return {int(k): dict(v) for k, v in raw.items() if str(k).isdigit() and isinstance(v, dict)}


def _layer_count(cfg: dict) -> int:
    return next((cfg[k] for k in LAYER_KEYS if isinstance(cfg.get(k), int)), 0)


def hf_config(spec: "ModelSpec", plan: "Plan", num_layers: int | None = None):
    """The transformers config object for ``spec`` (optionally with fewer layers)."""
    from transformers import AutoConfig

    cfg = config_with_layers(spec.config, num_layers)
    mt = cfg.pop("model_type", spec.model_type)
    for k in ("transformers_version", "architectures", "_name_or_path", "torch_dtype", "dtype", "quantization_config"):
        cfg.pop(k, None)
    try:
        config = AutoConfig.for_model(mt, **cfg)
    except Exception as exc:  # noqa: BLE001 - ValueError, KeyError, huggingface_hub's StrictDataclassError...
        raise BadInput(
            f"{spec.name}: transformers cannot build model_type {mt!r}: {exc}", "use --engine analytic for this model"
        ) from None
    config.use_cache = False
    return config


def attn_implementation(plan: "Plan") -> str:
    return {"eager": "eager", "sdpa": "sdpa", "flash": "sdpa"}[plan.attn]


@cache
def switchable_experts(model_type: str) -> bool:
    """Whether the causal-LM class of MoE ``model_type`` runs transformers' switchable experts kernels
    (``@use_experts_implementation``); MoE classes with their own experts code (Llama 4's batched experts) do not."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return False
    cls = AutoModelForCausalLM._model_mapping.get(CONFIG_MAPPING[model_type], None)
    return cls is not None and cls._can_set_experts_implementation()


def experts_kwargs(plan: "Plan", config) -> dict:
    """``experts_implementation=`` for ``from_config``/``from_pretrained`` of a MoE config whose experts use
    transformers' switchable kernels; dense models and MoE classes with their own experts code refuse it."""
    if not _num_experts(config) or not switchable_experts(config.model_type):
        return {}
    return {"experts_implementation": experts_implementation(plan)}


def runs_eager_experts(spec: "ModelSpec", plan: "Plan") -> bool:
    """Whether the plan's model runs transformers' eager experts (a matmul per expert over the tokens ``nonzero``
    picks: shapes that depend on the data, which fake tensors do not have)."""
    return bool(spec.num_experts) and experts_implementation(plan) == "eager" and switchable_experts(spec.model_type)


#: Leaf class names of the linear layers LoRA can adapt (torch, transformers' ``Conv1D`` — GPT-2's, a linear to peft's
#: all-linear: ``tuners_utils._maybe_include_all_linear_layers`` —, bitsandbytes; the bnb stand-ins subclass these).
_LINEAR_CLASSES = ("Linear", "Conv1D", "Linear4bit", "Linear8bitLt")


def _is_linear(mod) -> bool:
    import torch

    return isinstance(mod, torch.nn.Linear) or any(c.__name__ in _LINEAR_CLASSES[1:] for c in type(mod).__mro__)


def lora_targets_of_model(model, plan: "Plan") -> str | list[str]:
    """peft ``target_modules`` for the plan on a loaded model that comes without a spec (``execute/load``: real
    weights, random init): ``model/lora_targets.peft_target_modules`` — the rule :func:`build_model` applies to the
    spec — over the leaf names of the model's linear layers outside a multimodal tower, its output head found by
    ``get_output_embeddings``."""
    from oomdoctor.model.inventory import in_tower, tower_prefixes
    from oomdoctor.model.lora_targets import peft_target_modules

    model_type = getattr(getattr(model, "config", None), "model_type", "")
    towers = tower_prefixes(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    heads = {n.split(".")[-1] for n, m in model.named_modules() if head is not None and m is head}
    linears = {
        name.split(".")[-1]
        for name, mod in model.named_modules()
        if name and _is_linear(mod) and not in_tower(name, towers)
    }
    return peft_target_modules(plan, model_type, linears, heads)


def _num_experts(config) -> int:
    for key in EXPERT_KEYS:
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 1:
            return v
    return 0


def enable_gradient_checkpointing(model) -> None:
    """transformers' non-reentrant activation checkpointing (it also makes the input embeddings' output require
    grad, so checkpointed blocks of a frozen base see a grad-requiring input)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers < 5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def apply_plan_techniques(model, plan: "Plan", lora_targets: str | list[str]):
    """What a Hugging Face fine-tuning script does after loading, for every engine and ``train`` alike:

    * a quantized base with ``kbit_upcast`` (peft's QLoRA recipe): ``peft.prepare_model_for_kbit_training`` with
      ``use_gradient_checkpointing=False`` (GC is enabled below, as for every plan), which then does exactly two
      things (peft 0.21 ``utils/other.py``): freeze every parameter, and cast every fp16/bf16 parameter that is not
      a ``Params4bit`` (norms, embeddings, head, biases; int8 weights are int8) to fp32;
    * without the upcast (``kbit_upcast: false``: TRL's SFTTrainer, axolotl's
      ``skip_prepare_model_for_kbit_training``, unsloth) and for LoRA on an unquantized base: the base is frozen,
      nothing else (peft has no switch that skips only the cast; the input-grad hook it would add with GC is for
      reentrant checkpointing, and the non-reentrant GC below makes the input embeddings' output require grad
      itself);
    * gradient checkpointing (non-reentrant);
    * LoRA: peft ``get_peft_model`` with the plan's rank, alpha, dropout and ``lora_targets`` (peft's default
      ``autocast_adapter_dtype=True`` keeps the adapters in fp32 under every precision); ``adapter_dtype: bf16``
      then casts every trainable parameter to bf16, as TRL's SFTTrainer does for a quantized model (the QLoRA
      paper's recipe; peft's ``autocast_adapter_dtype=False`` does not reach adapters on a quantized base);
    * ``tiled_mlp``: every block's dense MLP runs over token tiles (``oomdoctor.execute.tiled``);
    * a multimodal model's towers (``model/inventory.tower_prefixes``: vision/audio encoders, projectors) are frozen
      and kept out of LoRA (peft ``exclude_modules``): text-only training never runs them (and DDP would refuse
      trainable parameters that get no gradient).

    Returns the (possibly peft-wrapped) model in train mode."""
    from oomdoctor.model.inventory import in_tower, tower_prefixes, towers_pattern

    towers = tower_prefixes(model)
    if plan.upcasts_kbit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False, auto_clear_cache=False)
    elif plan.uses_lora:
        for p in model.parameters():
            p.requires_grad_(False)
    for name, p in model.named_parameters():
        if in_tower(name, towers):
            p.requires_grad_(False)
    if plan.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if plan.uses_lora:
        from peft import LoraConfig, get_peft_model

        lcfg = LoraConfig(
            r=plan.lora_r,
            lora_alpha=plan.lora_alpha,
            lora_dropout=plan.lora_dropout,
            target_modules=lora_targets,
            exclude_modules=towers_pattern(towers),
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lcfg)
        if plan.adapter_dtype == "bf16":
            import torch

            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
    if plan.tiled_mlp:
        from oomdoctor.execute.tiled import tile_mlps

        tile_mlps(find_layers(model))
    model.train()
    return model


def _is_bnb(mod) -> bool:
    return type(mod).__module__.split(".")[0] == "bitsandbytes"


def _dense_of_bnb(base, dtype=None, deltas=()):
    """A plain ``nn.Linear`` holding the dequantized weight of bitsandbytes layer ``base`` (in ``dtype``; default the
    dtype bnb dequantizes to, the one it was quantized from) plus ``deltas``."""
    import torch
    from peft.utils.integrations import dequantize_bnb_weight

    state = getattr(base.weight, "quant_state", None)
    if state is None:
        state = getattr(base, "state", None)  # LLM.int8()
    elif getattr(state, "packing_format_for_cpu", False):
        # bitsandbytes repacks 4-bit weights for its CPU kernel at the first forward: undo it to dequantize
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        base.weight.data, state = _convert_weight_packed_for_cpu_inverse(base.weight.data, state)
        base.weight.quant_state = state
    with torch.no_grad():
        w = dequantize_bnb_weight(base.weight, state=state)
        w = w.to(dtype or w.dtype)
        for d in deltas:
            w += d.to(w.dtype)
        dense = torch.nn.Linear(
            base.in_features, base.out_features, bias=base.bias is not None, device=w.device, dtype=w.dtype
        )
        dense.weight.copy_(w)
        if base.bias is not None:
            dense.bias.copy_(base.bias.to(w.dtype))
    return dense


def save_merged(model, path) -> None:
    """Save a trained peft model with its LoRA adapters merged into the base as a plain transformers model in
    ``path``. A bitsandbytes 4-/8-bit layer is dequantized and gets its delta ``B @ A * scaling`` added in the
    adapter's dtype (an exact merge that loads without bitsandbytes, as axolotl's / TRL's QLoRA merge recipes do by
    reloading the base in 16 bits; peft's own 4-bit merge requantizes, with rounding); a bitsandbytes layer no
    adapter adapts (targets other than all-linear, a multimodal tower) is dequantized alone; other layers go through
    peft's ``merge_and_unload``. Consumes ``model``."""
    import torch
    from peft.tuners.lora import LoraLayer

    def replace(name: str, module) -> None:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module)

    for name, mod in list(model.named_modules()):
        if isinstance(mod, LoraLayer) and _is_bnb(mod.get_base_layer()):
            adapters = [a for a in mod.active_adapters if a in mod.lora_A]
            dtype = mod.lora_A[adapters[0]].weight.dtype if adapters else torch.float32
            replace(name, _dense_of_bnb(mod.get_base_layer(), dtype, [mod.get_delta_weight(a) for a in adapters]))
    for name, mod in list(model.named_modules()):
        if _is_bnb(mod) and hasattr(mod, "in_features"):
            replace(name, _dense_of_bnb(mod))
    merged = model.merge_and_unload()
    for attr in ("is_loaded_in_4bit", "is_loaded_in_8bit", "is_quantized"):
        if getattr(merged, attr, False):
            setattr(merged, attr, False)
    merged.hf_quantizer = None
    if getattr(merged.config, "quantization_config", None) is not None:
        del merged.config.quantization_config
    merged.save_pretrained(path, safe_serialization=True)


def build_model(
    spec: "ModelSpec",
    plan: "Plan",
    *,
    device: str = "meta",
    num_layers: int | None = None,
    quant_standin: bool = True,
    seed: int | None = None,
    bnb_decompose: bool = True,
    real_quant_device: str | None = None,
) -> BuiltModel:
    """Build the model of ``spec`` as ``plan`` trains it (see the module docstring for the steps).

    ``device="meta"`` (no memory; materialize later with ``model.to_empty(device=...)``), ``"cpu"`` or ``"cuda"``
    (random init of the real shape). ``num_layers`` overrides the number of transformer blocks (extrapolation).
    ``real_quant_device="cuda"`` (with ``device="meta"``): real bitsandbytes layers quantized from random weights on
    that device, every other parameter materialized there (GPU measurements).
    ``quant_standin=False`` skips the bitsandbytes replacement (for callers that load a real bnb model themselves);
    ``bnb_decompose=False`` makes 4-bit stand-ins call bnb's fused ``gemm_4bit`` op as bnb does on CPU (the CUDA
    dequantize temporary is then inside the op, not counted).
    """
    import torch

    from oomdoctor.execute.dtypes import torch_dtype, weight_dtype
    from oomdoctor.model.inventory import auto_model_class

    if spec.arch_kind != "decoder":
        raise BadInput(
            f"{spec.name}: building {spec.arch_kind} models for a real/simulated step is not supported yet",
            "use --engine analytic for this model",
        )
    config = hf_config(spec, plan, num_layers)
    dtype = weight_dtype(plan)
    compute = torch_dtype(plan.compute_dtype)
    if seed is not None:
        torch.manual_seed(seed)
    prev_default = torch.get_default_dtype()
    attn = attn_implementation(plan)
    auto = auto_model_class(config)
    try:
        try:
            with torch.device(device):
                model = auto.from_config(config, dtype=dtype, attn_implementation=attn, **experts_kwargs(plan, config))
        except ValueError as exc:
            if attn == "eager" or "attention implementation" not in str(exc):
                raise
            # the architecture has no SDPA path (e.g. Gemma 2 with soft-capping): transformers uses eager
            attn = "eager"
            with torch.device(device):
                model = auto.from_config(config, dtype=dtype, attn_implementation=attn, **experts_kwargs(plan, config))
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for unsupported configs
        raise BadInput(
            f"{spec.name}: transformers could not build the model ({type(exc).__name__}: {exc})",
            "use --engine analytic for this model",
        ) from None
    finally:
        torch.set_default_dtype(prev_default)

    if plan.quant is not None and real_quant_device is not None:
        # a real GPU run: real bnb layers quantized from random weights, the rest materialized there
        from oomdoctor.execute.bnb_standin import quantize_model_real

        quantize_model_real(model, plan, device=real_quant_device)
        materialize_meta(model, real_quant_device)
    elif plan.quant is not None and quant_standin:
        from oomdoctor.execute.bnb_standin import quantize_model_standin

        quantize_model_standin(model, plan, device=device, decompose=bnb_decompose)

    model = apply_plan_techniques(model, plan, target_modules(spec, plan))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = getattr(base, spec.head_name, None) or (
        base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    )
    layers = find_layers(base)
    return BuiltModel(
        attn_implementation=attn,
        model=model,
        num_layers=len(layers) if layers else (num_layers or spec.num_layers),
        dtype=dtype,
        compute_dtype=compute,
        head_module=head,
        layer_modules=tuple(layers),
    )


def materialize_meta(model, device: str, std: float = 0.02) -> None:
    """Give every meta parameter/buffer real storage on ``device`` (random normal weights, ones for norms); keeps
    tied weights tied (shared Parameter objects are materialized once)."""
    import torch

    done: dict[int, torch.nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            if id(p) not in done:
                t = torch.empty(p.shape, dtype=p.dtype, device=device)
                with torch.no_grad():
                    t.fill_(1.0) if p.dim() == 1 else t.normal_(0, std)
                done[id(p)] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
            mod._parameters[name] = done[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None and b.device.type == "meta":
                mod._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)
    # rotary inv_freq and similar computed buffers: let transformers recompute them where it can
    for mod in model.modules():
        if hasattr(mod, "rope_init_fn") and hasattr(mod, "inv_freq") and hasattr(mod, "config"):
            try:
                inv_freq, _ = mod.rope_init_fn(mod.config, torch.device(device))
                mod.inv_freq = inv_freq
                if hasattr(mod, "original_inv_freq"):
                    mod.original_inv_freq = inv_freq
            except Exception:  # noqa: BLE001 - values do not matter for memory
                pass


def find_layers(model) -> list:
    """The decoder's transformer blocks: its ``layers`` list when it has one (not a longer list elsewhere, such as a
    vision tower's blocks or per-expert modules), else the model's biggest ``ModuleList``."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        return list(layers)
    best: list = []
    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > len(best):
            best = list(mod)
    return best


def make_batch(spec: "ModelSpec", plan: "Plan", device: str = "cpu", *, fake_ok: bool = True) -> dict:
    """A training batch of the plan's shape: ``input_ids`` and ``labels`` (micro_batch x seq_len, int64), no padding
    mask (padding-free batches: the SDPA path runs causal without a mask tensor, as packed/padded-to-length batches
    with all-ones masks do)."""
    import torch

    shape = (plan.micro_batch, plan.seq_len)
    ids = torch.zeros(shape, dtype=torch.long, device=device)
    if not fake_ok:
        ids = torch.randint(0, spec.vocab_size, shape, device=device)
    return {"input_ids": ids, "labels": ids.clone()}


__all__ = [
    "BuiltModel",
    "build_model",
    "find_layers",
    "materialize_meta",
    "make_batch",
    "config_with_layers",
    "hf_config",
    "lora_targets_of_model",
    "apply_plan_techniques",
    "enable_gradient_checkpointing",
]
