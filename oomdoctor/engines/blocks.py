"""What each transformer block of a model saves for backward, measured: one forward of the real Hugging Face blocks on
fake tensors (no weights, no device), for the analytic engine where its per-block formulas do not know the block.

The analytic engine prices blocks from formulas written for the layer types it knows (``memory/activations.py``:
Llama-like attention + MLP blocks and the families it was checked on against this replay). Other blocks — Mamba and
other state-space mixers of the hybrids, parallel attention/MLP blocks with their own norms, multi-op activations,
QK-norms, custom kernels — are priced from a measurement instead: the model as the plan builds it (executor's
``build_model``: peft, quantization stand-ins, dtypes, attention implementation) runs the forward of its blocks under
the plan's autocast on fake tensors with a :class:`~oomdoctor.execute.tracking.LiveBytes` tracker, recording the
activation bytes autograd saves for backward in each block and after the last one (the final norm). The forward
stops at the output head: the head and the loss are priced by their own formulas.

Block 0, the blocks before the repetition and one repeating unit are replayed when transformers' config says how
blocks differ (``engines/kinds.layer_kinds``), every block otherwise — and of those only block 0 and the first block
of each kind run, the others passing their input through (``engines/block_replay``: Jamba's 9 replayed blocks are 4
kinds); at micro-batch 1 and 2 (what grows with the batch is the difference, the rest is weight-sized: gradients,
peft's merged expert weights), at the plan's sequence length rounded up to a power of two (the token share scaled
back linearly), with the plan's gradient checkpointing (a checkpointed block keeps its input, a formula, and
recomputes the rest inside its measured backward). Blocks whose forward loops over the tokens in Python (Mamba's
selective scan: ~125 ops a token forward and backward, 80 % of a cold Jamba diagnose measured token by token) are
found by the ops they dispatch (:data:`LOOP_BUDGET`, then their growth between two short lengths) and measured on
the plan's tokens cut into sequences of :data:`LOOP_SEQ_LEN` (and of twice it, and on twice as many sequences:
:func:`along_the_sequence` takes out what grows with the number of sequences); the other blocks still run at the
plan's length. Results are cached in memory and on disk (``oomdoctor.cache``, kind ``blocks``), keyed by the model
config, the plan's settings at micro-batch 1 and the versions of oomdoctor, torch, transformers and peft
(``diagnose`` and ``tune`` make the measurements their plans need first, in worker processes:
``engines/block_pool``). Each replay run of a measurement is reported (``oomdoctor.progress``, task ``blocks``: the
CLI draws it on stderr).
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import lru_cache
from typing import TYPE_CHECKING

from oomdoctor import cache
from oomdoctor.engines.kinds import extend
from oomdoctor.memory.measured import BlockBytes, BlockSaves
from oomdoctor.plan import Plan
from oomdoctor.progress import report

if TYPE_CHECKING:
    from oomdoctor.model.spec import ModelSpec

#: Bump when what is measured changes: cached measurements of another version are not read.
VERSION = 19


#: Model types without a hand builder whose blocks the analytic formulas price: their MoE formulas (written for
#: transformers' grouped experts) are checked against the simulated engine (tests/test_moe.py).
FORMULA_TYPES: frozenset[str] = frozenset({"qwen3_moe"})
#: Above this many experts, plans that run transformers' eager experts keep the formulas: the replay runs the
#: per-expert Python loop of every replayed block twice (DeepSeek-V3's 256 experts: minutes per plan, where the
#: formulas price these weight-dominated experts within 1 %: tests/test_moe.py).
EAGER_REPLAY_MAX_EXPERTS = 64


def measures_blocks(spec: "ModelSpec", plan: "Plan") -> bool:
    """Whether the analytic engine prices ``spec``'s blocks from a measurement: decoder types without a hand builder
    (``model/architectures.BUILDERS``, whose blocks the formulas were written for) and not in :data:`FORMULA_TYPES`
    (transformers' eager experts included, up to :data:`EAGER_REPLAY_MAX_EXPERTS`: a balanced router sizes their
    tokens in the replay, ``engines/routing``), and every plan with bf16 adapters run by oomdoctor's executor (for
    another trainer's bf16 adapters, TRL's QLoRA, the formulas price the adapter dtype as that trainer's replay runs
    it: ``engines/trainers``) or a tiled MLP (``execute/tiled``: the formulas price whole-sequence MLPs). The measured
    plan runs on one device without offload (:func:`measured_plan`), so every topology and plan is measurable."""
    from oomdoctor.execute.build import runs_eager_experts
    from oomdoctor.model.architectures import BUILDERS

    if spec.arch_kind != "decoder":
        return False
    if spec.num_experts > EAGER_REPLAY_MAX_EXPERTS and runs_eager_experts(spec, plan):
        return False
    formulas = spec.model_type in BUILDERS or spec.model_type in FORMULA_TYPES
    bf16_adapters = plan.uses_lora and plan.adapter_dtype == "bf16" and plan.trainer == "oomdoctor"
    return not formulas or bf16_adapters or plan.tiled_mlp


def measured_plan(plan: "Plan") -> "Plan":
    """The plan the measurement runs, one per set of knobs that decide what a block saves (method, precision, attention,
    checkpointing, tiled MLP, sequence length rounded up to a power of two, LoRA targets/head/rank/dropout/dtype
    (with ``lora_on_head`` peft gets explicit names, which changes its MoE conversion in the blocks), int8 or
    4-bit, in pure bf16 whether peft's k-bit preparation upcasts the quantized base's norms and biases to fp32
    (``kbit_upcast``: the blocks' dtypes), the trainer: pure bf16 runs under autocast outside oomdoctor's own step):
    micro-batch 1 (the second measurement runs it at 2), one GPU, no offload; the optimizer, accumulation, topology,
    LoRA's scale, the 4-bit data type, double quantization and the upcast of an fp32-loaded base (a no-op) do not
    touch the blocks and take their defaults (one cache entry for them all)."""
    from oomdoctor.model.execution import upcast_changes_bytes
    from oomdoctor.plan.techniques import DEFAULTS

    keep = ("method", "precision", "attn", "gradient_checkpointing", "seq_len", "quant", "tiled_mlp", "trainer")
    if plan.uses_lora:
        keep += ("lora_r", "lora_dropout", "lora_targets", "lora_on_head", "adapter_dtype")
    if upcast_changes_bytes(plan):
        keep += ("kbit_upcast",)
    canonical = {k: v for k, v in DEFAULTS.items() if k not in keep and k in Plan.__dataclass_fields__}
    if plan.quant == "fp4":
        canonical["quant"] = "nf4"  # same shapes, same dequantized compute
    return replace(plan, seq_len=measured_seq_len(plan.seq_len), **canonical)


def measured_seq_len(seq_len: int) -> int:
    """The sequence length measured for ``seq_len``: the next power of two (at least 64), so that the searches over
    sequence lengths (``tune --seq-len max``) share a few measurements; the bytes are scaled back
    (``BlockSaves.scale``)."""
    return max(64, 1 << max(seq_len - 1, 0).bit_length())


def cache_key(spec: "ModelSpec", plan: "Plan") -> str:
    """The cache key of ``spec``'s measurement under ``plan`` (a :func:`measured_plan`): the model config and depth,
    the plan's settings, :data:`VERSION` and the versions of the libraries whose code decides what is saved."""
    libs = cache.versions("torch", "transformers", "peft")  # their code decides what is saved
    return cache.key_of(
        {"v": VERSION, "libs": libs, "config": spec.config, "layers": spec.num_layers, "plan": plan.settings()}
    )


def block_saves(spec: "ModelSpec", plan: "Plan") -> BlockSaves | None:
    """The measured :class:`BlockSaves` of ``spec`` under ``plan`` (cached); None when the executor cannot build or
    run the model as a causal LM (vision-language classes whose text side transformers builds only inside the
    multimodal model): the formulas price it then, with their note."""
    # the spec's config is not part of its equality (ModelSpec.config): two configs of one name/shape differ here
    return _cached(spec, measured_plan(plan), json.dumps(spec.config, sort_keys=True, default=str))


def _bytes_doc(b: BlockBytes) -> dict:
    return {
        "per_block": list(b.per_block),
        "final": b.final,
        "forward_transient": b.forward_transient,
        "backward_transient": b.backward_transient,
        "backward_over_gradients": b.backward_over_gradients,
    }


def _bytes_of(doc: dict) -> BlockBytes:
    return BlockBytes(
        tuple(int(x) for x in doc["per_block"]),
        int(doc["final"]),
        int(doc["forward_transient"]),
        int(doc["backward_transient"]),
        int(doc["backward_over_gradients"]),
    )


#: Measurements made in other processes for this one (``engines/block_pool.prefetch``), by cache key: what
#: :func:`_cached` takes when the cache directory could not keep them (read-only), and the models they could not
#: measure (None), so that the serial pricing does not measure them again.
PREFETCHED: dict[str, BlockSaves | None] = {}


@lru_cache(maxsize=512)
def _cached(spec: "ModelSpec", plan: "Plan", _config: str) -> BlockSaves | None:
    key = cache_key(spec, plan)
    saves = read_entry(key)
    if saves is not None:
        return saves
    if key in PREFETCHED:
        return PREFETCHED[key]
    return measure_entry(spec, plan)


def read_entry(key: str) -> BlockSaves | None:
    """The cached measurement keyed ``key``; None when there is none or it is damaged (measured again then)."""
    doc = cache.read_json("blocks", key)
    try:
        return BlockSaves(_bytes_of(doc["one"]), _bytes_of(doc["two"]), bool(doc["checkpointed"]), int(doc["seq_len"]))
    except (ValueError, KeyError, TypeError):  # none (None), or damaged
        return None


def measure_entry(spec: "ModelSpec", plan: "Plan") -> BlockSaves | None:
    """Measure ``spec``'s blocks under ``plan`` (a :func:`measured_plan`) and write the cache entry
    (``oomdoctor.cache``: a reader sees the whole entry or none); None, and no entry, when the executor cannot build
    or replay the model."""
    try:
        saves = measure_saves(spec, plan)
    except Exception:  # noqa: BLE001 - passing blocks through broke a model whose blocks depend on each other
        try:
            saves = measure_saves(spec, plan, one_per_kind=False)
        except Exception:  # noqa: BLE001 - a model the executor cannot build or replay: the formulas price it
            return None
    doc = {
        "model": spec.name,
        "one": _bytes_doc(saves.one),
        "two": _bytes_doc(saves.two),
        "checkpointed": saves.checkpointed,
        "seq_len": saves.seq_len,
    }
    cache.write_json("blocks", cache_key(spec, plan), doc)  # a read-only or full cache costs the next run a replay
    return saves


# ---------------------------------------------------------------------------------------------- what is replayed

#: Ops one block's forward may dispatch at the plan's length before the replay calls it a loop over the tokens
#: (Mamba's selective scan: ~40 ops a token, 82k at 2k tokens; the widest block without one dispatches a few
#: thousand: a 64-expert eager MoE block with LoRA).
LOOP_BUDGET = 8_000
#: Sequence length the blocks that loop over the tokens run at (and twice it), the plan's tokens spread over more
#: sequences: each token of a sequence costs every such block ~125 ops forward and backward, where the rest of a
#: block costs ~1,500.
LOOP_SEQ_LEN = 8
#: Models whose replayed blocks loop over the tokens, by model config (and whether one block of each kind runs): the
#: blocks (indices in the replayed blocks, every block of a looping kind).
_LOOPING: dict[str, frozenset[int]] = {}


def representatives(kinds: list | None, replayed: int, block0_alone: bool = True) -> tuple[int, ...]:
    """For each replayed block, the block measured for it: the first replayed block of its kind
    (``engines/kinds.layer_kinds``; each block its own when the kinds are unknown) — block 0 apart when
    ``block0_alone`` (:func:`block0_alone`)."""
    if kinds is None:
        return tuple(range(replayed))
    first: dict = {}
    for i in range(1 if block0_alone else 0, replayed):
        first.setdefault(kinds[i], i)
    return ((0,) if block0_alone else ()) + tuple(first[kinds[i]] for i in range(1 if block0_alone else 0, replayed))


def block0_alone(plan: "Plan") -> bool:
    """Whether block 0 is measured on its own: under LoRA without checkpointing its input (the frozen embeddings'
    output) needs no gradient, so it saves less than the blocks of its kind above it; a full fine-tune's embeddings
    train, and checkpointing makes their output require grad (``enable_input_require_grads``)."""
    return plan.uses_lora and not plan.gradient_checkpointing


def measure_saves(spec: "ModelSpec", plan: "Plan", *, one_per_kind: bool = True) -> BlockSaves:
    """:class:`BlockSaves` of ``spec`` under ``plan`` (a :func:`measured_plan`): its blocks replayed at micro-batch 1
    and 2 at ``plan.seq_len`` (module docstring) — one block of each kind (``one_per_kind``; else every replayed
    block), every other block passed through; the blocks whose forward loops over the tokens in Python at
    :data:`LOOP_SEQ_LEN` and twice it, on as many sequences as make the plan's tokens (:func:`along_the_sequence`)."""
    from oomdoctor.engines.block_replay import BlockReplay, LoopBudget
    from oomdoctor.engines.kinds import layer_kinds, replay_plan

    kinds = layer_kinds(spec, plan)
    q, p = replay_plan(kinds) if kinds else (spec.num_layers, 0)
    replayed = q + p + 1 if p else spec.num_layers
    reps = representatives(kinds if one_per_kind else None, replayed, block0_alone(plan))
    key = json.dumps([spec.config, spec.num_layers, one_per_kind], sort_keys=True, default=str)
    S, s = plan.seq_len, LOOP_SEQ_LEN
    b = S // s  # sequences of s tokens that hold the plan's
    reduced = 2 * s < S  # at short lengths every block runs at the plan's: loops are short too
    every = frozenset(reps)
    built = max(reps) + 1  # the blocks after the last one measured pass their input through: not built
    known = not reduced or key in _LOOPING
    looping, short = (_LOOPING.get(key, frozenset()) & every if reduced else frozenset()), {}
    runs = _Runs(spec, plan, 2 + 3 * bool(looping))
    with BlockReplay(spec, plan, built if built < spec.num_layers else None) as replay:
        if not known:
            try:
                one = runs.run(replay, 1, S, every, budget=LOOP_BUDGET)
            except LoopBudget:  # which blocks loop: those whose forward grows with the sequence
                runs.steps = 6  # this run, three short ones, two at the plan's length
                short = {(b, s): runs.run(replay, b, s, every), (b, 2 * s): runs.run(replay, b, 2 * s, every)}
                looping = frozenset(i for i in every if short[b, 2 * s].ops[i] > short[b, s].ops[i])
            else:
                _LOOPING[key] = frozenset()
                return _saves(plan, reps, q, p, spec.num_layers, one, runs.run(replay, 2, S, every))
            _LOOPING[key] = frozenset(j for j in range(replayed) if reps[j] in looping)  # every block of their kinds
        if looping:  # first: the full-length runs pass the looping blocks through as the short runs return them
            for n, length in ((b, s), (b, 2 * s), (2 * b, s)):
                if (n, length) not in short:
                    short[n, length] = runs.run(replay, n, length, looping)
        one, two = runs.run(replay, 1, S, every - looping), runs.run(replay, 2, S, every - looping)
        if looping:
            one, two = along_the_sequence(one, two, short[b, s], short[b, 2 * s], short[2 * b, s], looping, b)
    return _saves(plan, reps, q, p, spec.num_layers, one, two)


class _Runs:
    """The replay runs of one measurement, each reported as it starts (``oomdoctor.progress``, task ``blocks``)."""

    def __init__(self, spec: "ModelSpec", plan: "Plan", steps: int):
        knobs = " ".join(
            k for k in (plan.method, plan.quant, plan.precision, "GC" if plan.gradient_checkpointing else "") if k
        )
        self.message = (
            f"measuring what {spec.model_type} blocks save under {knobs} at {plan.seq_len} tokens (once: cached)"
        )
        self.steps = steps  # runs the measurement makes, as far as known (a loop over the tokens found adds some)
        self.step = 0

    def run(self, replay, micro_batch: int, seq_len: int, measured: frozenset[int], budget: int | None = None):
        self.step += 1
        report("blocks", self.message, self.step, max(self.steps, self.step))
        return replay.run(micro_batch, seq_len, measured, budget=budget)


def along_the_sequence(one, two, short, long, wide, looping: frozenset[int], b: int):
    """``one``/``two`` (runs at micro-batch 1 and 2 of ``S`` tokens, the looping blocks passed through) with the
    looping blocks' bytes from three runs of as many tokens cut into short sequences: ``short`` (``b`` sequences of
    ``S / b`` tokens: ``S``), ``long`` (``b`` of twice that: ``2 S``) and ``wide`` (``2 b`` of ``S / b``: ``2 S``).
    What a block holds, saves and peaks at is weight-sized, per sequence (a scan's state and per-token step, a
    convolution's padding: ``c`` each) and per token (a loop keeps a state per token), so ``wide - long`` is
    ``b c``, and ``m`` sequences of the plan's tokens hold what ``b`` do less ``(b - m) c`` — exact for what is
    saved and the backward's peak (Jamba blocks at 256 tokens: tests/test_blocks.py), and for the forward's peak
    where its moment is the same on ``m`` and ``b`` sequences; where many short sequences' scan states make it peak
    at another moment than the plan's sequences do, it is off by a little (int8 with checkpointing, micro-batch 2:
    -1.6 % of the forward's peak). The tokens, and so the
    kernel paths (bitsandbytes' 1,536-row switch) and a balanced router's tokens per expert, are the plan's."""

    def fit(base, at, m: int, field: str) -> tuple[int, ...]:
        got, a, w, z = (getattr(r, field) for r in (base, at, wide, long))
        return tuple(a[i] - round((b - m) * (w[i] - z[i]) / b) if i in looping else got[i] for i in range(len(got)))

    fields = ("saves", "forward", "backward", "backward_net")
    return (
        replace(one, **{f: fit(one, short, 1, f) for f in fields}),
        replace(two, **{f: fit(two, long, 2, f) for f in fields}),
    )


def _saves(plan: "Plan", reps: tuple[int, ...], q: int, p: int, num_layers: int, one, two) -> BlockSaves:
    return BlockSaves(
        block_bytes(one, reps, q, p, num_layers),
        block_bytes(two, reps, q, p, num_layers),
        plan.gradient_checkpointing,
        plan.seq_len,
    )


def block_bytes(run, reps: tuple[int, ...], q: int, p: int, num_layers: int) -> BlockBytes:
    """The :class:`BlockBytes` of all ``num_layers`` blocks from a run (of blocks ``0 .. max(reps)``): each replayed
    block takes its representative's bytes, the blocks after them those of their replayed block
    (``kinds.extend``)."""

    def per(values) -> tuple[int, ...]:
        return extend(tuple(values[r] for r in reps), q, p, num_layers)

    saves = per(run.saves)
    return BlockBytes(
        saves,
        run.final,
        forward_over_saves(saves, per(run.forward)),
        max(per(run.backward)),
        max(per(run.backward_net)),
    )


def measure_block_bytes(spec: "ModelSpec", plan: "Plan") -> BlockBytes:
    """The :class:`BlockBytes` of ``spec`` under ``plan`` at its micro-batch and sequence length: one replay of
    every replayed block (no passing through, no loop budget), the reference :func:`measure_saves` is checked
    against (tests/test_blocks.py)."""
    from oomdoctor.engines.block_replay import BlockReplay
    from oomdoctor.engines.kinds import replay_depth

    q, p = replay_depth(spec, plan)
    with BlockReplay(spec, plan, q + p + 1 if p else None) as replay:
        run = replay.run(plan.micro_batch, plan.seq_len)
    return block_bytes(run, tuple(range(len(run.saves))), q, p, spec.num_layers)


def forward_over_saves(saves: tuple[int, ...], transients: tuple[int, ...]) -> int:
    """The forward's peak inside a block above what every block saves: block ``i`` peaks at what blocks ``0..i``
    saved plus its own transient, so a wide block low in the stack (DeepSeek's dense first blocks) peaks with
    fewer saves alive than the last block would (0 when no block peaks above the saves at the end of the forward)."""
    total, below, over = sum(saves), 0, 0
    for saved, transient in zip(saves, transients):
        below += saved
        over = max(over, below + transient - total)
    return over
