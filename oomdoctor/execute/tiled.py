"""Tiled MLP (plan ``tiled_mlp``): each decoder block's MLP runs over tiles of about ``hidden_size`` tokens, so its
intermediates (gate, up, activation, product: ``tokens x intermediate`` each, fp32 on a bitsandbytes base under
autocast) exist for one tile at a time.

The technique of Snowflake's Arctic Long Sequence Training (Bekman et al. 2025, arXiv 2506.13996, §3.2 "TiledMLP";
DeepSpeed ``runtime/sequence_parallel/ulysses_sp.TiledMLP``), which unsloth and axolotl (``tiled_mlp: true``) adopted
for contexts of 100k+ tokens. Here in pure torch, as DeepSpeed writes it: the forward runs every tile under
``no_grad`` and keeps only the MLP's input; the backward recomputes one tile at a time with autograd on, back-propagates
it at once (its weight gradients accumulate into ``.grad``, its input gradient lands in place in a preallocated
``x_grad`` through the tile's ``.grad``), and frees it before the next. Tiles: ``ceil(tokens / hidden_size)``
(DeepSpeed's and ALST's rule), so a tile's intermediates are about the size of one MLP weight.

Evaluation (no autograd) runs the same tiles into one output buffer. Cost: one more MLP forward per step (the
backward's recompute); under gradient checkpointing the MLP runs three times per step. Exact: the same loss and
gradients up to float summation order (``tests/test_tiled_mlp.py``).

Limits: one process only (``Plan`` validation): DDP, FSDP and ZeRO reduce a gradient once, when it is complete,
and an optimizer stepped in backward would step after the first tile's share. Dense MLPs only: a mixture of experts
routes tokens with load-balancing state across the whole batch (refused for MoE models).
"""

from __future__ import annotations

import math
from functools import lru_cache

from oomdoctor.errors import BadInput
from oomdoctor.model.execution import num_tiles

#: Attribute names under which transformers' decoder blocks hold their MLP.
MLP_NAMES: tuple[str, ...] = ("mlp", "feed_forward", "ffn")


@lru_cache(maxsize=1)
def _function_cls():
    import torch

    class TiledMLPFunction(torch.autograd.Function):
        """``apply(mlp_forward, x, tiles, rng)``: ``mlp_forward`` over ``tiles`` token tiles of ``x`` (see the
        module docstring); ``rng``: record each tile's generator state for the recompute (dropout in the MLP)."""

        @staticmethod
        def forward(ctx, mlp_forward, x, tiles: int, rng: bool):
            dev = x.device.type
            ctx.mlp_forward, ctx.tiles = mlp_forward, tiles
            ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
            ctx.rng = [] if rng else None
            ctx.save_for_backward(x)
            record = (lambda: ctx.rng.append(_rng_state(dev))) if ctx.rng is not None else None
            with torch.no_grad():
                return _no_grad_tiles(mlp_forward, x, tiles, record)

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            dev = x.device.type
            flat = x.detach().reshape(-1, x.shape[-1])
            g = grad.reshape(-1, grad.shape[-1])
            wants_x = ctx.needs_input_grad[1]
            x_grad = torch.zeros_like(flat) if wants_x else None
            grads = _tiles(x_grad, ctx.tiles) if wants_x else None
            enabled, dtype = ctx.autocast
            for k, (tile, g_tile) in _replayed(list(zip(_tiles(flat, ctx.tiles), _tiles(g, ctx.tiles))), x):
                tile = tile.detach().requires_grad_(wants_x)
                if wants_x:
                    tile.grad = grads[k]  # autograd accumulates the tile's input gradient in place, into x_grad
                with torch.random.fork_rng(devices=_cuda_devices(dev), enabled=ctx.rng is not None):
                    if ctx.rng is not None:
                        _set_rng_state(ctx.rng[k], dev)
                    with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled):
                        out = ctx.mlp_forward(tile)
                    torch.autograd.backward(out, g_tile)
                del out, tile
            ctx.mlp_forward = None
            return None, (x_grad.view_as(x) if wants_x else None), None, None

    return TiledMLPFunction


#: Tiles a fake-tensor replay runs per pass (see :func:`_replayed`).
REPLAYED_TILES = 2


def _replayed(items: list, x) -> list:
    """``enumerate(items)``, but on fake tensors (the simulated engine and the block measurement) only the first
    :data:`REPLAYED_TILES`: every tile allocates and frees the same tensors — the first makes the weight gradients,
    the second adds into them, the rest repeat the second — so the peak is reached by then, and a replay of 100k+
    tokens runs a handful of tiles instead of hundreds (checked to the byte against the full loop,
    tests/test_tiled_mlp.py)."""
    from torch._subclasses.fake_tensor import is_fake

    pairs = list(enumerate(items))
    return pairs[:REPLAYED_TILES] if is_fake(x) else pairs


def _no_grad_tiles(mlp_forward, x, tiles: int, before_tile=None):
    """``mlp_forward`` over the token tiles of ``x`` into one output buffer (no list of outputs, no cat), calling
    ``before_tile()`` before each tile."""
    flat = x.reshape(-1, x.shape[-1])
    parts = _tiles(flat, tiles)
    out = None
    for k, tile in _replayed(parts, x):
        if before_tile is not None:
            before_tile()
        y = mlp_forward(tile)
        if out is None:
            out = y.new_empty((flat.shape[0], y.shape[-1]))
        start = k * len(parts[0])
        out[start : start + len(y)].copy_(y)
        del y
    return out.view(*x.shape[:-1], out.shape[-1])


def _tiles(t, n: int) -> list:
    """``n`` row slices (views) of a 2-D ``t``: ``ceil(rows / n)`` rows each, the last one shorter."""
    step = max(1, math.ceil(t.shape[0] / n))
    return [t[i : i + step] for i in range(0, t.shape[0], step)]


def _cuda_devices(device_type: str) -> list:
    import torch

    return [torch.cuda.current_device()] if device_type == "cuda" else []


def _rng_state(device_type: str) -> tuple:
    import torch

    return torch.get_rng_state(), (torch.cuda.get_rng_state() if device_type == "cuda" else None)


def _set_rng_state(state: tuple, device_type: str) -> None:
    import torch

    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def _has_dropout(module) -> bool:
    import torch

    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in module.modules())


def _tiled_forward(mlp):
    """A replacement ``forward`` for the MLP module ``mlp`` (its class's forward, run tile by tile)."""
    plain = type(mlp).forward
    fn = _function_cls()
    dropout = _has_dropout(mlp)  # the modules do not change after the patch; training mode does

    def forward(x, *args, **kwargs):
        import torch

        if args or kwargs or x.dim() < 2:
            return plain(mlp, x, *args, **kwargs)  # a call this wrapper does not know
        tiles = num_tiles(x.numel() // x.shape[-1], x.shape[-1])
        if not torch.is_grad_enabled():  # evaluation: the same tiles, nothing to recompute
            return _no_grad_tiles(lambda t: plain(mlp, t), x, tiles)
        return fn.apply(lambda t: plain(mlp, t), x, tiles, mlp.training and dropout)

    return forward


def tile_mlps(layers: list) -> int:
    """Make the dense MLP of every block in ``layers`` (transformers decoder blocks) run tiled; returns how many.
    BadInput when there is none (a model without dense MLP blocks: pure state-space models, MoE)."""
    n = 0
    for layer in layers:
        for name in MLP_NAMES:
            mlp = getattr(layer, name, None)
            if mlp is None or not hasattr(mlp, "forward") or _is_moe(mlp):
                continue
            mlp.forward = _tiled_forward(mlp)
            n += 1
            break
    if not n:
        raise BadInput(
            "tiled_mlp: this model's blocks have no dense MLP to tile",
            "drop tiled_mlp (set it false / remove --tiled-mlp)",
        )
    return n


def _is_moe(module) -> bool:
    return any(hasattr(module, a) for a in ("experts", "router")) or "moe" in type(module).__name__.lower()


__all__ = ["MLP_NAMES", "tile_mlps"]
