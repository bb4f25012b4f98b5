"""Training data as TRL's ``SFTTrainer`` reads it: local jsonl / json / text / parquet files -> tokenized rows ->
deterministic batches.

Records: ``text`` (language modeling), ``prompt``/``completion`` (plain strings or message lists; the prompt is
masked from the loss unless ``completion_only_loss: false``) and ``messages`` (lists of ``{role, content}``,
rendered with the tokenizer's chat template, ``dataset.chat_template``, or :data:`CHATML` when the tokenizer has
none; ``assistant_only_loss`` keeps only the template's ``{% generation %}`` spans). Plain text is encoded with the
tokenizer's special tokens (BOS when the tokenizer adds one) and EOS appended when not already last; conversations
get exactly what the template writes.

Rows are ``Sample(input_ids, labels, seq_lengths)``; ``labels`` is ``-100`` where no loss is taken. Without
``packing`` each sequence is truncated to ``seq_len`` and each micro-batch is padded to its longest row. With
``packing`` (``packing_strategy: bfd``, TRL's default) whole sequences are packed best-fit-decreasing into rows of at
most ``seq_len`` whose ``position_ids`` restart at 0 for each sequence; :func:`collate` passes no attention mask, so
transformers builds a block-diagonal mask (or runs varlen flash attention) and packed sequences never attend to each
other. ``packing_strategy: wrapped`` cuts the concatenated stream into ``seq_len`` blocks (samples see their
neighbours, as HF ``group_texts``).

The order is a pure function of ``(seed, samples consumed)``: epoch ``e`` is a permutation drawn from a generator
seeded with ``seed + e``, so a checkpoint only has to store the number of samples consumed to resume exactly.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
        raise BadInput(
            f"dataset: cannot tell the format of {path} from its extension",
            "set dataset.format: jsonl | json | text | parquet",
        )
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
            raise BadInput(
                f"{path} is not a text file (not UTF-8: binary?)",
                "set dataset.format (jsonl | json | text | parquet) or point dataset.path at the data",
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


#: Record kinds, with TRL's names: ``text`` (language modeling), ``prompt_completion`` (the prompt is masked from
#: the loss by default) and ``messages`` (conversations rendered with the chat template).
KINDS = ("text", "prompt_completion", "messages")
#: Older spellings of ``dataset.type``.
TYPE_ALIASES = {"prompt_response": "prompt_completion"}
#: ``dataset.packing_strategy`` values (TRL ``SFTConfig.packing_strategy``).
PACKING_STRATEGIES = ("bfd", "wrapped")

#: The chat template used when the tokenizer has none (or with ``dataset.chat_template: chatml``): ChatML, the layout
#: TRL's ``clone_chat_template`` gives a base model (``<|im_start|>role\n...<|im_end|>\n``), with ``{% generation %}``
#: around each assistant reply and its ``<|im_end|>`` so ``assistant_only_loss`` works, and the tokenizer's BOS first
#: when the tokenizer adds one to plain text (``add_bos``, passed by :func:`tokenize`). The markers are plain text:
#: a tokenizer that lacks them as tokens spells them with several ordinary tokens.
CHATML = (
    "{%- if add_bos and bos_token %}{{ bos_token }}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def is_conversational(value) -> bool:
    """A list of ``{role, content}`` messages (TRL ``is_conversational`` on one field)."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def completion_key(dcfg: DatasetConfig, record: dict) -> str | None:
    """The record's completion field: ``completion_field``, or ``response`` when that is left at ``completion``
    (the bundled prompt/response data)."""
    if dcfg.completion_field in record:
        return dcfg.completion_field
    if dcfg.completion_field == "completion" and "response" in record:
        return "response"
    return None


def record_type(dcfg: DatasetConfig, records: list[dict]) -> str:
    """``dataset.type``, or what the first record holds: ``messages``, prompt + completion, else text."""
    if dcfg.type != "auto":
        return TYPE_ALIASES.get(dcfg.type, dcfg.type)
    r = records[0]
    if "messages" in r and is_conversational(r["messages"]):
        return "messages"
    if dcfg.prompt_field in r and completion_key(dcfg, r) is not None:
        return "prompt_completion"
    return "text"


def has_generation_markers(template: str) -> bool:
    """The template marks assistant output with ``{% generation %}`` (needed for ``assistant_only_loss``)."""
    return re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def chat_template(dcfg: DatasetConfig, tokenizer) -> tuple[str, str | None]:
    """The chat template to render conversations with, and a note when it is not the tokenizer's own:
    ``dataset.chat_template`` (``chatml``, a file or a jinja string), else the tokenizer's, else :data:`CHATML`."""
    own = tokenizer.chat_template
    if isinstance(own, dict):  # named variants: the default one
        own = own.get("default")
    c = dcfg.chat_template
    if c is None:
        if own:
            return own, None
        return (
            CHATML,
            "the tokenizer has no chat template: conversations use the default ChatML template "
            "(set dataset.chat_template to choose another: `oomdoctor keys chat_template`)",
        )
    if c == "chatml":
        return CHATML, None
    if "{{" in c or "{%" in c:
        return c, None
    path = Path(c).expanduser()
    try:
        return path.read_text(), None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(
            f"dataset.chat_template: {c!r} is neither a jinja template nor a readable file ({exc})",
            "give a template string, a .jinja file or chatml",
        ) from None


def adds_bos(tokenizer) -> bool:
    """The tokenizer puts its BOS token first when it encodes plain text (``add_special_tokens=True``)."""
    bos = tokenizer.bos_token_id
    ids = tokenizer("a")["input_ids"]
    return bos is not None and bool(ids) and ids[0] == bos


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Leading tokens ``a`` and ``b`` share (TRL: the completion starts where prompt and prompt+completion part)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Encoder:
    """How records become ``(input_ids, labels)``: TRL ``SFTTrainer`` semantics."""

    tokenizer: Any
    """The model's tokenizer."""
    eos: int | None
    """EOS appended to non-conversational samples when not already last (None: ``add_eos: false``)."""
    template: str | None
    """Chat template for conversational records."""
    add_bos: bool
    """Passed to the template as ``add_bos`` (the tokenizer adds BOS to plain text)."""
    assistant_only_loss: bool
    """Loss only on the template's ``{% generation %}`` spans."""
    completion_only_loss: bool
    """Mask the prompt of prompt/completion records."""

    def text(self, text: str) -> list[int]:
        """Plain text with the tokenizer's special tokens (BOS when it adds one), EOS last."""
        ids = list(self.tokenizer(text)["input_ids"])
        if self.eos is not None and (not ids or ids[-1] != self.eos):
            ids.append(self.eos)
        return ids

    def chat(self, messages: list, generation_prompt: bool = False) -> tuple[list[int], list[int] | None]:
        """A conversation through the chat template: ids and (with ``assistant_only_loss``) the assistant mask."""
        out = self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.template,
            tokenize=True,
            return_dict=True,
            add_generation_prompt=generation_prompt,
            add_bos=self.add_bos,
            return_assistant_tokens_mask=self.assistant_only_loss and not generation_prompt,
        )
        ids = list(out["input_ids"])
        mask = list(out["assistant_masks"]) if "assistant_masks" in out else None
        return ids, mask

    def messages(self, messages: list) -> tuple[list[int], list[int]]:
        """A ``messages`` record: every token a target, or only the assistant spans (``assistant_only_loss``)."""
        ids, amask = self.chat(messages)
        return ids, _labels(ids, amask)

    def prompt_completion(self, prompt, completion) -> tuple[list[int], list[int]]:
        """The prompt (masked when ``completion_only_loss``) followed by the completion; conversational when the
        prompt is a message list."""
        amask = None
        if is_conversational(prompt):
            p_ids, _ = self.chat(prompt, generation_prompt=True)
            ids, amask = self.chat(prompt + completion)
        else:
            p_ids = list(self.tokenizer(prompt)["input_ids"])
            ids = self.text(prompt + completion)
        n = common_prefix_length(p_ids, ids)
        cmask = [0] * n + [1] * (len(ids) - n) if self.completion_only_loss else None
        labels = _labels(ids, amask)
        return ids, _labels(labels, cmask)


def _labels(ids: list[int], mask: list[int] | None) -> list[int]:
    return list(ids) if mask is None else [t if m else IGNORE for t, m in zip(ids, mask)]


@dataclass(frozen=True)
class Sample:
    """One training row."""

    input_ids: list[int]
    """Token ids (at most ``seq_len``)."""
    labels: list[int]
    """Targets; ``-100`` where no loss is taken (masked prompt / non-assistant tokens, the first token of each
    sequence packed into the row)."""
    seq_lengths: tuple[int, ...]
    """Lengths of the sequences in the row (one unless ``packing_strategy: bfd`` packed several); position ids
    restart at 0 for each, so they do not attend to each other."""


@dataclass
class TokenizedData:
    """Tokenized training rows."""

    samples: list[Sample]
    """The rows, in file order (:class:`SampleOrder` shuffles)."""
    pad_id: int
    """Token used for padding (its label is -100)."""
    kind: str
    """One of :data:`KINDS`."""
    packed: bool
    """``packing`` was on."""
    reset_positions: bool
    """Rows hold several sequences (bfd packing): :func:`collate` passes restarting ``position_ids`` and no
    ``attention_mask``."""
    truncated: int = 0
    """Sequences cut at seq_len (bfd packing truncates too, as TRL's ``bfd``)."""
    notes: list[str] = field(default_factory=list)
    """Things the run should mention (the default chat template was used)."""

    def __len__(self) -> int:
        return len(self.samples)


def _encoder(dcfg: DatasetConfig, tokenizer, kind: str, conversational: bool) -> tuple[Encoder, list[str]]:
    notes: list[str] = []
    template = None
    if dcfg.assistant_only_loss and not conversational:
        raise BadInput(
            "dataset.assistant_only_loss: the records are not conversational (no message lists)",
            "use messages records or conversational prompt/completion, or set completion_only_loss",
        )
    if conversational:
        template, note = chat_template(dcfg, tokenizer)
        notes += [note] if note else []
        if dcfg.assistant_only_loss and not has_generation_markers(template):
            raise BadInput(
                "dataset.assistant_only_loss: the chat template has no {% generation %} markers, so the "
                "assistant tokens cannot be told apart",
                "set dataset.chat_template: chatml (the bundled template has them) or give a template "
                "with {% generation %}...{% endgeneration %} around assistant replies",
            )
    col = dcfg.completion_only_loss
    enc = Encoder(
        tokenizer=tokenizer,
        eos=tokenizer.eos_token_id if dcfg.add_eos else None,
        template=template,
        add_bos=adds_bos(tokenizer),
        assistant_only_loss=dcfg.assistant_only_loss,
        completion_only_loss=(kind == "prompt_completion") if col is None else col,
    )
    return enc, notes


def encode_records(
    dcfg: DatasetConfig, tokenizer, records: list[dict], enough: int | None = None
) -> tuple[str, list[tuple], list[str]]:
    """Records -> ``(kind, [(input_ids, labels)], notes)``, untruncated; with ``enough``, the first records only, up to
    the one that brings their tokens to ``enough``."""
    kind = record_type(dcfg, records)
    r0 = records[0]
    if kind == "messages":
        conversational = True
    elif kind == "prompt_completion":
        conversational = is_conversational(r0.get(dcfg.prompt_field))
    else:
        conversational = False
    enc, notes = _encoder(dcfg, tokenizer, kind, conversational)
    seqs: list[tuple[list[int], list[int]]] = []
    missing: list[str] = []
    tokens = 0
    for i, r in enumerate(records):
        if kind == "text":
            text = r.get(dcfg.text_field)
            if not isinstance(text, str):
                missing.append(f"record {i + 1}: no string field {dcfg.text_field!r}")
                continue
            ids = enc.text(text)
            seq = (ids, list(ids))
        elif kind == "messages":
            m = r.get("messages")
            if not is_conversational(m):
                missing.append(f"record {i + 1}: no 'messages' list of {{role, content}}")
                continue
            seq = enc.messages(m)
        else:
            ck = completion_key(dcfg, r)
            p, c = r.get(dcfg.prompt_field), r.get(ck) if ck else None
            ok = (isinstance(p, str) and isinstance(c, str)) or (
                conversational and is_conversational(p) and is_conversational(c)
            )
            if not ok:
                missing.append(
                    f"record {i + 1}: needs fields {dcfg.prompt_field!r} and {dcfg.completion_field!r} "
                    f"(both strings, or both message lists)"
                )
                continue
            seq = enc.prompt_completion(p, c)
        if enc.assistant_only_loss and all(t == IGNORE for t in seq[1]):
            raise BadInput(
                f"dataset record {i + 1}: no assistant tokens (assistant_only_loss)",
                "every conversation needs an assistant turn, and the template {% generation %} markers",
            )
        if seq[0]:
            seqs.append(seq)
            tokens += len(seq[0])
        if len(missing) >= 5 or enough is not None and tokens >= enough:
            break
    if missing:
        raise BadInput(
            f"dataset {dcfg.path}: " + "; ".join(missing[:5]),
            "set dataset.type / text_field / prompt_field / completion_field to match your records",
        )
    return kind, seqs, notes


def pack_bfd(seqs: list[tuple[list[int], list[int]]], seq_len: int) -> list[Sample]:
    """TRL's ``bfd`` packing: sequences (truncated to ``seq_len``) go longest first into the fullest row they fit
    (best fit decreasing); rows keep sequence boundaries (``seq_lengths``) and the first token of each sequence
    is not a target (it would be predicted from the previous sequence)."""
    seqs = [(ids[:seq_len], lab[:seq_len]) for ids, lab in seqs]
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))  # stable: ties keep file order
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, bin index), sorted
    for i in order:
        n = len(seqs[i][0])
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            space, b = free.pop(k)
        else:
            space, b = seq_len, len(bins)
            bins.append([])
        bins[b].append(i)
        if space - n > 0:
            bisect.insort(free, (space - n, b))
    rows = []
    for members in bins:
        ids: list[int] = []
        lab: list[int] = []
        for i in members:
            ids += seqs[i][0]
            lab += [IGNORE] + seqs[i][1][1:]
        rows.append(Sample(ids, lab, tuple(len(seqs[i][0]) for i in members)))
    return rows


def pack_wrapped(seqs: list[tuple[list[int], list[int]]], seq_len: int) -> list[Sample]:
    """TRL's ``wrapped`` packing: the concatenated stream cut every ``seq_len`` tokens (sequences are split and
    attend to their neighbours in the row, as HF ``group_texts``)."""
    ids = [t for s in seqs for t in s[0]]
    lab = [t for s in seqs for t in s[1]]
    return [
        Sample(ids[k : k + seq_len], lab[k : k + seq_len], (len(ids[k : k + seq_len]),))
        for k in range(0, len(ids), seq_len)
    ]


def dataset_tokens(dcfg: DatasetConfig, tokenizer, enough: int) -> int:
    """Tokens of the dataset's sequences as :func:`tokenize` encodes them (special tokens, EOS, chat template),
    counted until ``enough``: the records after that are not tokenized."""
    _, seqs, _ = encode_records(dcfg, tokenizer, load_records(dcfg), enough=enough)
    return sum(len(ids) for ids, _ in seqs)


def tokenize(dcfg: DatasetConfig, tokenizer, seq_len: int) -> TokenizedData:
    """Every record -> training rows of at most ``seq_len`` tokens (packed, or one sequence each, truncated)."""
    records = load_records(dcfg)
    kind, seqs, notes = encode_records(dcfg, tokenizer, records)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    truncated = sum(1 for ids, _ in seqs if len(ids) > seq_len)
    reset = dcfg.packing and dcfg.packing_strategy == "bfd"
    if not dcfg.packing:
        samples = [Sample(ids[:seq_len], lab[:seq_len], (min(len(ids), seq_len),)) for ids, lab in seqs]
    elif reset:
        samples = pack_bfd(seqs, seq_len)
    else:
        samples, truncated = pack_wrapped(seqs, seq_len), 0
    samples = [s for s in samples if any(t != IGNORE for t in s.labels[1:])]  # no target token: nothing to learn
    if not samples:
        raise BadInput("dataset: no sample has a token to predict after truncation", "raise seq_len")
    return TokenizedData(
        samples=samples,
        pad_id=int(pad if pad is not None else 0),
        kind=kind,
        packed=dcfg.packing,
        reset_positions=reset,
        truncated=truncated,
        notes=notes,
    )


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


def count_targets(samples: list[Sample]) -> int:
    """Tokens that contribute to the loss: labels after the causal shift (transformers ``ForCausalLMLoss`` drops
    the first label of each row and ignores -100; packed rows already ignore each sequence's first token)."""
    return sum(sum(1 for t in s.labels[1:] if t != IGNORE) for s in samples)


def flattens(attn_implementation: str) -> bool:
    """Flash attention finds packed sequences from ``position_ids`` only in a batch of one row (transformers
    ``_is_packed_sequence``): packed micro-batches are flattened into one row for it, as TRL's ``padding_free``."""
    return "flash" in attn_implementation


def collate(
    samples: list[Sample],
    pad_id: int,
    pad_to_multiple_of: int | None = None,
    reset_positions: bool = False,
    flatten: bool = False,
):
    """Right-pad to the longest row (rounded up to ``pad_to_multiple_of``).

    Plain rows: ``input_ids``, ``attention_mask``, ``labels``. Packed rows (``reset_positions``): ``input_ids``,
    ``labels`` and ``position_ids`` restarting at 0 per sequence (0 on padding) and NO ``attention_mask``:
    transformers then builds a block-diagonal causal mask from the position ids (sdpa / eager /
    flex, ``masking_utils.find_packed_sequence_indices``) or runs varlen flash attention, so packed sequences do not
    attend to each other. ``flatten`` concatenates the rows into one (for flash attention, see :func:`flattens`)."""
    import torch

    if flatten and reset_positions:
        samples = [
            Sample(
                [t for s in samples for t in s.input_ids],
                [t for s in samples for t in s.labels],
                tuple(n for s in samples for n in s.seq_lengths),
            )
        ]
    longest = max(len(s.input_ids) for s in samples)
    if pad_to_multiple_of:
        longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of

    def padded(rows: list[list[int]], value: int):  # one tensor per batch, not one per row (2 % of a tiny step)
        return torch.tensor([r + [value] * (longest - len(r)) for r in rows], dtype=torch.long)

    ids = padded([s.input_ids for s in samples], pad_id)
    lab = padded([s.labels for s in samples], IGNORE)
    if reset_positions:
        pos = padded([[i for n in s.seq_lengths for i in range(n)] for s in samples], 0)
        return {"input_ids": ids, "labels": lab, "position_ids": pos}
    mask = padded([[1] * len(s.input_ids) for s in samples], 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


__all__ = [
    "CHATML",
    "IGNORE",
    "KINDS",
    "PACKING_STRATEGIES",
    "Sample",
    "SampleOrder",
    "TokenizedData",
    "chat_template",
    "collate",
    "count_targets",
    "dataset_tokens",
    "flattens",
    "load_records",
    "pack_bfd",
    "pack_wrapped",
    "record_type",
    "tokenize",
]
