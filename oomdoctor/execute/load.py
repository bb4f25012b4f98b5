"""Load the model and tokenizer a real run trains (weights from disk, or random weights of a config's shape).

Efficient init (Lightning Fabric ``init_module`` / HF ``from_pretrained`` semantics), never a full fp32 copy first:

- ``init: pretrained``: ``AutoModelForCausalLM.from_pretrained(path, dtype=<weight dtype>,
  device_map={"": "cuda:0"|"cpu"}, quantization_config=...)`` loads the checkpoint straight into the target
  dtype on the target device (transformers 5 builds on meta and materializes each tensor once).
- ``init: random``: ``AutoModelForCausalLM.from_config(config, dtype=...)`` under ``with torch.device(device):``
  allocates every parameter directly on the device in the target dtype. With a bitsandbytes base (QLoRA smoke
  runs) the random model is built in the compute dtype on the CPU, saved to a temporary directory and loaded back
  through ``from_pretrained(quantization_config=...)`` — the path real QLoRA runs take (known cost: one CPU copy
  in the compute dtype; only for random-init smoke runs).
- A vision-language model transformers has no causal-LM class for (Qwen2.5-VL, LLaVA...) is loaded the same way
  through ``AutoModelForImageTextToText`` (``model/inventory.auto_model_class``) and trained on text: its towers
  frozen, never run.

Then the plan's techniques exactly as the simulated build applies them
(:func:`oomdoctor.execute.build.apply_plan_techniques`: k-bit preparation, gradient checkpointing, LoRA).
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oomdoctor.errors import BadInput, NoGPU
from oomdoctor.execute.build import experts_kwargs

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from oomdoctor.plan import Plan


@dataclass(frozen=True)
class ModelSource:
    """Where a real run's model comes from (``oomdoctor train``'s ``model:`` section)."""

    path: str | None = None
    """Weights directory (``init: pretrained``)."""
    config: str | None = None
    """Config reference for ``init: random`` (bundled id, config.json or a directory)."""
    init: str = "pretrained"
    """``pretrained`` or ``random``."""
    tokenizer: str | None = None
    """Tokenizer directory or file (default: ``path``)."""


def quiet_hf() -> None:
    """Silence progress bars and deprecation chatter of transformers/bitsandbytes in training logs."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    warnings.filterwarnings("ignore", message=".*MatMul8bitLt.*")
    warnings.filterwarnings("ignore", message=".*inputs will be cast.*")
    warnings.filterwarnings("ignore", message=".*Could not find a config file.*")  # peft save of a random-init base


def resolve_device(preference: str) -> "torch.device":
    """``cpu``, ``cuda`` (refused without a visible GPU) or ``auto`` (the current CUDA device, else the CPU)."""
    import torch

    if preference == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if preference == "cuda":
        raise NoGPU("device: cuda but no CUDA GPU is visible", "set device: auto (CPU) or run on a GPU machine")
    return torch.device("cpu")


def load_tokenizer(source: ModelSource):
    """The tokenizer (``source.tokenizer``, else the weights directory); pad = EOS (or UNK) when it has none."""
    from transformers import AutoTokenizer

    src = source.tokenizer or source.path
    try:
        tok = AutoTokenizer.from_pretrained(src)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad path
        raise BadInput(
            f"cannot load the tokenizer from {src!r}: {exc}",
            "set model.tokenizer to a directory holding tokenizer.json",
        ) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    return tok


def hf_config(source: ModelSource):
    """transformers config of the model (from the weights dir, a config.json, a directory or a bundled id)."""
    from transformers import AutoConfig

    from oomdoctor.model.load import load_config

    if source.init == "pretrained":
        return AutoConfig.from_pretrained(source.path)
    raw, _, _ = load_config(source.config)
    raw = dict(raw)
    mt = raw.pop("model_type", None)
    if mt is None:
        raise BadInput(f"model.config {source.config}: no model_type in the config")
    for k in ("transformers_version", "_name_or_path", "architectures", "torch_dtype", "dtype"):
        raw.pop(k, None)
    return AutoConfig.for_model(mt, **raw)


def bnb_config(plan: "Plan", compute_dtype: str | None = None):
    """transformers ``BitsAndBytesConfig`` for the plan's quantization (None without one)."""
    if plan.quant is None:
        return None
    from transformers import BitsAndBytesConfig

    from oomdoctor.execute.dtypes import torch_dtype

    if plan.quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=plan.quant,
        bnb_4bit_use_double_quant=plan.double_quant,
        bnb_4bit_compute_dtype=torch_dtype(compute_dtype or plan.compute_dtype),
    )


def hf_attn_implementation(plan: "Plan") -> str:
    """transformers ``attn_implementation`` of a real run (``flash`` = flash-attn 2)."""
    return {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}[plan.attn]


@dataclass
class LoadedModel:
    """A real model with the plan's techniques applied."""

    model: Any
    """The torch module (a ``PeftModel`` for LoRA/QLoRA)."""
    trainable: list
    """Parameters that require grad, in model order."""
    num_params: int
    """Elements of every parameter (quantized ones counted as stored)."""
    num_trainable: int
    """Elements of the trainable parameters."""
    is_peft: bool
    """True for LoRA/QLoRA (the model is a ``PeftModel``)."""


def _from_pretrained(path: str, plan: "Plan", device: "torch.device", qconf):
    from transformers import AutoConfig

    from oomdoctor.execute.dtypes import weight_dtype
    from oomdoctor.model.inventory import auto_model_class

    hcfg = AutoConfig.from_pretrained(path)
    return auto_model_class(hcfg).from_pretrained(
        path,
        dtype=weight_dtype(plan),
        device_map={"": str(device)},
        quantization_config=qconf,
        attn_implementation=hf_attn_implementation(plan),
        **experts_kwargs(plan, hcfg),
    )


def _from_config(hcfg, plan: "Plan", device: "torch.device | str"):
    """The plan's transformers model from a config on ``device`` (``meta``: no memory) in the plan's weight dtype,
    attention and MoE experts kernels: the one ``from_config`` of real loads (random init, the sharded build)."""
    import torch

    from oomdoctor.execute.dtypes import weight_dtype
    from oomdoctor.model.inventory import auto_model_class

    with torch.device(device):
        return auto_model_class(hcfg).from_config(
            hcfg,
            dtype=weight_dtype(plan),
            attn_implementation=hf_attn_implementation(plan),
            **experts_kwargs(plan, hcfg),
        )


def _random_model(
    source: ModelSource,
    plan: "Plan",
    device: "torch.device",
    qconf,
    vocab_size: int,
    seed: int,
    compute_dtype: str | None,
):
    import torch

    from oomdoctor.execute.dtypes import torch_dtype
    from oomdoctor.model.inventory import auto_model_class

    hcfg = hf_config(source)
    model_vocab = hcfg.get_text_config().vocab_size
    if vocab_size > model_vocab:
        raise BadInput(
            f"the tokenizer has {vocab_size} tokens but the model config's vocab_size is {model_vocab}",
            "use the model's own tokenizer or a config with a larger vocab",
        )
    hcfg.use_cache = False
    torch.manual_seed(seed)
    if qconf is None:
        return _from_config(hcfg, plan, device)
    with torch.device("cpu"):
        tmp_model = auto_model_class(hcfg).from_config(hcfg, dtype=torch_dtype(compute_dtype or plan.compute_dtype))
    tmp = tempfile.mkdtemp(prefix="oomdoctor-init-")
    try:
        tmp_model.save_pretrained(tmp)
        del tmp_model
        return _from_pretrained(tmp, plan, device, qconf)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_model(
    source: ModelSource,
    plan: "Plan",
    device: "torch.device",
    *,
    vocab_size: int = 0,
    seed: int = 0,
    compute_dtype: str | None = None,
) -> LoadedModel:
    """The model on ``device`` with every technique of ``plan`` applied (quantization, GC, LoRA).

    ``compute_dtype``: bitsandbytes 4-bit compute dtype when it differs from the plan's (``bnb_4bit_compute_dtype``)."""
    from oomdoctor.execute.build import apply_plan_techniques, lora_targets_of_model

    qconf = bnb_config(plan, compute_dtype)
    if source.init == "pretrained":
        try:
            model = _from_pretrained(source.path, plan, device, qconf)
        except OSError as exc:
            raise BadInput(
                f"cannot load model weights from {source.path!r}: {exc}",
                "model.path must hold config.json + *.safetensors (or use init: random)",
            ) from None
    else:
        model = _random_model(source, plan, device, qconf, vocab_size, seed, compute_dtype)
    model.config.use_cache = False
    try:
        model = apply_plan_techniques(model, plan, lora_targets_of_model(model, plan))
    except ValueError as exc:
        raise BadInput(
            f"target_modules: {exc}", "name modules of this model (q_proj, v_proj...) or all-linear"
        ) from None
    return _loaded(model, plan)


def _loaded(model, plan: "Plan") -> LoadedModel:
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise BadInput("no trainable parameters after applying the method", "check method / target_modules")
    return LoadedModel(
        model=model,
        trainable=trainable,
        num_params=sum(p.numel() for p in model.parameters()),
        num_trainable=sum(p.numel() for p in trainable),
        is_peft=plan.uses_lora,
    )


def load_sharded_model(
    source: ModelSource,
    plan: "Plan",
    device: "torch.device",
    mesh,
    *,
    is_main: bool,
    vocab_size: int = 0,
    seed: int = 0,
) -> LoadedModel:
    """The model FSDP2-sharded over ``mesh`` without a full copy on any device (torchtitan's / torchtune's recipe).

    Every rank builds the model on the meta device, applies the plan's techniques (GC, LoRA), shards it
    (:func:`oomdoctor.execute.shard.apply_fsdp`) and allocates only its shards (``to_empty``: on ``device``, or on
    the CPU with ``offload_params``). Rank 0 alone loads the model the way :func:`load_model` does, in host memory
    (the checkpoint, or the seeded random init, with LoRA's seeded adapters);
    ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` sends every rank its shards and the
    buffers (rotary frequencies, not in the state dict) are broadcast from rank 0 too: the weights equal a
    one-process load of the same seed. Known cost: one full copy in rank 0's host RAM during the load.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from oomdoctor.execute.build import apply_plan_techniques, lora_targets_of_model
    from oomdoctor.execute.shard import apply_fsdp

    full, buffers = None, [None]
    if is_main:
        ref = load_model(source, plan, torch.device("cpu"), vocab_size=vocab_size, seed=seed).model
        full, buffers = ref.state_dict(), [{n: b.detach() for n, b in ref.named_buffers()}]
        del ref
    hcfg = hf_config(source)
    hcfg.use_cache = False
    model = _from_config(hcfg, plan, "meta")
    model.config.use_cache = False
    model = apply_plan_techniques(model, plan, lora_targets_of_model(model, plan))
    apply_fsdp(model, plan, mesh, device.type)
    model.to_empty(device="cpu" if plan.offload_params else device)
    dist.broadcast_object_list(buffers, src=0)
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[0][n])
    set_model_state_dict(
        model,
        full if full is not None else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    del full
    return _loaded(model, plan)


__all__ = [
    "ModelSource",
    "LoadedModel",
    "load_model",
    "load_sharded_model",
    "load_tokenizer",
    "resolve_device",
    "quiet_hf",
    "hf_config",
    "bnb_config",
    "hf_attn_implementation",
]
