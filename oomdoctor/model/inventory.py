"""A :class:`ModelSpec` for any model transformers can build: the parameter inventory of the model transformers
itself builds on the meta device (no weights, no memory), for model types without a hand-written builder.

``architectures.py`` describes 15 families by hand (with their quirks cited). Every other ``model_type`` that
transformers knows — Qwen3-MoE, Gemma 3, gpt-oss, DeepSeek-V3, Cohere2, SmolLM3, GLM-4, GPT-NeoX, and the text side
of vision-language models with their vision tower — is read from ``AutoModelForCausalLM.from_config`` (or
``AutoModelForImageTextToText``: :func:`auto_model_class`) under ``torch.device("meta")``:

* every ``nn.Linear`` (and transformers' ``Conv1D``) becomes a ``linear`` group, grouped over the decoder layers by
  its path with the layer index replaced by ``{i}`` (so ``count`` = layers holding it: hybrid models that mix layer
  types are counted as built);
* ``nn.Embedding`` -> ``embedding``; modules whose class name ends in ``Norm`` -> ``norm``; every other parameter
  (fused 3D expert weights, routers, convolutions, SSM parameters, the vision tower's patch embedding...) ->
  ``other`` (not a LoRA ``all-linear`` target, not quantized);
* a multimodal model's towers (:func:`tower_prefixes`: every module outside the text decoder and the head, and
  Llama-3.2-Vision's image cross-attention layers) are ``tower`` groups: text-only training holds their weights but
  neither runs nor trains them;
* the head (``get_output_embeddings``) is ``lm_head``; tied embeddings are counted once, as torch does.

Shapes the activation formulas need come from the text config (``get_text_config``): hidden size, layers, heads,
KV heads, head dim, intermediate size (``moe_intermediate_size`` for MoE experts), experts and experts per token.
Known limits: activations are priced with the generic transformer block formulas (``memory/activations.py``), which
do not model state-space (Mamba) or linear-attention layers; multi-head latent attention (DeepSeek) is priced from
its projection shapes; images are not priced (text-only training: the towers' weights are, frozen).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from functools import lru_cache
from typing import Any

from oomdoctor.errors import BadInput
from oomdoctor.model.spec import ModelSpec, ParamGroup

#: Config keys holding the expert count and the experts each token visits, over the model families.
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k")
_LAYER_RE = re.compile(r"\.(layers|h|blocks|layer)\.(\d+)\.")


#: What to run next when transformers refuses a config (every refusal names the model kind and why).
_NEXT = "compare config.json with the model's published one; `oomdoctor models` lists the configs priced offline"
#: transformers' message for an optional package a module needs (``utils/import_utils.requires_backends``).
_MISSING_PACKAGE = re.compile(r"(\w+) requires the ([\w.\-]+) library but it was not found")
#: huggingface_hub's strict-dataclass validation of a config field (transformers 5.x configs).
_BAD_FIELD = re.compile(r"Validation error for field '(\w+)':\s*(?:\w+Error: )?(.*)", re.S)


def _transformers_version() -> str:
    from transformers import __version__

    return __version__


def _refused_config(name: str, mt: str, exc: Exception) -> BadInput:
    """transformers' refusal of the config itself, as one message: an unknown model kind, or a field it rejects."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    tv = _transformers_version()
    if mt not in CONFIG_MAPPING:
        import difflib

        close = difflib.get_close_matches(mt, list(CONFIG_MAPPING), n=5, cutoff=0.6)
        return BadInput(
            f"{name}: model kind {mt!r} is not supported: model_type {mt!r} is not a kind of model "
            f"transformers {tv} knows",
            (f"close model kinds transformers knows: {', '.join(close)}; " if close else "")
            + "check model_type in config.json; a model newer than transformers needs "
            "`pip install -U transformers`; models that need their own code (trust_remote_code) are not "
            "supported; `oomdoctor models` lists the configs priced offline",
        )
    field = _BAD_FIELD.search(str(exc))
    why = f"field {field.group(1)}: {' '.join(field.group(2).split())[:160]}" if field else _first_line(exc)
    return BadInput(
        f"{name}: this {mt!r} config is not supported: transformers {tv} refuses this {mt} config ({why})",
        (f"fix {field.group(1)} in config.json; " if field else "") + _NEXT,
    )


def _first_line(exc: Exception) -> str:
    text = " ".join(str(exc).strip().splitlines()[:1])
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__


def _refused_model(name: str, mt: str, exc: Exception) -> BadInput:
    """transformers' refusal to build the model of a config it read: a missing optional package (Gemma-3n's vision
    tower is timm's) says which and how to get it; anything else names the model kind and transformers' reason."""
    tv = _transformers_version()
    missing = _MISSING_PACKAGE.search(str(exc)) if isinstance(exc, ImportError) else None
    if missing:
        module, package = missing.groups()
        return BadInput(
            f"{name}: transformers needs the optional package {package!r} to build this {mt!r} model "
            f"(its {module} comes from {package}), and it is not installed",
            f"pip install {package} (then run again: oomdoctor prices every tower's weights); or price "
            "the language model alone: a config.json holding its text_config",
        )
    return BadInput(
        f"{name}: this {mt!r} config is not supported: transformers {tv} cannot build its model ({_first_line(exc)})",
        _NEXT,
    )


def transformers_config(cfg: dict, name: str):
    """The transformers config of ``cfg`` (a config.json's dict), as ``AutoConfig`` builds it; BadInput when
    transformers refuses it (:func:`_refused_config`): a ``model_type`` it does not know (a model newer than the
    installed transformers, or one that needs its own code), or values its config class rejects (the key and why, in
    one line)."""
    from transformers import AutoConfig

    mt = cfg["model_type"]
    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(mt, **kw)
    except Exception as exc:  # noqa: BLE001 - ValueError, KeyError, huggingface_hub's StrictDataclassError...
        raise _refused_config(name, mt, exc) from None


def auto_model_class(config):
    """The transformers auto class that builds ``config``: ``AutoModelForCausalLM`` when it maps the config's class,
    else ``AutoModelForImageTextToText`` (vision-language models whose text side transformers builds only inside the
    multimodal model: Qwen2.5-VL, Qwen3-VL, LLaVA, Mistral 3...), else ``AutoModelForCausalLM`` (whose error then
    says why). One rule for the inventory, the executor and real loads."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        if type(config) in auto._model_mapping:
            return auto
    return AutoModelForCausalLM


def _meta_model(config, name: str):
    import torch

    auto = auto_model_class(config)
    if type(config) not in auto._model_mapping:
        raise BadInput(
            f"{name}: model kind {config.model_type!r} is not supported: oomdoctor prices causal LMs (and "
            "the text side of vision-language models), and transformers has neither class for it",
            "pass the config of a causal LM (`oomdoctor models` lists the bundled ones)",
        )
    try:
        with torch.device("meta"):
            return auto.from_config(config)
    except Exception as exc:  # noqa: BLE001 - transformers' own refusal of this config
        raise _refused_model(name, config.model_type, exc) from None


def tower_prefixes(model) -> tuple[str, ...]:
    """Module paths of a multimodal model's towers — what a text-only step never runs: the top-most modules with
    parameters that hold neither the text decoder (``get_decoder()``) nor the output head (vision/audio encoders,
    projectors, connectors; none for a model whose config is its own text config), and the image cross-attention
    layers of Llama-3.2-Vision's decoder (``cross_attention_layers``: Meta's "vision adapter", skipped by
    ``MllamaTextModel`` without image states). The executor freezes them and keeps LoRA off them; the memory model
    prices their weights alone (:attr:`ParamGroup.tower`)."""
    config = getattr(model, "config", None)
    if config is None:
        return ()
    out: list[str] = []
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if config.get_text_config() is not config and decoder is not None and decoder is not model:
        keep = {id(m) for m in (decoder, model.get_output_embeddings()) if m is not None}

        def walk(mod, prefix: str) -> None:
            for name, child in mod.named_children():
                if id(child) in keep:
                    continue
                if any(id(m) in keep for m in child.modules()):
                    walk(child, f"{prefix}{name}.")
                elif next(child.parameters(), None) is not None:
                    out.append(f"{prefix}{name}")

        walk(model, "")
    text = config.get_text_config()
    adapter = getattr(text, "cross_attention_layers", None) or ()
    blocks = (
        next(
            (
                n
                for n, m in model.named_modules()
                if n.endswith("layers") and type(m).__name__ == "ModuleList" and len(m) == text.num_hidden_layers
            ),
            None,
        )
        if adapter
        else None
    )
    if blocks is not None:
        out += [f"{blocks}.{i}" for i in sorted(adapter) if i < text.num_hidden_layers]
    return tuple(out)


def bnb_quantized_paths(model) -> frozenset[str]:
    """Paths of the modules transformers' bitsandbytes integration replaces when it loads ``model`` in 4 or 8 bits
    (transformers 5.x ``quantizers/quantizer_bnb_4bit.py``/``_8bit.py``: ``replace_with_bnb_linear`` skipping
    ``get_modules_to_not_convert``): every module whose class is exactly ``nn.Linear`` (subclasses such as Falcon's
    ``FalconLinear`` are not replaced: QLoRA leaves them in the load dtype) or a ``Conv1D``, except the output
    embeddings, the weights tied to others, the module holding the model's last parameter and the model's
    ``_keep_in_fp32_modules`` (T5's ``wo``), with ``llm_int8_skip_modules`` unset as oomdoctor's
    ``BitsAndBytesConfig`` leaves it. The one rule for the inventory (``ParamGroup.quantizable``) and the
    executor's stand-ins (``execute/bnb_standin.py``)."""
    import torch
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = HfQuantizer.get_modules_to_not_convert(model, None, getattr(model, "_keep_in_fp32_modules", None))
    return frozenset(
        name
        for name, mod in model.named_modules()
        if (type(mod) is torch.nn.Linear or isinstance(mod, Conv1D)) and should_convert_module(name, skip)
    )


def in_tower(path: str, prefixes: tuple[str, ...]) -> bool:
    """True when the module or parameter at ``path`` is inside one of the towers ``prefixes``."""
    return any(path == t or path.startswith(t + ".") for t in prefixes)


def _kind(module: Any) -> str:
    cls = type(module).__name__
    if cls in ("Linear", "Conv1D") or cls.endswith("Linear"):
        return "linear"
    if cls == "Embedding" or cls.endswith("Embedding"):
        return "embedding"
    if cls.endswith(("Norm", "RMSNorm", "LayerNorm")):
        return "norm"
    return "other"


def towers_pattern(towers: tuple[str, ...]) -> str | None:
    """A regex ``re.fullmatch``-ing the module paths inside ``towers`` (peft ``exclude_modules``); None for none."""
    return f"({'|'.join(re.escape(t) for t in towers)})(\\..*)?" if towers else None


def text_side_targets(names: set[str], towers: tuple[str, ...]) -> str:
    """A peft ``target_modules`` regex (``re.fullmatch``) adapting the modules named ``names`` outside ``towers``:
    what ``all-linear`` with ``exclude_modules`` adapts, spelled for tools that have no ``exclude_modules`` (TRL's
    ``lora_target_modules``, axolotl's)."""
    outside = "|".join(re.escape(t) for t in towers)
    return rf"(?!(?:{outside})\.)(?:.*\.)?(?:{'|'.join(re.escape(n) for n in sorted(names))})"


def _groups(model, head_module, towers: tuple[str, ...]) -> tuple[tuple[ParamGroup, ...], int]:
    """The parameter groups of ``model`` (module docstring) and the number of decoder layers seen."""
    quantized = bnb_quantized_paths(model)
    seen: set[int] = set()  # parameters counted (tied weights once)
    agg: OrderedDict[tuple, dict] = OrderedDict()
    layers: set[str] = set()
    for path, mod in model.named_modules():
        own = [(n, p) for n, p in mod.named_parameters(recurse=False) if id(p) not in seen]
        if not own:
            continue
        for _n, p in own:
            seen.add(id(p))
        m = _LAYER_RE.search("." + path + ".")
        tower = in_tower(path, towers)
        per_layer = m is not None and not tower  # a vision/audio tower's blocks are not decoder layers
        if per_layer:
            layers.add(m.group(2))
        tmpl = _LAYER_RE.sub(lambda mm: f".{mm.group(1)}.{{i}}.", "." + path + ".").strip(".")
        leaf = path.rsplit(".", 1)[-1] or path
        kind = "linear" if mod is head_module else _kind(mod)
        if kind == "linear" and hasattr(mod, "weight") and mod.weight is not None and mod.weight.dim() == 2:
            w = mod.weight
            out_f, in_f = (w.shape[1], w.shape[0]) if type(mod).__name__ == "Conv1D" else (w.shape[0], w.shape[1])
            key = (
                "linear",
                tmpl,
                int(in_f),
                int(out_f),
                getattr(mod, "bias", None) is not None,
                tower,
                path in quantized,
            )
            name = "lm_head" if mod is head_module else leaf
            g = agg.setdefault(
                key,
                dict(
                    name=name,
                    kind="linear",
                    in_features=int(in_f),
                    out_features=int(out_f),
                    bias=key[4],
                    count=0,
                    per_layer=per_layer and mod is not head_module,
                    path=tmpl,
                    module=type(mod).__name__,
                    quantizable=path in quantized,
                    tower=tower,
                ),
            )
            g["count"] += 1
            extra = [p for n, p in own if n not in ("weight", "bias")]
            if extra:
                _add_other(agg, f"{tmpl}.extra", leaf, sum(p.numel() for p in extra), per_layer, tower=tower)
            continue
        if kind == "embedding":
            w = mod.weight
            key = ("embedding", tmpl, int(w.shape[0]), int(w.shape[1]), tower)
            g = agg.setdefault(
                key,
                dict(
                    name=leaf,
                    kind="embedding",
                    in_features=int(w.shape[0]),
                    out_features=int(w.shape[1]),
                    count=0,
                    per_layer=per_layer,
                    path=tmpl,
                    module=type(mod).__name__,
                    tower=tower,
                ),
            )
            g["count"] += 1
            continue
        direct = [(n, p) for n, p in own if n not in ("weight", "bias")]
        if kind != "norm" and direct:  # raw Parameters (fused MoE experts, routers): each at its own path (spec.py)
            for n, p in direct:
                _add_other(agg, f"{tmpl}.{n}", n, p.numel(), per_layer, tower=tower)
            own = [(n, p) for n, p in own if n in ("weight", "bias")]
            if not own:
                continue
        numel = sum(p.numel() for _n, p in own)
        if kind == "norm":
            key = ("norm", tmpl, numel, tower)
            g = agg.setdefault(
                key,
                dict(
                    name=leaf,
                    kind="norm",
                    numel_each=numel,
                    count=0,
                    per_layer=per_layer,
                    path=tmpl,
                    module=type(mod).__name__,
                    tower=tower,
                ),
            )
            g["count"] += 1
        else:
            _add_other(agg, tmpl, leaf, numel, per_layer, type(mod).__name__, tower=tower)
    return tuple(ParamGroup(**g) for g in agg.values()), len(layers)


def _add_other(
    agg, tmpl: str, leaf: str, numel: int, per_layer: bool, module: str = "Parameter", *, tower: bool = False
) -> None:
    key = ("other", tmpl, numel, tower)
    g = agg.setdefault(
        key,
        dict(
            name=leaf,
            kind="other",
            numel_each=numel,
            count=0,
            per_layer=per_layer,
            path=tmpl,
            module=module,
            tower=tower,
        ),
    )
    g["count"] += 1


def _peft_moe_conversion(model_type: str) -> str:
    """``ModelSpec.peft_moe_conversion``: the pattern peft's ``_convert_peft_config_moe`` applies to this model type
    ("" when none, or when the installed peft predates the conversion)."""
    try:
        from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN, _MOE_TARGET_MODULE_MAPPING
    except ImportError:
        return ""
    base = _MODEL_TO_CONVERSION_PATTERN.get(model_type)
    return base if base in _MOE_TARGET_MODULE_MAPPING else ""


def _value(tc, key: str) -> Any:
    """``tc.key`` as transformers' model reads it. A heterogeneous config (``per_layer_config``: Gemma 4's global
    layers have their own ``head_dim``) refuses a global read of a per-layer attribute
    (``AmbiguousGlobalPerLayerAttributeError``); its blocks read ``config.per_layer_config[i].key``: the largest
    value over the layers then (the widest block; the blocks themselves are measured, ``engines/blocks.py``)."""
    if key in (getattr(tc, "per_layer_attributes", None) or ()):
        values = [getattr(tc.per_layer_config[i], key, None) for i in range(tc.num_hidden_layers)]
        numbers = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        return max(numbers) if numbers else None
    return getattr(tc, key, None)


def _first(tc, keys: tuple[str, ...], default: Any = 0) -> Any:
    for k in keys:
        v = _value(tc, k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return default


def _top_k(tc, n_exp: int, name: str) -> int:
    """Experts each token visits: the config's top-k; 2 when it names none (a MoE config without any of
    ``TOP_K_KEYS``). A top-k key present but unset is refused: the router would call ``topk`` with ``k=None``
    (transformers' default DeepSeek-V2 config)."""
    if not n_exp:
        return 0
    k = _first(tc, TOP_K_KEYS, 0)
    if k:
        return k
    unset = [key for key in TOP_K_KEYS if key in tc.to_dict() and _value(tc, key) is None]
    if unset:
        raise BadInput(
            f"{name}: {unset[0]} is not set in this {n_exp}-expert config, and transformers' router "
            "cannot run without it (topk with k=None)",
            hint=f"set {unset[0]} in config.json: the experts each token is routed to",
        )
    return 2


def _built(cfg_items: tuple, name: str) -> ModelSpec:
    """The spec of the model transformers builds on the meta device from the config ``cfg_items[0]`` (JSON)."""
    import json

    cfg = json.loads(cfg_items[0])
    config = transformers_config(cfg, name)
    model = _meta_model(config, name)
    tc = config.get_text_config()
    head = model.get_output_embeddings()
    towers = tower_prefixes(model)
    groups, n_layers = _groups(model, head, towers)
    h = int(_first(tc, ("hidden_size", "d_model")))
    L = int(_first(tc, ("num_hidden_layers",), n_layers))
    nh = int(_first(tc, ("num_attention_heads",), 1))
    nkv = int(_first(tc, ("num_key_value_heads", "num_kv_heads", "n_head_kv"), nh))
    if _value(tc, "multi_query") and not _value(tc, "new_decoder_architecture"):
        nkv = 1  # multi-query attention (Falcon-7B style): one key/value head whatever num_kv_heads says
    hd = int(_first(tc, ("head_dim",), max(h // max(nh, 1), 1)))
    n_exp = _first(tc, EXPERT_KEYS)
    inter = _first(tc, ("moe_intermediate_size",) if n_exp else (), 0) or _first(
        tc, ("intermediate_size", "ffn_hidden_size", "n_inner"), 4 * h
    )
    act = str(_value(tc, "hidden_act") or _value(tc, "hidden_activation") or "")
    names = {g.name for g in groups}
    gated = bool(names & {"gate_proj", "gate_up_proj", "w1", "w3", "gate_up"}) or "glu" in act
    norm_kind = "rms" if any("RMS" in g.module for g in groups if g.kind == "norm") else "layer"
    sw = _value(tc, "sliding_window")
    tie = bool(getattr(config, "tie_word_embeddings", False) or _value(tc, "tie_word_embeddings"))
    return ModelSpec(
        name=name,
        model_type=cfg["model_type"],
        arch_kind="decoder",
        hidden_size=h,
        num_layers=L,
        num_heads=nh,
        num_kv_heads=nkv,
        head_dim=hd,
        intermediate_size=int(inter),
        vocab_size=int(_first(tc, ("vocab_size",))),
        groups=groups,
        mlp_kind="gated" if gated else "plain",
        norm_kind=norm_kind,
        parallel_attn=bool(_value(tc, "parallel_attn") or _value(tc, "use_parallel_residual")),
        num_experts=n_exp,
        experts_per_token=_top_k(tc, n_exp, name),
        tie_word_embeddings=tie,
        peft_moe_conversion=_peft_moe_conversion(cfg["model_type"]) if n_exp else "",
        max_position_embeddings=int(_first(tc, ("max_position_embeddings",))),
        sliding_window=sw if isinstance(sw, int) and not isinstance(sw, bool) else None,
        config=cfg,
        inventory="transformers",
        towers=towers,
    )


def spec_from_transformers(cfg: dict, name: str) -> ModelSpec:
    """The :class:`ModelSpec` of ``cfg`` from the model transformers builds on the meta device (cached in memory
    and on disk: :func:`_on_disk`)."""
    import json

    return _on_disk((json.dumps(cfg, sort_keys=True, default=str),), name)


#: Bump when what a spec holds changes: specs cached by another version are built again.
SPEC_CACHE_VERSION = 1


@lru_cache(maxsize=32)
def _on_disk(cfg_items: tuple, name: str) -> ModelSpec:
    """:func:`_built`, kept in oomdoctor's cache (``oomdoctor.cache``, kind ``specs``) by the config and the
    versions of transformers and torch that build the model (and of oomdoctor, that reads it): a later run reads the
    inventory instead of importing the model's code and building it (seconds)."""
    from dataclasses import asdict, replace

    from oomdoctor import cache

    libs = cache.versions("torch", "transformers")
    key = cache.key_of({"v": SPEC_CACHE_VERSION, "libs": libs, "config": cfg_items[0]})
    doc = cache.read_json("specs", key)
    if doc is not None:
        try:
            return _spec_of(doc, cfg_items, name)
        except (KeyError, TypeError, ValueError):  # damaged: built again
            pass
    spec = _built(cfg_items, name)
    cache.write_json("specs", key, {k: v for k, v in asdict(replace(spec, name="")).items() if k != "config"})
    return spec


def _spec_of(doc: dict, cfg_items: tuple, name: str) -> ModelSpec:
    import json

    groups = tuple(ParamGroup(**g) for g in doc.pop("groups"))
    towers = tuple(doc.pop("towers"))
    return ModelSpec(**{**doc, "name": name, "groups": groups, "towers": towers, "config": json.loads(cfg_items[0])})


__all__ = [
    "auto_model_class",
    "bnb_quantized_paths",
    "in_tower",
    "spec_from_transformers",
    "text_side_targets",
    "tower_prefixes",
    "towers_pattern",
]
