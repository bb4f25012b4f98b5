"""A user never beats tune by pinning a knob: for every value of every knob tune chooses on its own, the search with
that one knob pinned finds nothing the unpinned search ranks lower — a longer sequence for ``--seq-len max``, a
better plan by the ranking's own order (quality tier, then throughput) at a fixed sequence length.

Knobs tune does not choose on its own are left out (pinning them changes the training recipe, which tune never does
unasked): optimizers outside AdamW's family (Adafactor, Lion, SGD), LoRA's rank, alpha, dropout, targets and head,
the adapters' dtype, the attention implementation, the trainer and the multi-GPU topology.

The model: a small Llama (2 blocks, hidden 512, MLP 2048, vocab 1024) on budgets where the stacks compete — a full
fine-tune offloaded reaches furthest untiled, a QLoRA plan without peft's k-bit upcast furthest tiled (below
``tiling_applies``'s 8 x hidden, where the search used not to try tiles at all). Block replays are cached per
session (conftest), so the pinned searches reuse what the unpinned one measured."""

from __future__ import annotations

import pytest

from oomdoctor.model.load import spec_from_config
from oomdoctor.plan.budget import resolve_budget
from oomdoctor.tune.batch_search import analytic_estimator
from oomdoctor.tune.longest import longest_context
from oomdoctor.tune.ranking import rank_key
from oomdoctor.tune.search import ADAMW_FAMILY
from oomdoctor.tune.throughput import REFERENCE_PROFILE
from oomdoctor.tune.tuner import tune
from oomdoctor.units import parse_size

pytestmark = pytest.mark.heavy  # sweeps of tune's whole search, a pin at a time (the search itself: test_search.py)

SMALL = dict(
    model_type="llama",
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=1 << 17,
    tie_word_embeddings=False,
)
#: Every value of every knob the search spans on one GPU.
PINS = (
    [("method", v) for v in ("full", "lora", "qlora")]
    + [("precision", v) for v in ("fp32", "bf16-mixed", "bf16")]
    + [("optimizer", v) for v in ADAMW_FAMILY]
    + [("optimizer_impl", v) for v in ("fused", "foreach", "for-loop")]
    + [("loss", v) for v in ("standard", "chunked")]
    + [("quant", v) for v in ("nf4", "int8", "fp4")]
    + [
        (k, v)
        for k in (
            "gradient_checkpointing",
            "tiled_mlp",
            "double_quant",
            "kbit_upcast",
            "optimizer_in_backward",
            "offload_optimizer",
            "offload_activations",
        )
        for v in (False, True)
    ]
)
HOST = 64 * 10**9


def _id(pin):
    return f"{pin[0]}={pin[1]}"


@pytest.fixture(scope="module")
def spec():
    return spec_from_config(dict(SMALL), name="small-llama")


def _longest(spec, pins: dict, card: str) -> int:
    from oomdoctor.errors import DoesNotFit

    try:
        return longest_context(
            spec,
            pins,
            resolve_budget(parse_size(card), None, None),
            analytic_estimator,
            REFERENCE_PROFILE,
            "quality",
            HOST,
        )[1]
    except DoesNotFit:
        return 0


@pytest.fixture(scope="module")
def unpinned_max(spec):
    return _longest(spec, {}, "700MB")


@pytest.mark.slow
def test_seq_len_max_tries_tiles_on_every_stack_that_could_use_them(spec, unpinned_max):
    """The longest plan untiled (a full fine-tune offloaded, 3,776 tokens) is not the longest tiled: the search tiles
    the longest plan of every group of plans tiles help alike, not two finalists, and tries them below the 8 x
    hidden rule of thumb (4,096 tokens here)."""
    from oomdoctor.plan.budget import resolve_budget as rb

    plan, seq = longest_context(
        spec, {}, rb(parse_size("700MB"), None, None), analytic_estimator, REFERENCE_PROFILE, "quality", HOST
    )
    assert seq == unpinned_max
    assert plan.tiled_mlp and seq > _longest(spec, {"tiled_mlp": False}, "700MB")


@pytest.mark.slow
@pytest.mark.parametrize("pin", PINS, ids=_id)
def test_no_pinned_knob_finds_a_longer_sequence(spec, unpinned_max, pin):
    assert _longest(spec, dict([pin]), "700MB") <= unpinned_max


def _best(spec, pins: dict, card: str, seq_len: int):
    from oomdoctor.errors import BadInput, DoesNotFit

    try:
        r = tune(
            spec, gpu_mem=parse_size(card), seq_len=seq_len, pins=pins, verify_mode="none", gpu=False, host_mem=HOST
        )
    except (DoesNotFit, BadInput):
        return None
    return r.search.best


#: (card, sequence length): below and above ``tiling_applies``'s 4,096 tokens.
FIXED = [("700MB", 2048), ("760MB", 4096)]


@pytest.mark.slow
@pytest.mark.parametrize("card,seq_len", FIXED, ids=[f"{c}-{s}" for c, s in FIXED])
def test_no_pinned_knob_finds_a_better_plan(spec, card, seq_len):
    best = _best(spec, {}, card, seq_len)
    assert best is not None
    beaten = []
    for k, v in PINS:
        pinned = _best(spec, {k: v}, card, seq_len)
        if pinned is not None and rank_key(pinned) < rank_key(best):
            beaten.append(
                f"{k}={v}: {pinned.plan.label()} {rank_key(pinned)} over {best.plan.label()} {rank_key(best)}"
            )
    assert not beaten, "\n".join(beaten)
