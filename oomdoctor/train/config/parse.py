"""Reading a train YAML: strict validation against :mod:`oomdoctor.train.config.schema`, every problem at once.

``load_train_config(path)`` reports every problem in one :class:`oomdoctor.errors.ConfigErrors`: unknown keys with a
did-you-mean, wrong types, bad values and inconsistent combinations, each naming its key. Besides the Hugging Face
names, every key of the ``settings`` that diagnose/tune print is accepted with the same meaning (the plan's
vocabulary: ``optimizer: adamw-8bit``, ``micro_batch``, ``lora_targets``, ``attn``, ``quant``...).
"""

from __future__ import annotations

import difflib
import math
import os
from pathlib import Path
from typing import Any

from oomdoctor.errors import BadInput, ConfigErrors
from oomdoctor.plan.techniques import (
    DEFAULTS,
    HF_ATTN_NAMES,
    HF_OPTIM_NAMES,
    OPTIM_VALUES,
    PAGED_OPTIMIZERS,
    TECHNIQUES,
    technique,
)
from oomdoctor.resources import bundled_path, is_bundled, resolve_path
from oomdoctor.train.config.schema import (
    DATASET,
    DATASET_ALIASES,
    KEYS_HINT,
    MODEL,
    PLAN_ONLY,
    PLAN_ONLY_KINDS,
    PRECISION_BOOLS,
    REPORT_TO,
    TOP,
    TOP_ALIASES,
    default,
)
from oomdoctor.train.config.sections import DatasetConfig, ModelConfig, TrainConfig
from oomdoctor.units import parse_size

_TOP_KINDS = {k.name: k.kind for k in TOP.values()}
_MODEL_KINDS = {k.name: k.kind for k in MODEL.values()}
_DATA_KINDS = {k.name: k.kind for k in DATASET.values()}


def _check_kind(key: str, value: Any, kind: Any, problems: list[str]) -> Any:
    """Return the normalized value or append a problem naming ``key``."""

    def bad(expect: str) -> None:
        problems.append(f"{key}: expected {expect}, got {value!r} ({type(value).__name__})")

    nullable = isinstance(kind, str) and kind.endswith("|null")
    if isinstance(kind, tuple):
        nullable = kind[0] == "choice|null"
    if value is None:
        if nullable:
            return None
        bad("a value (null is not allowed here)")
        return None
    base = kind[:-5] if isinstance(kind, str) and nullable else kind
    if isinstance(base, tuple):
        options = base[1]
        if value in options:
            return value
        close = difflib.get_close_matches(str(value), [str(o) for o in options], n=1, cutoff=0.5)
        dym = f" (did you mean {close[0]!r}?)" if close else ""
        problems.append(f"{key}: {value!r} is not one of {', '.join(map(str, options))}{dym}")
        return None
    if base == "bool":
        if isinstance(value, bool):
            return value
        bad("true or false")
        return None
    if base in ("int>=0", "int>=1", "int|auto"):
        if base == "int|auto" and value == "auto":
            return "auto"
        lo = 0 if base == "int>=0" else 1
        if isinstance(value, bool) or not isinstance(value, int):
            bad("an integer" + (" or 'auto'" if base == "int|auto" else ""))
            return None
        if value < lo:
            problems.append(f"{key}: must be >= {lo}, got {value}")
            return None
        return value
    if base in ("float", "float>=0", "prob"):
        if isinstance(value, str):
            try:  # YAML reads 2e-4 as a string (no dot in the mantissa): accept it
                value = float(value)
            except ValueError:
                bad("a number")
                return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            bad("a number")
            return None
        value = float(value)
        if not math.isfinite(value):
            problems.append(f"{key}: must be a finite number, got {value}")
            return None
        if base == "float>=0" and value < 0:
            problems.append(f"{key}: must be >= 0, got {value}")
            return None
        if base == "prob" and not 0 <= value < 1:
            problems.append(f"{key}: must be in [0, 1), got {value}")
            return None
        return value
    if base == "str":
        if isinstance(value, str) and value:
            return value
        bad("a non-empty string")
        return None
    if base == "str|list":
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
            return list(value)
        bad("a path or a list of paths")
        return None
    if base == "list[str]":
        if isinstance(value, str) and value:
            return [s.strip() for s in value.split(",") if s.strip()]
        if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
            return list(value)  # empty: checked where it matters (LoRA targets by the plan's validation)
        bad("a list of names (e.g. [q_proj, v_proj])")
        return None
    if base == "size":
        try:
            return parse_size(value, what=key)
        except BadInput as exc:
            problems.append(exc.message)
            return None
    raise AssertionError(kind)  # pragma: no cover - table error


def _unknown(key: str, known: list[str], section: str) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    where = f" in {section}" if section else ""
    dym = f"; did you mean {close[0]!r}?" if close else ""
    return f"{key}: unknown key{where}{dym}"


def _section(
    raw: Any,
    kinds: dict[str, Any],
    prefix: str,
    problems: list[str],
    aliases: dict[str, str] | None = None,
    extra_known: tuple[str, ...] = (),
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    aliases = aliases or {}
    known = list(kinds) + list(aliases) + list(extra_known)
    seen_from: dict[str, str] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            problems.append(f"{prefix}{key!r}: keys must be strings")
            continue
        if key in extra_known:
            continue
        canon = aliases.get(key, key)
        if canon not in kinds:
            problems.append(_unknown(f"{prefix}{key}", [f"{prefix}{k}" for k in known], ""))
            continue
        if canon in seen_from:
            if raw[seen_from[canon]] != value:
                problems.append(
                    f"{prefix}{key}: conflicts with {prefix}{seen_from[canon]} (same setting, different values)"
                )
            continue
        seen_from[canon] = key
        n_before = len(problems)
        v = _check_kind(prefix + key, value, kinds[canon], problems)
        if len(problems) == n_before:
            out[canon] = v
    return out


def _resolve_path(p: str, base_dirs: list[Path]) -> str | None:
    """``p`` resolved by :func:`oomdoctor.resources.resolve_path` (``bundled:...``, the current directory, the
    config's directory), or None."""
    return resolve_path(p, base_dirs)


def _looks_like_hub_id(p: str) -> bool:
    """``org/name`` (HF repo id syntax: letters, digits, ``-``, ``_``, ``.``), not a relative file path."""
    import re

    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", p)) and not p.endswith(
        (".json", ".yaml", ".yml", ".jsonl", ".safetensors", ".bin")
    )


def _apply_plan_only(
    given: dict[str, Any], top: dict[str, Any], model: dict[str, Any] | None, problems: list[str]
) -> None:
    """Translate the plan-vocabulary keys (``schema.PLAN_ONLY``) into the train keys that express them, reporting
    conflicts with those keys and values train cannot execute yet."""
    attn_keys = [k for k in ("attn", "attn_implementation") if k in given]
    if attn_keys:
        hf = {ours: hf for ours, hf in HF_ATTN_NAMES.items()}
        values = {k: hf.get(given[k], given[k]) for k in attn_keys}
        if len(set(values.values())) > 1:
            problems.append("attn: conflicts with attn_implementation (same setting, different values)")
        value = values[attn_keys[0]]
        if model is not None:
            if model.get("attn_implementation", value) != value:
                problems.append(
                    f"{attn_keys[0]}: {given[attn_keys[0]]!r} conflicts with model.attn_implementation "
                    f"{model['attn_implementation']!r}"
                )
            model["attn_implementation"] = value
    if "quant" in given:
        q = given["quant"]
        wanted = {"load_in_4bit": q in ("nf4", "fp4"), "load_in_8bit": q == "int8"}
        if q in ("nf4", "fp4"):
            wanted["bnb_4bit_quant_type"] = q
        for key, value in wanted.items():
            if key in top and top[key] != value:
                problems.append(f"quant: {q!r} conflicts with {key}: {top[key]!r}")
            top[key] = value
    if "lora_on_head" in given:
        mods = list(top.get("target_modules", DEFAULTS["lora_targets"]))
        if given["lora_on_head"] and "lm_head" not in mods:
            mods.append("lm_head")
        elif not given["lora_on_head"] and "lm_head" in mods:
            problems.append("lora_on_head: false conflicts with lm_head in target_modules")
        top["target_modules"] = mods
    for name in (t.name for t in TECHNIQUES if not t.train_executes):
        if name in given and given[name] != DEFAULTS[name]:
            problems.append(
                f"{name}: {given[name]!r}: train does not execute this yet (only "
                f"{DEFAULTS[name]!r}); diagnose/tune price it: {technique(name).help}"
            )


def parse_train_config(
    raw: Any, source: str = "config", base_dir: Path | None = None, check_paths: bool = True
) -> TrainConfig:
    """Validate a parsed YAML mapping into a :class:`TrainConfig` (every problem reported at once)."""
    problems: list[str] = []
    if not isinstance(raw, dict):
        raise ConfigErrors(source, [f"the top level must be a mapping of keys, got {type(raw).__name__}"])
    bases = [Path.cwd()] + ([base_dir] if base_dir else [])
    if raw.get("max_steps") == -1:  # HF's "unset"
        raw = {k: v for k, v in raw.items() if k != "max_steps"}
    if raw.get("report_to") in ("none", ["none"]):
        raw = {**raw, "report_to": []}
    top = _section(
        raw, _TOP_KINDS, "", problems, TOP_ALIASES, extra_known=("model", "dataset") + PRECISION_BOOLS + PLAN_ONLY
    )
    if top.get("optim") in HF_OPTIM_NAMES:  # the plan's own name (optimizer: adamw-8bit): written as HF's
        top["optim"] = HF_OPTIM_NAMES[top["optim"]]
    plan_only = _section({k: v for k, v in raw.items() if k in PLAN_ONLY}, PLAN_ONLY_KINDS, "", problems)

    # precision: ``precision`` or the HF booleans bf16/fp16 (mixed precision in HF).
    bools = {}
    for b in PRECISION_BOOLS:
        if b in raw:
            v = raw[b]
            if not isinstance(v, bool):
                problems.append(f"{b}: expected true or false, got {v!r}")
            else:
                bools[b] = v
    if bools.get("bf16") and bools.get("fp16"):
        problems.append("bf16 and fp16 are both true: choose one precision")
    implied = "bf16-mixed" if bools.get("bf16") else "fp16-mixed" if bools.get("fp16") else None
    if implied:
        explicit = top.get("precision")
        if explicit is not None and explicit != implied and not (explicit == "bf16" and implied == "bf16-mixed"):
            problems.append(f"precision: {explicit!r} conflicts with {'bf16' if bools.get('bf16') else 'fp16'}: true")
        elif explicit is None:
            top["precision"] = implied

    # sections
    model_raw = raw.get("model")
    model: dict[str, Any] = {}
    if model_raw is None:
        problems.append("model: missing; give model.path (weights) or model.config + init: random")
    elif isinstance(model_raw, str):
        model = {"path": model_raw}
    elif not isinstance(model_raw, dict):
        problems.append(f"model: expected a mapping (path/config/init/tokenizer), got {type(model_raw).__name__}")
    else:
        model = _section(model_raw, _MODEL_KINDS, "model.", problems)
    data_raw = raw.get("dataset")
    data: dict[str, Any] = {}
    if data_raw is None:
        problems.append("dataset: missing; give dataset.path (jsonl/json/text/parquet file or directory)")
    elif isinstance(data_raw, str):
        data = {"path": data_raw}
    elif not isinstance(data_raw, dict):
        problems.append(f"dataset: expected a mapping (path/format/packing/...), got {type(data_raw).__name__}")
    else:
        data = _section(data_raw, _DATA_KINDS, "dataset.", problems, DATASET_ALIASES)

    _apply_plan_only(plan_only, top, model if isinstance(model_raw, (dict, str)) else None, problems)

    # model consistency + paths
    init = model.get("init")
    if isinstance(model_raw, (dict, str)):
        if init is None:
            init = "random" if model.get("config") and not model.get("path") else "pretrained"
            model["init"] = init
        if init == "pretrained":
            if not model.get("path"):
                problems.append(
                    "model.path: missing (init: pretrained loads weights from it); or set model.config + init: random"
                )
            if model.get("config") and model.get("path"):
                problems.append("model.config: only used with init: random (model.path already gives the config)")
        else:
            if not model.get("config") and not model.get("path"):
                problems.append("model.config: missing (init: random builds the model from a config)")
            if not model.get("config") and model.get("path"):
                model["config"] = model.pop("path")
            if not model.get("tokenizer"):
                problems.append("model.tokenizer: required with init: random (no weights directory to take it from)")
        if check_paths:
            for k in ("path", "tokenizer"):
                p = model.get(k)
                if p:
                    res = _resolve_path(p, bases)
                    if res is not None:
                        model[k] = res
                    elif not (k == "path" and _looks_like_hub_id(p)):
                        problems.append(f"model.{k}: {p!r} does not exist")
            c = model.get("config")
            if c:
                res = _resolve_path(c, bases)
                if res is not None:
                    model["config"] = res
                else:
                    from oomdoctor.model.load import registry_entry

                    if registry_entry(c) is None:
                        problems.append(
                            f"model.config: {c!r} is neither a file/directory nor a bundled model id "
                            "(`oomdoctor models`)"
                        )
    if data and check_paths:
        if data.get("path") is None:
            problems.append("dataset.path: missing")
        for key in ("path", "eval_path"):
            p = data.get(key)
            if p is None:
                continue
            paths = [p] if isinstance(p, str) else p
            resolved = []
            for one in paths:
                res = _resolve_path(one, bases)
                if res is None:
                    problems.append(f"dataset.{key}: {one!r} does not exist")
                resolved.append(res or one)
            data[key] = resolved[0] if isinstance(p, str) else resolved
    elif data and data.get("path") is None:
        problems.append("dataset.path: missing")
    tmpl = data.get("chat_template")
    if tmpl and check_paths and tmpl != "chatml" and "{{" not in tmpl and "{%" not in tmpl:
        res = _resolve_path(tmpl, bases)
        if res is None or not Path(res).is_file():
            problems.append(f"dataset.chat_template: {tmpl!r} is neither a jinja template, chatml, nor a file")
        else:
            data["chat_template"] = res

    # combinations
    method = top.get("method", "full")
    l4, l8 = top.get("load_in_4bit", False), top.get("load_in_8bit", False)
    if l4 and l8:
        problems.append("load_in_4bit and load_in_8bit are both true: choose one")
    if method == "full" and (l4 or l8):
        problems.append(
            "method: full cannot train a bitsandbytes-quantized base (load_in_4bit/8bit); "
            "use method: qlora (LoRA adapters on the quantized base)"
        )
    if method == "lora" and (l4 or l8):
        top["method"] = "qlora"
    if method == "qlora" and not (l4 or l8):
        top["load_in_4bit"] = True
    if top.get("bnb_4bit_use_double_quant") and l8:
        problems.append("bnb_4bit_use_double_quant: applies to 4-bit only, not load_in_8bit")
    if top.get("precision") == "fp16-mixed" and top.get("bnb_4bit_compute_dtype") == "bfloat16":
        problems.append("bnb_4bit_compute_dtype: bfloat16 conflicts with precision fp16-mixed")
    mb = top.get("micro_batch_size", 1)
    gbs = top.get("global_batch_size")
    ga_given = "gradient_accumulation_steps" in top
    ws = top.get("world_size", 1) if isinstance(top.get("world_size", 1), int) else 1
    if gbs is not None and isinstance(mb, int):
        # global = micro x accumulation x world_size (the YAML's: a torchrun launch of another size is checked
        # when it runs)
        if ga_given:
            if mb * top["gradient_accumulation_steps"] * ws != gbs:
                problems.append(
                    f"global_batch_size: {gbs} != micro_batch_size {mb} x gradient_accumulation_steps "
                    f"{top['gradient_accumulation_steps']}"
                    + (f" x world_size {ws}" if ws > 1 else "")
                    + "; drop one of them"
                )
        elif gbs % (mb * ws):
            problems.append(
                f"global_batch_size: {gbs} is not a multiple of micro_batch_size {mb}"
                + (f" x world_size {ws}" if ws > 1 else "")
            )
        elif gbs < mb * ws:
            problems.append(
                f"global_batch_size: {gbs} is smaller than micro_batch_size {mb}"
                + (f" x world_size {ws}" if ws > 1 else "")
            )
        else:
            top["gradient_accumulation_steps"] = gbs // (mb * ws)
    if top.get("max_steps") is not None and top.get("warmup_steps", 0) > top["max_steps"]:
        problems.append(f"warmup_steps: {top['warmup_steps']} exceeds max_steps {top['max_steps']}")
    if top.get("max_steps") is None and top.get("num_train_epochs", 1.0) <= 0:
        problems.append("num_train_epochs: must be > 0 when max_steps is unset")
    bad_sinks = [r for r in top.get("report_to", []) if r not in REPORT_TO]
    if bad_sinks:
        problems.append(f"report_to: {', '.join(bad_sinks)} not supported; use {', '.join(REPORT_TO)}")
    if data.get("eval_split") is not None and data.get("eval_path") is not None:
        problems.append("dataset.eval_split and dataset.eval_path: give one of them")
    if data.get("eval_split") == 0:
        problems.append("dataset.eval_split: must be > 0 (or null: no eval)")
    optim = top.get("optim")
    if optim and OPTIM_VALUES[optim][1] and "optim_impl" in top and top["optim_impl"] != OPTIM_VALUES[optim][1]:
        problems.append(f"optim_impl: {top['optim_impl']!r} conflicts with optim {optim!r}")
    if top.get("optimizer_in_backward") and top.get("max_grad_norm", default("max_grad_norm")) is not None:
        problems.append(
            "optimizer_in_backward: gradient clipping needs every gradient at once; set "
            "max_grad_norm: null (torchtune does the same)"
        )
    if top.get("offload_optimizer") and optim and OPTIM_VALUES[optim][0] in PAGED_OPTIMIZERS:
        problems.append("offload_optimizer: paged optimizers already page state to the CPU; use one or the other")

    if problems:
        raise ConfigErrors(source, problems, KEYS_HINT)
    mcfg = ModelConfig(**model)
    dcfg = DatasetConfig(**data)
    cfg = TrainConfig(model=mcfg, dataset=dcfg, **top)
    # last gate: the memory model's own plan validation (names plan-level problems)
    if isinstance(cfg.micro_batch_size, int):
        try:
            cfg.to_plan()
        except BadInput as exc:
            raise ConfigErrors(source, [exc.message], exc.hint) from None
    return cfg


def load_train_config(path: str | os.PathLike) -> TrainConfig:
    """Read and validate a train YAML; raises :class:`ConfigErrors` listing every problem (exit 2)."""
    import yaml

    p = bundled_path(path) if is_bundled(str(path)) else Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise BadInput(
            f"cannot read {p}: {exc.strerror or exc}", "pass a train config such as configs/train/tiny-cpu.yaml"
        ) from None
    except UnicodeDecodeError:
        raise BadInput(
            f"{p} is not a text file (not UTF-8: binary?)", "pass a train YAML such as configs/train/tiny-cpu.yaml"
        ) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise BadInput(f"{p}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if raw is None:
        raise ConfigErrors(str(p), ["the file is empty"], "start from configs/train/tiny-cpu.yaml")
    return parse_train_config(raw, source=str(p), base_dir=p.resolve().parent)


__all__ = ["load_train_config", "parse_train_config"]
