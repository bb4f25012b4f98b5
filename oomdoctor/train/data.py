"""Training data: local jsonl / json / text / parquet files -> tokenized samples -> deterministic batches.

Samples are ``(input_ids, labels)`` lists; ``labels`` is ``-100`` where no loss is taken (the prompt of
prompt/response pairs, padding). With ``packing`` every sample is a full ``seq_len`` block cut from the
concatenated stream (samples are not isolated from each other inside a block: plain concatenation packing,
as HF ``group_texts``); otherwise samples are truncated to ``seq_len`` and each micro-batch is padded
dynamically to its longest sample (right padding).

The order is a pure function of ``(seed, samples consumed)``: epoch ``e`` is a permutation drawn from a generator
seeded with ``seed + e``, so a checkpoint only has to store the number of samples consumed to resume exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from oomdoctor.errors import BadInput
from oomdoctor.train.config import DatasetConfig

IGNORE = -100
_EXT_FORMAT = {".jsonl": "jsonl", ".json": "json", ".txt": "text", ".text": "text", ".parquet": "parquet"}


def _files(dcfg: DatasetConfig) -> list[Path]:
    paths = [dcfg.path] if isinstance(dcfg.path, str) else list(dcfg.path or [])
    out: list[Path] = []
    for p in paths:
        pp = Path(p)
        if pp.is_dir():
            out += sorted(f for f in pp.iterdir() if f.suffix in _EXT_FORMAT)
        else:
            out.append(pp)
    if not out:
        raise BadInput(f"dataset.path {dcfg.path!r}: no data files (.jsonl .json .txt .parquet)")
    return out


def _format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    f = _EXT_FORMAT.get(path.suffix)
    if f is None:
        raise BadInput(f"dataset: cannot tell the format of {path} from its extension",
                       "set dataset.format: jsonl | json | text | parquet")
    return f


def load_records(dcfg: DatasetConfig) -> list[dict]:
    """Every record of every file, as dicts (text lines become ``{text_field: line}``)."""
    records: list[dict] = []
    for path in _files(dcfg):
        fmt = _format(path, dcfg.format)
        try:
            if fmt == "jsonl":
                for i, line in enumerate(path.read_text().splitlines(), 1):
                    if line.strip():
                        try:
                            records.append(json.loads(line))
                        except json.JSONDecodeError as exc:
                            raise BadInput(f"{path}:{i}: not valid JSON ({exc.msg})") from None
            elif fmt == "json":
                data = json.loads(path.read_text())
                if isinstance(data, dict):  # {"data": [...]} / {"train": [...]}
                    lists = [v for v in data.values() if isinstance(v, list)]
                    data = lists[0] if len(lists) == 1 else None
                if not isinstance(data, list):
                    raise BadInput(f"{path}: expected a JSON list of records")
                records += data
            elif fmt == "text":
                records += [{dcfg.text_field: line} for line in path.read_text().splitlines() if line.strip()]
            elif fmt == "parquet":
                try:
                    import pyarrow.parquet as pq
                except ImportError:  # pragma: no cover - pyarrow is a dev dependency
                    raise BadInput("reading parquet needs pyarrow: pip install pyarrow") from None
                try:
                    records += pq.read_table(path).to_pylist()
                except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid/OSError on corrupt files
                    raise BadInput(f"{path}: not a readable parquet file ({exc})") from None
        except UnicodeDecodeError:
            raise BadInput(f"{path} is not a text file (not UTF-8: binary?)",
                           "set dataset.format (jsonl | json | text | parquet) or point dataset.path at the data"
                           ) from None
        except OSError as exc:
            raise BadInput(f"cannot read {path}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise BadInput(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    records = [r if isinstance(r, dict) else {dcfg.text_field: r} for r in records]
    if dcfg.max_samples:
        records = records[: dcfg.max_samples]
    if not records:
        raise BadInput(f"dataset {dcfg.path!r} holds no records")
    return records


def record_type(dcfg: DatasetConfig, records: list[dict]) -> str:
    if dcfg.type != "auto":
        return dcfg.type
    r = records[0]
    if dcfg.prompt_field in r and dcfg.response_field in r:
        return "prompt_response"
    return "text"


@dataclass
class TokenizedData:
    """Tokenized training samples (lists of ints)."""

    samples: list[tuple[list[int], list[int]]]
    """(input_ids, labels) per sample; labels -100 where no loss is taken."""
    pad_id: int
    """Token used for padding (its label is -100)."""
    kind: str
    """``text`` or ``prompt_response``."""
    packed: bool
    truncated: int = 0
    """Samples cut at seq_len (not packed)."""

    def __len__(self) -> int:
        return len(self.samples)


def tokenize(dcfg: DatasetConfig, tokenizer, seq_len: int) -> TokenizedData:
    """Tokenize every record with the model's tokenizer; mask prompts; pack or truncate to ``seq_len``."""
    records = load_records(dcfg)
    kind = record_type(dcfg, records)
    eos = tokenizer.eos_token_id if dcfg.add_eos else None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        pad = 0
    seqs: list[tuple[list[int], list[int]]] = []
    missing: list[str] = []
    for i, r in enumerate(records):
        if kind == "text":
            text = r.get(dcfg.text_field)
            if not isinstance(text, str):
                missing.append(f"record {i + 1}: no string field {dcfg.text_field!r}")
                continue
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if eos is not None:
                ids = ids + [eos]
            labels = list(ids)
        else:
            p, a = r.get(dcfg.prompt_field), r.get(dcfg.response_field)
            if not isinstance(p, str) or not isinstance(a, str):
                missing.append(f"record {i + 1}: needs string fields {dcfg.prompt_field!r} and {dcfg.response_field!r}")
                continue
            pi = tokenizer(p, add_special_tokens=False)["input_ids"]
            ai = tokenizer(a, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
            ids = pi + ai
            labels = [IGNORE] * len(pi) + ai
        if ids:
            seqs.append((ids, labels))
        if len(missing) >= 5:
            break
    if missing:
        raise BadInput(f"dataset {dcfg.path}: " + "; ".join(missing[:5]),
                       "set dataset.text_field / prompt_field / response_field to your field names")
    truncated = 0
    if dcfg.packing:
        stream_ids = [t for s in seqs for t in s[0]]
        stream_lab = [t for s in seqs for t in s[1]]
        n = len(stream_ids) // seq_len
        if n == 0:
            raise BadInput(f"dataset: {len(stream_ids)} tokens do not fill one packed block of seq_len {seq_len}",
                           "lower seq_len or turn packing off")
        samples = [(stream_ids[k * seq_len:(k + 1) * seq_len], stream_lab[k * seq_len:(k + 1) * seq_len])
                   for k in range(n)]
    else:
        samples = []
        for ids, lab in seqs:
            if len(ids) > seq_len:
                truncated += 1
                ids, lab = ids[:seq_len], lab[:seq_len]
            samples.append((ids, lab))
    samples = [s for s in samples if any(t != IGNORE for t in s[1][1:])]  # no target token: nothing to learn
    if not samples:
        raise BadInput("dataset: no sample has a token to predict after truncation", "raise seq_len")
    return TokenizedData(samples=samples, pad_id=int(pad), kind=kind, packed=dcfg.packing, truncated=truncated)


class SampleOrder:
    """Deterministic, resumable order: the k-th consumed sample is a function of (seed, k) only."""

    def __init__(self, n: int, seed: int, shuffle: bool):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._cache: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        if epoch not in self._cache:
            import torch

            g = torch.Generator().manual_seed(self.seed + epoch)
            self._cache = {epoch: torch.randperm(self.n, generator=g).tolist()}
        return self._cache[epoch]

    def take(self, start: int, count: int) -> list[int]:
        """Indices of consumed samples ``start .. start+count-1``."""
        out = []
        for k in range(start, start + count):
            out.append(self._perm(k // self.n)[k % self.n])
        return out


def count_targets(samples: list[tuple[list[int], list[int]]]) -> int:
    """Tokens that contribute to the loss: labels after the causal shift (transformers ``ForCausalLMLoss`` drops
    the first label of each sequence and ignores -100)."""
    return sum(sum(1 for t in lab[1:] if t != IGNORE) for _, lab in samples)


def collate(samples: list[tuple[list[int], list[int]]], pad_id: int, pad_to_multiple_of: int | None = None):
    """Right-pad to the longest sample (rounded up to ``pad_to_multiple_of``): input_ids, attention_mask, labels."""
    import torch

    longest = max(len(s[0]) for s in samples)
    if pad_to_multiple_of:
        longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    lab = torch.full((len(samples), longest), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for i, (a, b) in enumerate(samples):
        ids[i, : len(a)] = torch.tensor(a, dtype=torch.long)
        lab[i, : len(b)] = torch.tensor(b, dtype=torch.long)
        mask[i, : len(a)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


__all__ = ["IGNORE", "TokenizedData", "tokenize", "load_records", "SampleOrder", "count_targets", "collate"]
