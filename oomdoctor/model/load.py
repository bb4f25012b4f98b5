"""Load a :class:`ModelSpec` from a model reference.

``load_spec(MODEL)`` accepts a Hugging Face id (resolved offline from the bundled registry ``configs/models/``;
fetched from the hub, ``config.json`` only, when the hub is reachable), a local directory holding ``config.json``,
a path to a ``config.json``, or a bundled file (``bundled:tiny/model/config.json``, see :mod:`oomdoctor.resources`).
"""

from __future__ import annotations

import difflib
import json
import os
from functools import lru_cache
from pathlib import Path

from oomdoctor.errors import BadInput
from oomdoctor.model.spec import ModelSpec
from oomdoctor.resources import bundled_path, is_bundled, models_dir

#: Bundled configs: ``configs/models/<org>__<name>.json`` (a verbatim HF config.json) + ``registry.json`` (metadata).
MODELS_DIR = models_dir()


# ---------------------------------------------------------------------------------------------- registry


@lru_cache(maxsize=1)
def _registry() -> dict[str, dict]:
    path = MODELS_DIR / "registry.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {entry["id"]: entry for entry in data["models"]}


def bundled_ids() -> list[str]:
    """Ids of every bundled model config."""
    return sorted(_registry())


def registry_entry(model_id: str) -> dict | None:
    reg = _registry()
    if model_id in reg:
        return reg[model_id]
    low = model_id.lower()
    for k, v in reg.items():
        if k.lower() == low or low in [a.lower() for a in v.get("aliases", [])]:
            return v
    return None


def close_names(model_id: str, n: int = 5) -> list[str]:
    ids = bundled_ids()
    low = {i.lower(): i for i in ids}
    hits = difflib.get_close_matches(model_id.lower(), list(low), n=n, cutoff=0.4)
    short = {i.split("/")[-1].lower(): i for i in ids}
    hits += [short[h] for h in difflib.get_close_matches(model_id.split("/")[-1].lower(), list(short), n=n, cutoff=0.4)]
    out: list[str] = []
    for h in hits:
        name = low.get(h, h)
        if name not in out:
            out.append(name)
    return out[:n]


#: Spec fields ``oomdoctor models`` lists, stored per registry entry under ``listing`` (``listing_of``) so that listing
#: the registry reads one JSON file instead of building every spec (families without a builder go through
#: transformers: seconds each). ``scripts/registry_listing.py`` rewrites them; tests/test_bundled_configs.py checks
#: every one against ``load_spec``.
LISTING_FIELDS: dict[str, str] = {
    "model_type": "model_type",
    "arch_kind": "arch_kind",
    "params": "num_params",
    "layers": "num_layers",
    "hidden": "hidden_size",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "intermediate": "intermediate_size",
    "vocab": "vocab_size",
    "max_position": "max_position_embeddings",
    "tied_embeddings": "tie_word_embeddings",
    "experts": "num_experts",
}


#: Keys of a ``bundled_models`` row, in the order ``oomdoctor models --json`` prints them.
ROW_KEYS = (
    "id",
    "family",
    "model_type",
    "arch_kind",
    "params",
    "published_params",
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "intermediate",
    "vocab",
    "max_position",
    "tied_embeddings",
    "experts",
    "aliases",
)


def listing_of(spec: ModelSpec) -> dict:
    """The fields of ``spec`` that ``oomdoctor models`` lists (:data:`LISTING_FIELDS`)."""
    return {key: getattr(spec, attr) for key, attr in LISTING_FIELDS.items()}


def bundled_models(query: str | None = None) -> list[dict]:
    """One row per bundled model (what ``oomdoctor models`` prints), optionally filtered by a case-insensitive
    substring of the id, an alias, the family or the model_type. Reads the registry's precomputed ``listing``
    (an entry without one builds its spec)."""
    rows = []
    q = (query or "").lower()
    for model_id in bundled_ids():
        entry = _registry()[model_id]
        listing = entry.get("listing") or listing_of(load_spec(model_id))
        hay = [model_id, entry.get("family", ""), *entry.get("aliases", []), listing["model_type"]]
        if q and not any(q in h.lower() for h in hay):
            continue
        row = {"id": model_id, "family": entry.get("family", ""), **{k: listing[k] for k in LISTING_FIELDS}}
        row = dict(row, published_params=entry.get("published_params"), aliases=list(entry.get("aliases", [])))
        rows.append({k: row[k] for k in ROW_KEYS})
    return rows


# ---------------------------------------------------------------------------------------------- loading


def _read_config(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as exc:
        raise BadInput(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise BadInput(
            f"{path} is not a text file (not UTF-8: binary?)",
            "pass a Hugging Face config.json, a directory holding one, or a bundled id (`oomdoctor models`)",
        ) from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(
            f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
            "pass a Hugging Face config.json, a directory holding one, or a bundled id (`oomdoctor models`)",
        ) from None
    if not isinstance(cfg, dict):
        raise BadInput(f"{path} holds JSON but not an object; a Hugging Face config.json is an object")
    return decode_special_floats(cfg)


#: How transformers 5.x writes a float JSON cannot hold (``PreTrainedConfig._encode_special_floats``):
#: ``{"__float__": "Infinity"}`` (Mamba-2's ``time_step_limit`` = (0, inf)). transformers 4.x wrote Python's bare
#: ``Infinity``/``NaN`` literals, which ``json.loads`` reads as floats already.
FLOAT_TAG = "__float__"
FLOAT_TAG_VALUES = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def decode_special_floats(obj):
    """``obj`` with every ``{"__float__": "Infinity"}`` (``-Infinity``, ``NaN``) replaced by its float, as
    transformers' ``PreTrainedConfig._dict_from_json_file`` reads a config.json (``_decode_special_floats``)."""
    if isinstance(obj, dict):
        if set(obj) == {FLOAT_TAG} and obj[FLOAT_TAG] in FLOAT_TAG_VALUES:
            return FLOAT_TAG_VALUES[obj[FLOAT_TAG]]
        return {k: decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_special_floats(v) for v in obj]
    return obj


def _hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connection to the hub endpoint (``HF_ENDPOINT``), so an offline machine answers in seconds instead
    of waiting through huggingface_hub's retries (five, about 20 s, measured here)."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _fetch_from_hub(model_id: str) -> dict | None:
    """config.json of ``model_id`` from the hub (only that one file), or None when offline/unreachable.

    Tries the local Hugging Face cache first, then the hub when it is reachable. Raises BadInput when the hub
    answers definitively: no such repository, a gated repository without access, or no config.json in it.
    """
    if (
        os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        or os.environ.get("OOMDOCTOR_OFFLINE") == "1"
    ):
        return None
    if model_id.count("/") != 1 or any(not part for part in model_id.split("/")):
        return None
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, RepositoryNotFoundError
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return None
    path = None
    try:
        path = hf_hub_download(model_id, "config.json", local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the local cache (or a bad id): ask the hub below
        path = None
    if path is None:
        if not _hub_reachable():
            return None
        try:
            path = hf_hub_download(model_id, "config.json", etag_timeout=5)
        except GatedRepoError:
            raise BadInput(
                f"{model_id} is a gated repository on the Hugging Face hub and this machine has no access to it",
                "accept its license on huggingface.co and run `hf auth login`, or pass a local config.json",
            ) from None
        except RepositoryNotFoundError:
            close = close_names(model_id)
            raise BadInput(
                f"no model {model_id!r} on the Hugging Face hub (or it is private)",
                (f"close bundled names: {', '.join(close)}; " if close else "")
                + "check the id, log in (`hf auth login`) for a private repo, or pass a local config.json",
            ) from None
        except EntryNotFoundError:
            raise BadInput(
                f"{model_id} on the hub has no config.json (not a transformers model?)",
                "pass a local config.json, or a bundled id (`oomdoctor models`)",
            ) from None
        except Exception:  # noqa: BLE001 - network failure mid-way: treat as unreachable
            return None
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise BadInput(f"the config.json fetched for {model_id} is not valid JSON") from None
    if not isinstance(cfg, dict):
        raise BadInput(f"the config.json fetched for {model_id} is not a JSON object")
    return decode_special_floats(cfg)


def load_config(model: str) -> tuple[dict, str, dict | None]:
    """Resolve MODEL to (config dict, source, registry entry or None)."""
    p = bundled_path(model) if is_bundled(model) else Path(model).expanduser()
    if p.is_dir():
        cfg_path = p / "config.json"
        if not cfg_path.exists():
            raise BadInput(
                f"{p} is a directory without a config.json",
                "pass the model directory that holds config.json, or a bundled id (`oomdoctor models`)",
            )
        return _read_config(cfg_path), "local", None
    if p.suffix == ".json" or p.exists():
        if not p.exists():
            raise BadInput(f"{p}: no such file", "pass an existing config.json, or a bundled id (`oomdoctor models`)")
        return _read_config(p), "local", None
    entry = registry_entry(model)
    if entry is not None:
        return _read_config(MODELS_DIR / entry["file"]), "bundled", entry
    cfg = _fetch_from_hub(model)
    if cfg is not None:
        return cfg, "hub", None
    close = close_names(model)
    hint = (
        f"close bundled names: {', '.join(close)}"
        if close
        else "run `oomdoctor models` for the bundled ids, or pass a local config.json"
    )
    raise BadInput(
        f"unknown model {model!r}: not a local path, not in the bundled registry, and the hub is not reachable",
        hint + "; or pass a local directory / config.json",
    )


def spec_from_config(cfg: dict, name: str = "config", *, source: str = "local", entry: dict | None = None) -> ModelSpec:
    """Build a ModelSpec from a config dict (raises BadInput on missing/invalid fields)."""
    from oomdoctor.model.architectures import build_spec

    spec = build_spec(cfg, name=name)
    _check_attention_shapes(spec, cfg, name)
    if entry is not None or source != "local":
        from dataclasses import replace

        spec = replace(
            spec,
            source=source,
            family=(entry or {}).get("family", ""),
            published_params=(entry or {}).get("published_params"),
        )
    return spec


def _check_attention_shapes(spec: ModelSpec, cfg: dict, name: str) -> None:
    """The shape rules transformers itself enforces (its config validators / the attention's head split): a config
    it would refuse is refused here too, not priced."""
    h, nh, nkv = spec.hidden_size, spec.num_heads, spec.num_kv_heads
    problems = []
    if nh and not cfg.get("head_dim") and h % nh:
        problems.append(f"hidden size {h} is not a multiple of the number of attention heads {nh}")
    if nh and nkv and nh % nkv:
        problems.append(f"{nh} attention heads cannot be grouped over {nkv} key/value heads")
    if problems:
        raise BadInput(
            f"{name}: transformers cannot build this config: " + "; ".join(problems),
            "fix config.json (hidden_size, num_attention_heads, num_key_value_heads or head_dim)",
        )


@lru_cache(maxsize=64)
def load_spec(model: str) -> ModelSpec:
    """Resolve MODEL (HF id, directory or config.json) to a :class:`ModelSpec`."""
    cfg, source, entry = load_config(model)
    return spec_from_config(cfg, name=model, source=source, entry=entry)
