"""``tiled_mlp``: the same loss and gradients as the whole-sequence MLP, far less memory at long contexts, priced
(blocks measured by replay), searched by tune, run by train."""

from __future__ import annotations

import pytest
from train_util import tiny_cfg

from oomdoctor.errors import BadInput
from oomdoctor.model.execution import num_tiles
from oomdoctor.plan import Plan, validate

TINY = dict(
    model_type="llama",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=176,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    tie_word_embeddings=False,
)


def test_tiles_are_deepspeeds_rule():
    assert num_tiles(4096, 4096) == 1 and num_tiles(4097, 4096) == 2 and num_tiles(131072, 4096) == 32
    assert num_tiles(0, 64) == 1


def mlp_token_counts(model) -> list[int]:
    """Tokens each call of a block's MLP down projection sees (filled as the model runs): the tile sizes."""
    seen: list[int] = []
    for name, mod in model.named_modules():
        if name.endswith("mlp.down_proj"):
            mod.register_forward_pre_hook(lambda _m, args: seen.append(args[0].numel() // args[0].shape[-1]))
    return seen


def _loss_and_grads(spec, plan, seed=0):
    """Loss and gradients of one real CPU step, and the tokens each MLP call saw."""
    import torch

    from oomdoctor.execute.build import build_model, make_batch

    model = build_model(spec, plan, device="cpu", seed=seed).model
    tokens = mlp_token_counts(model)
    torch.manual_seed(1)
    batch = make_batch(spec, plan, "cpu")
    torch.manual_seed(2)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=plan.is_mixed):
        loss = model(**batch).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, tokens


@pytest.mark.parametrize(
    "method,precision,gc",
    [("full", "fp32", False), ("full", "fp32", True), ("lora", "fp32", True), ("lora", "bf16-mixed", False)],
)
def test_tiled_mlp_gives_the_same_loss_and_gradients(method, precision, gc):
    """Real CPU steps of a tiny Llama, 400 tokens over 64-wide tiles (7 tiles): same loss, same gradients (fp32
    to float summation order; bf16 autocast to bf16 rounding)."""
    import torch

    from oomdoctor.model.architectures import build_spec

    spec = build_spec(TINY, "tiny")
    plain = validate(Plan(method=method, precision=precision, gradient_checkpointing=gc, seq_len=200, micro_batch=2))
    l0, g0, t0 = _loss_and_grads(spec, plain)
    l1, g1, t1 = _loss_and_grads(spec, plain.with_(tiled_mlp=True))
    assert max(t0) == 400 and max(t1) == 58 and sum(t1) > sum(t0)  # 7 tiles of 58 tokens, recomputed in backward
    assert l1 == pytest.approx(l0, rel=1e-6)
    tol = 1e-5 if precision == "fp32" else 1e-2
    # a gradient at rounding-noise level (layer 0's q/k lora_B in bf16: ~1e-12 against ~0.3) carries no signal to
    # compare: the tolerance floor is a millionth of the largest gradient
    floor = 1e-6 * max(g.abs().max().item() for g in g0.values())
    for n in g0:
        assert torch.allclose(g1[n], g0[n], rtol=tol, atol=tol * max(g0[n].abs().max().item(), floor)), n


def test_eval_runs_the_tiles_too_and_is_priced_so():
    """Without autograd (eval) the MLP still runs tile by tile: the same logits, and the eval forward's MLP stage is
    priced at one tile's intermediates (memory/evaluation.py), far below the whole sequence's."""
    import torch

    from oomdoctor.execute.build import build_model, make_batch
    from oomdoctor.memory.context import make_ctx
    from oomdoctor.memory.evaluation import block_forward_peak
    from oomdoctor.model.architectures import build_spec
    from oomdoctor.model.load import load_spec

    spec = build_spec(TINY, "tiny")
    plan = validate(Plan(seq_len=200, micro_batch=2))
    outs, tokens = [], []
    for p in (plan, plan.with_(tiled_mlp=True)):
        model = build_model(spec, p, device="cpu", seed=0).model.eval()
        tokens.append(mlp_token_counts(model))
        with torch.no_grad():
            outs.append(model(**make_batch(spec, p, "cpu")).logits)
    assert max(tokens[0]) == 400 and max(tokens[1]) == 58
    assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    big = load_spec("meta-llama/Llama-3.1-8B")
    long = validate(Plan(method="lora", precision="bf16", seq_len=131072))
    assert block_forward_peak(make_ctx(big, long.with_(tiled_mlp=True))) < 0.4 * block_forward_peak(make_ctx(big, long))


def test_tiled_mlp_replays_each_tiles_dropout_in_backward(monkeypatch):
    """With dropout inside the MLP (LoRA dropout), a tile's recompute draws the masks its forward drew: the gradients
    equal those of the same tiles run with plain autograd (no recompute)."""
    import torch

    from oomdoctor.execute import tiled
    from oomdoctor.model.architectures import build_spec

    spec = build_spec(TINY, "tiny")
    plan = validate(Plan(method="lora", lora_dropout=0.3, seq_len=200, micro_batch=2, tiled_mlp=True))

    class PlainTiles:  # the tiles, forward and backward by autograd: the reference
        @staticmethod
        def apply(mlp_forward, x, tiles, _rng):
            flat = x.reshape(-1, x.shape[-1])
            out = torch.cat([mlp_forward(t) for t in tiled._tiles(flat, tiles)])
            return out.view(*x.shape[:-1], out.shape[-1])

    import oomdoctor.execute.build as build_mod

    real_build = build_mod.build_model

    def build(*a, **k):  # lora_B starts at zero: make the adapters (and their dropout) matter
        built = real_build(*a, **k)
        with torch.no_grad():
            for n, p in built.model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
        return built

    monkeypatch.setattr(build_mod, "build_model", build)
    l1, g1, _ = _loss_and_grads(spec, plan)
    monkeypatch.setattr(tiled, "_function_cls", lambda: PlainTiles)
    l_ref, g_ref, _ = _loss_and_grads(spec, plan)
    assert l1 == pytest.approx(l_ref, rel=1e-6)
    for n in g_ref:
        assert torch.allclose(g1[n], g_ref[n], rtol=1e-5, atol=1e-6 * g_ref[n].abs().max().item()), n


def test_tiled_mlp_cuts_the_long_context_peak_and_the_analytic_engine_follows():
    """Llama-3.2-1B cut to 2 blocks, QLoRA + GC + chunked loss at 16k tokens: the tiled plan's simulated peak is far
    below the untiled one and the analytic engine (its blocks measured by a replay) prices it within 1 %."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from blocks_vs_simulate import shrink

    from oomdoctor.engines import estimate
    from oomdoctor.engines.blocks import measures_blocks
    from oomdoctor.engines.simulate import simulate_plan
    from oomdoctor.model.architectures import build_spec
    from oomdoctor.model.load import load_spec

    spec = build_spec(shrink(dict(load_spec("meta-llama/Llama-3.2-1B").config), 2), "llama-2-blocks")
    plan = validate(
        Plan(method="qlora", precision="bf16-mixed", gradient_checkpointing=True, loss="chunked", seq_len=16384)
    )
    tiled = plan.with_(tiled_mlp=True)
    assert measures_blocks(spec, tiled) and not measures_blocks(spec, plan)
    s_plain = simulate_plan(spec, plan, layers="full", round_to=512).breakdown.peak_allocated
    s_tiled = simulate_plan(spec, tiled, layers="full", round_to=512).breakdown.peak_allocated
    a_tiled = estimate(spec, tiled, "analytic").peak_allocated
    assert s_tiled < 0.65 * s_plain
    assert abs(a_tiled - s_tiled) / s_tiled < 0.01, (a_tiled, s_tiled)


def test_a_replay_runs_two_tiles_and_peaks_exactly_as_the_full_loop(monkeypatch):
    """On fake tensors the tiled MLP runs REPLAYED_TILES tiles per pass: every tile repeats the second one's
    allocations, so the simulated step is the same to the byte as with all 16 tiles."""
    from oomdoctor.engines.simulate import simulate_run
    from oomdoctor.execute import tiled
    from oomdoctor.model.architectures import build_spec

    spec = build_spec({**TINY, "hidden_size": 128, "intermediate_size": 344}, "tiny")
    for kw in (
        dict(method="qlora", precision="bf16-mixed", gradient_checkpointing=True),
        dict(method="full", precision="bf16"),
        dict(method="lora", precision="fp32", lora_dropout=0.1),
    ):
        plan = validate(Plan(seq_len=1024, micro_batch=2, tiled_mlp=True, **kw))
        two = simulate_run(spec, plan, round_to=1)
        monkeypatch.setattr(tiled, "REPLAYED_TILES", 10**9)
        every = simulate_run(spec, plan, round_to=1)
        monkeypatch.undo()
        assert two.peak == every.peak and two.phase_peaks == every.phase_peaks, kw


def test_tiled_mlp_is_refused_where_it_cannot_run():
    from oomdoctor.engines import estimate
    from oomdoctor.model.load import load_spec

    with pytest.raises(BadInput, match="one GPU only"):
        validate(Plan(tiled_mlp=True, world_size=2))
    with pytest.raises(BadInput, match="optimizer_in_backward"):
        validate(Plan(tiled_mlp=True, optimizer_in_backward=True))
    with pytest.raises(BadInput, match="mixture of experts"):
        estimate(load_spec("mistralai/Mixtral-8x7B-v0.1"), validate(Plan(tiled_mlp=True)))
    with pytest.raises(BadInput, match="not a decoder-only"):
        estimate(load_spec("google-t5/t5-small"), validate(Plan(tiled_mlp=True)))


def test_tune_adds_tiled_plans_only_for_long_sequences():
    from oomdoctor.model.execution import tiling_applies
    from oomdoctor.model.load import load_spec
    from oomdoctor.tune.search import enumerate_candidates

    spec = load_spec("meta-llama/Llama-3.1-8B")
    assert not tiling_applies(spec, 8192) and tiling_applies(spec, 32768)
    assert not tiling_applies(load_spec("mistralai/Mixtral-8x7B-v0.1"), 131072)
    plans = enumerate_candidates({"method": "qlora"}, Plan(seq_len=32768), tiled_mlp=True)
    tiled = [p for p in plans if p.tiled_mlp]
    # checkpointed or not (a pinned --tiled-mlp spans both; without checkpointing tiles free the MLP's saves)
    assert tiled and {p.gradient_checkpointing for p in tiled} == {False, True}
    assert not any(p.optimizer_in_backward for p in tiled)
    assert not any(p.tiled_mlp for p in enumerate_candidates({"method": "qlora"}, Plan(seq_len=32768)))


@pytest.mark.slow
def test_train_runs_the_tiled_mlp_with_the_same_losses(tmp_path, monkeypatch):
    from oomdoctor.execute import tiled
    from oomdoctor.train.loop import train

    patched: list[int] = []
    real = tiled.tile_mlps
    monkeypatch.setattr(tiled, "tile_mlps", lambda layers: patched.append(real(layers)) or patched[-1])
    a = train(tiny_cfg(tmp_path / "a", max_steps=2))
    assert not patched
    b = train(tiny_cfg(tmp_path / "b", max_steps=2, tiled_mlp=True))
    # the trained model and the replays that price it (engines/blocks) all run both blocks tiled
    assert "tiled-MLP" in b.plan and patched and set(patched) == {2}
    assert a.losses == pytest.approx(b.losses, rel=1e-5)
