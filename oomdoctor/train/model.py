"""Build the model and tokenizer exactly as the plan says (ecosystem pieces: transformers, bitsandbytes, peft).

Efficient init (Lightning Fabric ``init_module`` / HF ``from_pretrained`` semantics), never a full fp32 copy first:

- ``init: pretrained``: ``AutoModelForCausalLM.from_pretrained(path, dtype=<weight dtype>,
  device_map={"": "cuda:0"|"cpu"}, quantization_config=...)`` loads the checkpoint straight into the target
  dtype on the target device (transformers 5 builds on meta and materializes each tensor once).
- ``init: random``: ``AutoModelForCausalLM.from_config(config, dtype=...)`` under ``with torch.device(device):``
  allocates every parameter directly on the device in the target dtype. With a bitsandbytes base (QLoRA smoke
  runs) the random model is built in the compute dtype on the CPU, saved to a temporary directory and loaded back
  through ``from_pretrained(quantization_config=...)`` — the path real QLoRA runs take (known cost: one CPU copy
  in the compute dtype; only for random-init smoke runs).

Then: ``prepare_model_for_kbit_training`` for a quantized base (it enables gradient checkpointing with
``use_reentrant=False`` when asked, and upcasts the non-quantized parameters to fp32, as peft documents),
otherwise ``activation_checkpointing_enable`` with ``use_reentrant=False``; then peft ``get_peft_model`` for LoRA.
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from dataclasses import dataclass

import torch

from oomdoctor.errors import BadInput, NoGPU
from oomdoctor.train.config import TrainConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def quiet_hf() -> None:
    """Silence progress bars and deprecation chatter of transformers/bitsandbytes in training logs."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    warnings.filterwarnings("ignore", message=".*MatMul8bitLt.*")
    warnings.filterwarnings("ignore", message=".*inputs will be cast.*")
    warnings.filterwarnings("ignore", message=".*Could not find a config file.*")  # peft save of a random-init base


def resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if cfg.device == "cuda":
        raise NoGPU("device: cuda but no CUDA GPU is visible", "set device: auto (CPU) or run on a GPU machine")
    return torch.device("cpu")


def weight_dtype(cfg: TrainConfig) -> torch.dtype:
    """Stored dtype of the (non-quantized) weights: bf16 for pure bf16, else fp32 (the AMP master copy)."""
    return torch.bfloat16 if cfg.precision == "bf16" else torch.float32


def autocast_dtype(cfg: TrainConfig) -> torch.dtype | None:
    return {"fp16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(cfg.precision)


def load_tokenizer(cfg: TrainConfig):
    from transformers import AutoTokenizer

    src = cfg.model.tokenizer or cfg.model.path
    try:
        tok = AutoTokenizer.from_pretrained(src)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad path
        raise BadInput(f"cannot load the tokenizer from {src!r}: {exc}",
                       "set model.tokenizer to a directory holding tokenizer.json") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    return tok


def hf_config(cfg: TrainConfig):
    """transformers config of the model (from the weights dir, a config.json, a directory or a bundled id)."""
    from transformers import AutoConfig

    from oomdoctor.model.load import load_config

    if cfg.model.init == "pretrained":
        return AutoConfig.from_pretrained(cfg.model.path)
    raw, _, _ = load_config(cfg.model.config)
    raw = dict(raw)
    mt = raw.pop("model_type", None)
    if mt is None:
        raise BadInput(f"model.config {cfg.model.config}: no model_type in the config")
    for k in ("transformers_version", "_name_or_path", "architectures", "torch_dtype", "dtype"):
        raw.pop(k, None)
    return AutoConfig.for_model(mt, **raw)


def _bnb_config(cfg: TrainConfig):
    if cfg.quant is None:
        return None
    from transformers import BitsAndBytesConfig

    if cfg.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=cfg.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=DTYPES[cfg.compute_dtype],
    )


def _linear_names(model) -> list[str]:
    """Leaf names of every linear layer (torch or bitsandbytes) — for ``all-linear`` + ``lm_head``."""
    names = set()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) or type(mod).__name__ in ("Linear4bit", "Linear8bitLt"):
            names.add(name.split(".")[-1])
    return sorted(names)


@dataclass
class BuiltModel:
    model: torch.nn.Module
    trainable: list[torch.nn.Parameter]
    num_params: int
    num_trainable: int
    is_peft: bool


def build_model(cfg: TrainConfig, device: torch.device, vocab_size: int) -> BuiltModel:
    """The model on ``device`` with every technique of ``cfg`` applied (quantization, GC, LoRA)."""
    from transformers import AutoModelForCausalLM

    wdtype = weight_dtype(cfg)
    qconf = _bnb_config(cfg)
    attn = cfg.model.attn_implementation
    if cfg.model.init == "pretrained":
        try:
            model = AutoModelForCausalLM.from_pretrained(
                cfg.model.path, dtype=wdtype, device_map={"": str(device)}, quantization_config=qconf,
                attn_implementation=attn,
            )
        except OSError as exc:
            raise BadInput(f"cannot load model weights from {cfg.model.path!r}: {exc}",
                           "model.path must hold config.json + *.safetensors (or use init: random)") from None
    else:
        hcfg = hf_config(cfg)
        if vocab_size > hcfg.vocab_size:
            raise BadInput(f"the tokenizer has {vocab_size} tokens but the model config's vocab_size is "
                           f"{hcfg.vocab_size}", "use the model's own tokenizer or a config with a larger vocab")
        hcfg.use_cache = False
        torch.manual_seed(cfg.seed)
        if qconf is None:
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(hcfg, dtype=wdtype, attn_implementation=attn)
        else:
            with torch.device("cpu"):
                tmp_model = AutoModelForCausalLM.from_config(hcfg, dtype=DTYPES[cfg.compute_dtype])
            tmp = tempfile.mkdtemp(prefix="oomdoctor-init-")
            try:
                tmp_model.save_pretrained(tmp)
                del tmp_model
                model = AutoModelForCausalLM.from_pretrained(
                    tmp, dtype=wdtype, device_map={"": str(device)}, quantization_config=qconf,
                    attn_implementation=attn,
                )
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    model.config.use_cache = False
    gc_kwargs = {"use_reentrant": False}
    if qconf is not None:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=cfg.gradient_checkpointing, gradient_checkpointing_kwargs=gc_kwargs
        )
    elif cfg.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=gc_kwargs)
        else:  # transformers < 5
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
    is_peft = cfg.method in ("lora", "qlora")
    if is_peft:
        from peft import LoraConfig, get_peft_model

        targets = list(cfg.target_modules)
        if "all-linear" in targets:
            rest = [t for t in targets if t != "all-linear"]
            if rest:  # peft accepts 'all-linear' only alone: expand it (all linears but the head) + the extras
                head = model.get_output_embeddings()
                head_names = {n.split(".")[-1] for n, m in model.named_modules() if m is head}
                targets = sorted({n for n in _linear_names(model) if n not in head_names} | set(rest))
            else:
                targets = "all-linear"  # type: ignore[assignment]
        lcfg = LoraConfig(r=cfg.r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=targets, task_type="CAUSAL_LM")
        try:
            # peft's default autocast_adapter_dtype=True keeps adapters in fp32 under every precision (the base
            # follows the plan's dtype); the memory engines price exactly this.
            model = get_peft_model(model, lcfg)
        except ValueError as exc:
            raise BadInput(f"target_modules: {exc}", "name modules of this model (q_proj, v_proj...) or all-linear") \
                from None
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise BadInput("no trainable parameters after applying the method", "check method / target_modules")
    model.train()
    return BuiltModel(
        model=model,
        trainable=trainable,
        num_params=sum(p.numel() for p in model.parameters()),
        num_trainable=sum(p.numel() for p in trainable),
        is_peft=is_peft,
    )


__all__ = ["build_model", "load_tokenizer", "resolve_device", "weight_dtype", "autocast_dtype", "quiet_hf",
           "BuiltModel", "DTYPES", "hf_config"]
