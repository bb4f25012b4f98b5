"""The eval set and the eval loss of a run (HF Trainer's ``eval_loss``).

The eval set is either a seeded fraction of the tokenized samples held back from training (``dataset.eval_split``)
or a separate file tokenized the same way (``dataset.eval_path``). The loss is the token-weighted mean over the
whole set: every micro-batch of ``per_device_eval_batch_size`` sequences returns its summed token loss
(:meth:`oomdoctor.execute.step.TrainStep.eval_loss`), divided at the end by the number of target tokens — the
number HF reports for ``prediction_loss_only`` up to its per-batch averaging.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from oomdoctor.errors import BadInput


def split_eval(samples: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, eval): ``fraction`` of ``samples`` (at least one) drawn with a generator seeded by ``seed``; the
    train samples keep their original order."""
    import torch

    n = len(samples)
    n_eval = max(1, round(fraction * n))
    if n_eval >= n:
        raise BadInput(
            f"dataset.eval_split {fraction}: {n} sample(s) leave nothing to train on",
            "lower eval_split, add data, or give dataset.eval_path",
        )
    held = set(torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()[:n_eval])
    return ([s for i, s in enumerate(samples) if i not in held], [s for i, s in enumerate(samples) if i in held])


def eval_samples(dcfg: Any, tokenizer: Any, seq_len: int, train: Any, seed: int) -> tuple[Any, list]:
    """(training data, eval samples) for the ``dataset:`` section ``dcfg`` (``train``: the tokenized training data,
    returned without the held-back samples when ``eval_split`` is set). No eval set: ``(train, [])``."""
    from oomdoctor.train.data import tokenize

    if dcfg.eval_split:
        kept, held = split_eval(train.samples, dcfg.eval_split, seed)
        return replace(train, samples=kept), held
    if dcfg.eval_path:
        return train, tokenize(replace(dcfg, path=dcfg.eval_path, max_samples=None), tokenizer, seq_len).samples
    return train, []


def evaluate(
    step: Any,
    samples: list,
    *,
    pad_id: int,
    batch_size: int,
    device: Any,
    pad_to_multiple_of: int | None = None,
    reset_positions: bool = False,
    flatten: bool = False,
) -> float:
    """Token-weighted mean loss of ``step.model`` over ``samples`` (``oomdoctor.train.data.Sample`` rows, collated
    as training collates them: ``reset_positions`` / ``flatten`` for packed rows), no gradients, eval mode."""
    import torch

    from oomdoctor.train.data import collate, count_targets

    total = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(0, len(samples), batch_size):
        batch = collate(samples[i : i + batch_size], pad_id, pad_to_multiple_of, reset_positions, flatten)
        total += step.eval_loss({k: v.to(device, non_blocking=True) for k, v in batch.items()}).double()
    return float(total) / max(1, count_targets(samples))


__all__ = ["split_eval", "eval_samples", "evaluate"]
