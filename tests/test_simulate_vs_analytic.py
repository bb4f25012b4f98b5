"""(b) The analytic engine stays within 5 % of the simulated engine (the reference for tensor bytes) on a grid of
plans: sizes, sequence lengths, methods, gradient checkpointing, optimizers, precisions, attention.

Cells where the formulas are known to be off get ``xfail(strict=False)`` with the reason (none today: the cells that
were off — QLoRA/int8 fp32 outputs, int8 inputs kept on ctx under GC, AMP casts at the start of backward under GC —
were fixed in the analytic engine), so the grid keeps its 5 % bar."""

from __future__ import annotations

import pytest
from plans import Plan  # the settings these tolerances were measured with

from oomdoctor.model.load import spec_from_config
from oomdoctor.plan import validate

TOL = 0.05

#: A small Llama-shaped model (2 blocks; GQA; realistic vocab/hidden ratio) and a wider one.
MINI = {
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 8192,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
WIDE = dict(
    MINI,
    hidden_size=1024,
    intermediate_size=2816,
    num_attention_heads=16,
    num_key_value_heads=16,
    vocab_size=32000,
    tie_word_embeddings=True,
)
#: Phi-3 shapes (fused qkv_proj and gate_up_proj, I/h as Phi-3-mini) with a small vocab, so the blocks' LoRA
#: transients, not the logits, set the peak.
PHI3 = dict(
    MINI,
    model_type="phi3",
    intermediate_size=1376,
    num_key_value_heads=8,
    vocab_size=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MODELS = {"mini": MINI, "wide": WIDE, "phi3": PHI3}

GRID = [
    ("mini", Plan(method="full", seq_len=512)),
    ("mini", Plan(method="full", seq_len=1024, micro_batch=2, gradient_checkpointing=True)),
    ("mini", Plan(method="full", seq_len=512, optimizer="adamw-8bit")),
    ("mini", Plan(method="full", seq_len=512, optimizer="adafactor", precision="bf16")),
    ("mini", Plan(method="full", seq_len=256, optimizer="sgd", sgd_momentum=0.9, optimizer_impl="fused")),
    ("mini", Plan(method="full", seq_len=512, optimizer="lion", attn="eager")),
    ("mini", Plan(method="full", seq_len=512, optimizer="paged-adamw", gradient_checkpointing=True)),
    ("mini", Plan(method="full", seq_len=512, precision="fp32")),
    ("mini", Plan(method="lora", seq_len=512)),
    ("mini", Plan(method="lora", seq_len=2048, gradient_checkpointing=True)),
    (
        "mini",
        Plan(method="lora", seq_len=512, micro_batch=4, precision="fp16-mixed", lora_targets=("q_proj", "v_proj")),
    ),
    ("mini", Plan(method="lora", seq_len=1024, attn="eager", lora_r=64)),
    ("mini", Plan(method="qlora", seq_len=1024, gradient_checkpointing=True, optimizer="paged-adamw-8bit")),
    ("mini", Plan(method="qlora", seq_len=512)),
    ("mini", Plan(method="qlora", seq_len=512, double_quant=True, micro_batch=2)),
    ("mini", Plan(method="qlora", quant="int8", seq_len=512, gradient_checkpointing=True)),
    ("wide", Plan(method="full", seq_len=1024)),
    ("wide", Plan(method="lora", seq_len=1024, micro_batch=2)),
    ("wide", Plan(method="qlora", seq_len=2048, gradient_checkpointing=True)),
    # activation offload (save_on_cpu packs every saved tensor, weight casts included)
    ("mini", Plan(method="full", seq_len=1024, optimizer="sgd", offload_activations=True)),
    ("mini", Plan(method="lora", seq_len=1024, offload_activations=True)),
    ("mini", Plan(method="lora", seq_len=1024, offload_activations=True, gradient_checkpointing=True)),
    ("wide", Plan(method="lora", seq_len=1024, offload_activations=True)),
    # gradient accumulation: gradients alive through the later micro-batches' forward/backward
    ("mini", Plan(method="full", seq_len=512, grad_accum=2)),
    ("mini", Plan(method="lora", seq_len=512, grad_accum=4, gradient_checkpointing=True)),
    # fused gate_up LoRA: forward/recompute transient net of the MLP's later tensors (was +8..+20 %)
    ("phi3", Plan(method="lora", seq_len=512, precision="bf16")),
    ("phi3", Plan(method="lora", seq_len=512)),
    ("phi3", Plan(method="lora", seq_len=1024, precision="bf16", gradient_checkpointing=True)),
    ("phi3", Plan(method="lora", seq_len=512, gradient_checkpointing=True)),
    ("phi3", Plan(method="qlora", quant="nf4", seq_len=512, gradient_checkpointing=True)),
]


def _id(p):
    if hasattr(p, "label"):
        return p.label() + (f" | accum {p.grad_accum}" if p.grad_accum > 1 else "")
    return str(p)


@pytest.mark.slow
@pytest.mark.parametrize("model,plan", GRID, ids=_id)
def test_analytic_within_5_percent_of_simulate(model, plan):
    from oomdoctor.engines import estimate

    spec = spec_from_config(MODELS[model], name=model)
    plan = validate(plan)
    sim = estimate(spec, plan, "simulate")
    ana = estimate(spec, plan, "analytic")
    err = (ana.peak_allocated - sim.peak_allocated) / sim.peak_allocated
    comps = {
        c: ana.__dict__[c] - sim.__dict__[c]
        for c in (
            "parameters",
            "master_weights",
            "gradients",
            "optimizer_states",
            "activations",
            "logits",
            "temporaries",
        )
    }
    assert abs(err) <= TOL, f"analytic {err:+.2%} vs simulate; component deltas (analytic - simulate): {comps}"
    # model states are exact in both engines: parameters and optimizer state must agree closely at any peak
    assert abs(ana.parameters - sim.parameters) <= max(0.01 * sim.parameters, 64 * 1024)


#: QLoRA in pure bf16 with peft's k-bit upcast (embeddings, norms, head and biases cast to fp32: an fp32 step around
#: the bf16 quantized matmuls) and without it (``kbit_upcast: false``, as TRL's SFTTrainer runs it: a bf16 step);
#: Qwen2 adds biases to q/k/v (bitsandbytes keeps them unquantized: upcast too).
KBIT_MODELS = {"mini": MINI, "qwen2": dict(MINI, model_type="qwen2")}
_KBIT_FAST = {("mini", "nf4", True)}


def _unquantized_numel(spec) -> int:
    from oomdoctor.memory.parameters import is_quantized

    return sum(g.bias_numel * g.count if is_quantized(g) else g.total_numel for g in spec.groups)


@pytest.mark.parametrize(
    "model,quant,gc",
    [
        pytest.param(
            m,
            q,
            gc,
            id=f"{m}-{q}-{'gc' if gc else 'no-gc'}",
            marks=[] if (m, q, gc) in _KBIT_FAST else [pytest.mark.slow],
        )
        for m in KBIT_MODELS
        for q in ("nf4", "int8")
        for gc in (False, True)
    ],
)
def test_kbit_upcast_on_and_off_within_5_percent_of_simulate(model, quant, gc):
    """The executor skips peft's cast with ``kbit_upcast: false`` and the formulas price the bf16 step it runs: both
    plans within 5 % of the replay, the saving the replay measures priced within 10 %, and the weights exactly 2
    bytes lighter per unquantized element."""
    from oomdoctor.engines import estimate

    spec = spec_from_config(KBIT_MODELS[model], name=model)
    sim, ana = {}, {}
    for up in (True, False):
        plan = validate(
            Plan(method="qlora", quant=quant, precision="bf16", seq_len=512, gradient_checkpointing=gc, kbit_upcast=up)
        )
        sim[up], ana[up] = estimate(spec, plan, "simulate"), estimate(spec, plan, "analytic")
        err = (ana[up].peak_allocated - sim[up].peak_allocated) / sim[up].peak_allocated
        assert abs(err) <= TOL, f"{plan.label()}: analytic {err:+.2%} vs simulate"
    saved_sim = sim[True].peak_allocated - sim[False].peak_allocated
    saved_ana = ana[True].peak_allocated - ana[False].peak_allocated
    assert saved_sim > 0 and abs(saved_ana - saved_sim) <= 0.1 * saved_sim, (saved_ana, saved_sim)
    assert ana[True].parameters - ana[False].parameters == 2 * _unquantized_numel(spec)
    assert abs(sim[True].parameters - sim[False].parameters - 2 * _unquantized_numel(spec)) <= 512 * len(spec.groups)


#: Shapes where one mechanism sets the peak: the B·heads·S² scores of eager attention (small hidden, long sequence),
#: a head tied to a large embedding (full fine-tuning), sliding-window SDPA (window well below the sequence).
EAGER = dict(
    MINI,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=256,
)
TIED = dict(
    MINI,
    hidden_size=512,
    intermediate_size=1024,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=32000,
    tie_word_embeddings=True,
)
SLIDING = dict(EAGER, model_type="mistral", num_hidden_layers=4, sliding_window=64)
GELU_NEW = dict(
    EAGER,
    model_type="phi",
    hidden_size=256,
    intermediate_size=1024,
    num_key_value_heads=8,
    vocab_size=1024,
    hidden_act="gelu_new",
    partial_rotary_factor=0.5,
    resid_pdrop=0.1,
)
MECHANISMS = [
    (
        "eager + GC, LoRA bf16",
        EAGER,
        Plan(method="lora", precision="bf16", attn="eager", seq_len=1024, gradient_checkpointing=True),
    ),
    (
        "eager + GC, full bf16",
        EAGER,
        Plan(method="full", precision="bf16", attn="eager", seq_len=1024, gradient_checkpointing=True),
    ),
    (
        "eager + GC, LoRA fp32",
        EAGER,
        Plan(method="lora", precision="fp32", attn="eager", seq_len=1024, gradient_checkpointing=True),
    ),
    ("tied, full bf16 GC", TIED, Plan(method="full", precision="bf16", seq_len=16, gradient_checkpointing=True)),
    ("tied, accumulation", TIED, Plan(method="full", precision="bf16", seq_len=16, grad_accum=2)),
    (
        "tied, optimizer in backward",
        TIED,
        Plan(method="full", precision="bf16", seq_len=16, optimizer="adamw", optimizer_in_backward=True),
    ),
    ("sliding window, LoRA bf16", SLIDING, Plan(method="lora", precision="bf16", seq_len=256, micro_batch=2)),
    ("sliding window, full fp32", SLIDING, Plan(method="full", precision="fp32", seq_len=256, micro_batch=2)),
    ("gelu_new under autocast", GELU_NEW, Plan(method="full", precision="bf16-mixed", seq_len=512)),
]


@pytest.mark.slow
@pytest.mark.parametrize("cfg,plan", [m[1:] for m in MECHANISMS], ids=[m[0] for m in MECHANISMS])
def test_peak_setting_mechanisms_within_1_percent_of_simulate(cfg, plan):
    """Each was off by 2-12 % before it was measured op by op: eager softmax backward after the MLP's saves are
    freed; the tied weight's two gradients summed out of place; SDPA's additive mask and repeated GQA k/v; the
    fp32 tanh branch of gelu_new under autocast."""
    from oomdoctor.engines import estimate

    spec = spec_from_config(cfg, name="mechanism")
    plan = validate(plan)
    a, s = estimate(spec, plan, "analytic"), estimate(spec, plan, "simulate")
    assert abs(a.peak_allocated - s.peak_allocated) <= 0.01 * s.peak_allocated, (a.peak_allocated, s.peak_allocated)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [
        dict(method="lora", precision="bf16"),
        dict(method="qlora", precision="bf16-mixed"),
        dict(method="qlora", precision="bf16-mixed", offload_activations=True),
        dict(method="qlora", precision="bf16-mixed", tiled_mlp=True),
    ],
    ids=["lora-bf16", "qlora", "qlora-offload", "qlora-tiled"],
)
def test_long_contexts_where_the_blocks_set_the_peak(kw):
    """Llama-3.1-8B at 32k tokens with the chunked loss and checkpointing (peft's defaults, no dropout): the blocks'
    backward sets the peak, and the formulas (the tiled MLP: its measured blocks) stay within 2 % of the replay."""
    from oomdoctor.engines import estimate
    from oomdoctor.model.load import load_spec
    from oomdoctor.plan import Plan as HFPlan

    spec = load_spec("meta-llama/Llama-3.1-8B")
    plan = validate(HFPlan(seq_len=32768, loss="chunked", gradient_checkpointing=True, **kw))
    a, s = estimate(spec, plan, "analytic").peak_allocated, estimate(spec, plan, "simulate").peak_allocated
    assert abs(a - s) / s < 0.02, (a, s)


def _llama_1b_cut(blocks: int):
    """Llama-3.2-1B's bundled config cut to ``blocks`` blocks (scripts/blocks_vs_simulate.shrink)."""
    import sys
    from pathlib import Path

    from oomdoctor.model.architectures import build_spec
    from oomdoctor.model.load import load_spec

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from blocks_vs_simulate import shrink

    return build_spec(shrink(dict(load_spec("meta-llama/Llama-3.2-1B").config), blocks), f"Llama-3.2-1B@{blocks}")


#: LoRA/QLoRA moments on Llama-3.2-1B cut to 2 blocks at 16k tokens (chunked loss + GC), each traced op by op with
#: the simulated engine: (formulas vs replay before the fix)
BLOCK_MOMENTS = {
    # peft's fp32 cast of the 16-bit product for down_proj's adapter, in block 0's recompute after every MLP save;
    # offloaded, the recompute runs outside save_on_cpu (-4.0 % / -8.5 %)
    "down-adapter-cast": dict(method="lora", precision="bf16-mixed"),
    "down-adapter-cast-offloaded": dict(method="lora", precision="bf16-mixed", offload_activations=True),
    # up's adapter in the top block's recompute: gate's output and activation are saved by then (+3.0 %: the
    # backward's adapter terms summed both sides of down's adapter, -6 % once they did not)
    "up-adapter-top-recompute": dict(method="lora", precision="bf16"),
    # with dropout the cast is not saved (the dropout output is): cast, product and dropout output alive (-3.9 %)
    "down-adapter-dropout": dict(method="lora", precision="bf16", lora_dropout=0.05),
    # the product's backward: one residual gradient alive, not two (+2.5 %)
    "product-backward": dict(method="qlora", precision="bf16-mixed"),
    # offloaded: the top block's input is back from the host, and its fp32 norm saves it (-2.5 % with the product's
    # backward fixed alone: it guards the two fixes together)
    "unpacked-top-input": dict(method="qlora", precision="bf16-mixed", offload_activations=True),
    # offloaded full fine-tune: block 0's input is on the host, its unpacked copy dies with the recompute (+1.9 %;
    # +5.0 % on Llama-3.1-8B blocks at 128k tokens)
    "full-offloaded-block-0": dict(method="full", precision="bf16", offload_activations=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("kw", list(BLOCK_MOMENTS.values()), ids=list(BLOCK_MOMENTS))
def test_lora_recompute_and_backward_moments_of_2_blocks_at_16k(kw):
    from oomdoctor.engines import estimate
    from oomdoctor.engines.simulate import simulate_plan
    from oomdoctor.plan import Plan as HFPlan

    spec = _llama_1b_cut(2)
    plan = validate(HFPlan(seq_len=16384, loss="chunked", gradient_checkpointing=True, **kw))
    a = estimate(spec, plan, "analytic").peak_allocated
    s = simulate_plan(spec, plan, layers="full").breakdown.peak_allocated
    assert abs(a - s) / s < 0.005, (a, s)


#: LLM.int8() QLoRA on Llama-3.2-1B cut to 4 blocks at 4k tokens: MatMul8bitLt keeps its input as a ctx attribute (no
#: fp16 copy is saved), which outlives down's backward (formulas vs replay before)
INT8_MOMENTS = {
    "no-gc": dict(precision="bf16", gradient_checkpointing=False),  # +6.3 %: an fp16 copy per linear was priced
    "no-gc-mixed": dict(precision="bf16-mixed", gradient_checkpointing=False),  # -0.9 %: the fp32 inputs were not
    "no-gc-chunked": dict(precision="bf16", gradient_checkpointing=False, loss="chunked"),  # -2.8 %: product held
    "gc-chunked": dict(precision="bf16", gradient_checkpointing=True, loss="chunked"),  # +4.9 %: recompute's ctx
}


@pytest.mark.slow
@pytest.mark.parametrize("kw", list(INT8_MOMENTS.values()), ids=list(INT8_MOMENTS))
def test_int8_inputs_held_by_the_matmuls_ctx(kw):
    from oomdoctor.engines import estimate
    from oomdoctor.engines.simulate import simulate_plan
    from oomdoctor.plan import Plan as HFPlan

    spec = _llama_1b_cut(4)
    plan = validate(HFPlan(method="qlora", quant="int8", seq_len=4096, **kw))
    a = estimate(spec, plan, "analytic").peak_allocated
    s = simulate_plan(spec, plan, layers="full").breakdown.peak_allocated
    assert abs(a - s) / s < 0.01, (a, s)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [dict(method="lora", precision="bf16"), dict(method="qlora", quant="int8", precision="bf16")],
    ids=["lora-bf16", "int8"],
)
def test_offloading_without_checkpointing_device_and_host(kw):
    """save_on_cpu without checkpointing: every save goes to the host, but the running MLP still references its
    inputs and outputs (the up adapter's fp32 outputs, the activation's output, peft's fp32 input copy); the host
    gets a copy per save — each linear's weight, a norm's fp32 input twice, an input several adapters save — and
    the final norm's saves and the chunks' inputs. Llama-3.2-1B cut to 4 blocks at 4k tokens with the chunked loss:
    device -17 % (LoRA bf16) and -8 % (int8 QLoRA), host 24 % and 27 % short before."""
    from oomdoctor.engines import estimate
    from oomdoctor.engines.simulate import simulate_plan
    from oomdoctor.plan import Plan as HFPlan

    spec = _llama_1b_cut(4)
    plan = validate(HFPlan(seq_len=4096, loss="chunked", offload_activations=True, **kw))
    a = estimate(spec, plan, "analytic")
    s = simulate_plan(spec, plan, layers="full").breakdown
    assert abs(a.peak_allocated - s.peak_allocated) / s.peak_allocated < 0.02, (a.peak_allocated, s.peak_allocated)
    assert abs(a.cpu_offloaded - s.cpu_offloaded) / s.cpu_offloaded < 0.04, (a.cpu_offloaded, s.cpu_offloaded)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [dict(method="qlora", quant="int8", precision="bf16"), dict(method="lora", precision="bf16-mixed")],
    ids=["int8", "lora-mixed"],
)
def test_offloaded_activations_device_and_host_bytes(kw):
    """save_on_cpu under checkpointing: LLM.int8()'s inputs, held as ctx attributes, never reach the hooks and stay
    on the device (device -10.5 % before); the standard loss's log-probabilities (packed twice) and the head's saved
    weight go to the host (host bytes 81-98 % short before). Llama-3.2-1B cut to 4 blocks at 4k tokens."""
    from oomdoctor.engines import estimate
    from oomdoctor.engines.simulate import simulate_plan
    from oomdoctor.plan import Plan as HFPlan

    spec = _llama_1b_cut(4)
    plan = validate(HFPlan(seq_len=4096, gradient_checkpointing=True, offload_activations=True, **kw))
    a = estimate(spec, plan, "analytic")
    s = simulate_plan(spec, plan, layers="full").breakdown
    assert abs(a.peak_allocated - s.peak_allocated) <= 0.01 * s.peak_allocated, (a.peak_allocated, s.peak_allocated)
    assert abs(a.cpu_offloaded - s.cpu_offloaded) <= 0.05 * s.cpu_offloaded, (a.cpu_offloaded, s.cpu_offloaded)


#: Attention, norm and MLP moments on transformers' default configs at a tiny size (4 blocks, 2 x 256 tokens, where the
#: seq^2 scores and the small terms weigh): the error of the formulas before, against the replay.
TINY_CONFIG_MOMENTS = {
    # eager attention: its saves were priced again as forward transients (+13.5 %), its mask at the loss (+2 %)
    "llama full fp32 eager": ("llama", {}, dict(method="full", precision="fp32", attn="eager")),
    # ... and in a checkpointed backward the values, the output copy and a keys' gradient kept (+3.7 %)
    "llama full fp32 eager GC": (
        "llama",
        {},
        dict(method="full", precision="fp32", attn="eager", gradient_checkpointing=True),
    ),
    # Gemma 2 runs eager (soft-capping): two masks (full and sliding), three norms after the attention (+4.4 %)
    "gemma2 full bf16 GC": ("gemma2", {}, dict(method="full", precision="bf16", gradient_checkpointing=True)),
    # a parallel block (Phi): the MLP's backward runs first here too (+14.7 %)
    "phi lora mixed eager GC": (
        "phi",
        {},
        dict(method="lora", precision="bf16-mixed", attn="eager", gradient_checkpointing=True),
    ),
    # Gemma's norm keeps its fp32 product for a trainable weight (-6.2 %)
    "gemma full bf16": ("gemma", {}, dict(method="full", precision="bf16")),
    # OLMo 2's q_norm over all heads (= hidden here) was priced as a hidden norm and again as a q/k norm (+3.6 %)
    "olmo2 lora mixed": ("olmo2", {}, dict(method="lora", precision="bf16-mixed")),
    # ... and with it alone fixed, its full fine-tune's fp32 norm products were missing (-8.7 %)
    "olmo2 full bf16": ("olmo2", {}, dict(method="full", precision="bf16")),
    # ... and its post-MLP norm back-propagates first, every save alive: five fp32 temporaries (-3.3 %)
    "olmo2 lora chunked GC": (
        "olmo2",
        {},
        dict(method="lora", precision="bf16", loss="chunked", gradient_checkpointing=True),
    ),
    # Phi's partial rotary concatenates q: flash lays its output out like q, and the output projection's input is a
    # copy (-3.6 %); with it, LoRA fp32 (adapters reading their input) counted the shared norm output twice (+3.9 %)
    "phi full bf16": ("phi", {}, dict(method="full", precision="bf16")),
    "phi lora fp32": ("phi", {}, dict(method="lora", precision="fp32")),
    # Granite scales the embedding output in its forward: the checkpointed leaf is one more tensor (-3.8 %)
    "granite qlora GC": ("granite", {}, dict(method="qlora", precision="bf16-mixed", gradient_checkpointing=True)),
    # eager and offloaded without checkpointing: the device holds the unpacked softmax output, not the block's
    # saves (-44 %); in fp32 the host keeps the probabilities twice, saved by the softmax and the PV matmul (-27 %)
    "llama lora bf16 eager offloaded": (
        "llama",
        {},
        dict(method="lora", precision="bf16", attn="eager", offload_activations=True),
    ),
    "llama full fp32 eager offloaded": (
        "llama",
        {},
        dict(method="full", precision="fp32", attn="eager", offload_activations=True),
    ),
    # offloaded, the final norm's saves are on the host when the loss back-propagates (+2.9 %)
    "llama lora bf16 offloaded": ("llama", {}, dict(method="lora", precision="bf16", offload_activations=True)),
    # an MLP as wide as the hidden size: its projections were classified as attention inputs by shape (+8.6 %)
    "llama I = h lora q_proj": (
        "llama",
        dict(intermediate_size=64, num_attention_heads=8, head_dim=32),
        dict(method="lora", precision="bf16", lora_targets=("q_proj",)),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("model_type,cfg,kw", list(TINY_CONFIG_MOMENTS.values()), ids=list(TINY_CONFIG_MOMENTS))
def test_attention_norm_and_mlp_moments_of_tiny_default_configs(model_type, cfg, kw):
    from test_blocks import tiny

    from oomdoctor.engines import estimate
    from oomdoctor.plan import Plan as HFPlan

    spec = spec_from_config(tiny(model_type, layers=4, **cfg), name=model_type)
    plan = validate(HFPlan(seq_len=256, micro_batch=2, **kw))
    a, s = estimate(spec, plan, "analytic"), estimate(spec, plan, "simulate")
    err = (a.peak_allocated - s.peak_allocated) / s.peak_allocated
    assert abs(err) < 0.02, (a.peak_allocated, s.peak_allocated, f"{err:+.2%}")
    if plan.offload_activations:
        host = (a.cpu_offloaded - s.cpu_offloaded) / s.cpu_offloaded
        assert abs(host) < 0.03, (a.cpu_offloaded, s.cpu_offloaded, f"host {host:+.2%}")
