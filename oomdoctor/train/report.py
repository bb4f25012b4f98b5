"""Where a run's metrics go: ``output_dir/metrics.jsonl`` always, plus the ``report_to`` sinks.

Each record is one JSON line — ``{"step", "epoch", "loss", "learning_rate", "tokens_per_second", "peak_bytes",
"micro_batch", "grad_accum", "time"}`` for training steps (every ``logging_steps``), ``{"step", "epoch",
"eval_loss", "time"}`` for evaluations. The sinks get the same numbers under HF Trainer's names (``train/loss``,
``train/learning_rate``, ``eval/loss``...) through their own libraries, which are optional extras:

* ``tensorboard``: event files under ``output_dir/runs`` (``torch.utils.tensorboard.SummaryWriter``; needs the
  ``tensorboard`` package);
* ``wandb``: ``wandb.init(dir=output_dir)`` then ``wandb.log`` (project from ``WANDB_PROJECT``, as HF);
* ``mlflow``: ``mlflow.start_run`` then ``mlflow.log_metrics`` (tracking URI from ``MLFLOW_TRACKING_URI``);
* ``trackio``: ``trackio.init(project=...)`` then ``trackio.log``.

A sink whose library is missing is refused before the first step (:func:`check_sinks`), not after an hour.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

from oomdoctor.errors import BadInput
from oomdoctor.files import write_failed

METRICS_FILE = "metrics.jsonl"
#: report_to name -> (module that must import, pip package).
_LIBRARIES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}


def check_sinks(report_to: list[str]) -> None:
    """BadInput naming every ``report_to`` sink whose library is not installed."""
    missing = [
        (name, _LIBRARIES[name][1]) for name in report_to if importlib.util.find_spec(_LIBRARIES[name][0]) is None
    ]
    if missing:
        names = ", ".join(n for n, _ in missing)
        raise BadInput(
            f"report_to: {names}: the library is not installed",
            f"pip install {' '.join(p for _, p in missing)} (or drop it from report_to)",
        )


class Reporter:
    """Writes metric records to ``metrics.jsonl`` and every configured sink; :meth:`close` flushes them."""

    def __init__(self, out_dir: Path, report_to: list[str], *, run_name: str, config: dict, resumed_at: int = 0):
        check_sinks(report_to)
        self.path = Path(out_dir) / METRICS_FILE
        if resumed_at and self.path.exists():
            self._truncate_after(resumed_at)
        self._fh = self.path.open("a")
        self._t0 = time.time()
        self._sinks: list[Any] = [_make_sink(name, Path(out_dir), run_name, config) for name in report_to]

    def _truncate_after(self, step: int) -> None:
        """A resume continues the file: records past the checkpoint's step (run after it, then lost) go."""
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if int(json.loads(line).get("step", 0)) <= step:
                    keep.append(line)
            except (ValueError, AttributeError):
                continue
        self.path.write_text("".join(k + "\n" for k in keep))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One record (``loss``/``eval_loss``/... as in the module docstring)."""
        rec = {"step": step, **metrics, "time": round(time.time() - self._t0, 3)}
        try:
            self._fh.write(json.dumps(rec) + "\n")
            self._fh.flush()
        except OSError as exc:  # disk full: one message; a resume drops a torn last line (_truncate_after)
            raise write_failed(
                "metrics",
                self.path,
                exc,
                "the records before this step are kept",
                "free space on that disk (or move output_dir), then continue the run with --resume",
            ) from None
        named = {_hf_name(k): v for k, v in metrics.items() if isinstance(v, (int, float))}
        for sink in self._sinks:
            sink.log(step, named)

    def close(self) -> None:
        try:
            self._fh.close()
        except OSError:  # every record was flushed as it was logged; a failed one was reported by log()
            pass
        for sink in self._sinks:
            sink.close()


class NullReporter:
    """What the ranks other than 0 of a data-parallel job log to: nothing (rank 0 reports for the job)."""

    def log(self, step: int, metrics: dict[str, float]) -> None:  # the sink protocol's signature
        return None

    def close(self) -> None:
        return None


def _hf_name(key: str) -> str:
    """HF Trainer's metric names: ``eval/loss``, ``train/loss``, ``train/learning_rate``..."""
    if key.startswith("eval_"):
        return "eval/" + key.removeprefix("eval_")
    return "train/" + key


class _TensorBoard:
    def __init__(self, out_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(log_dir=str(out_dir / "runs"))

    def log(self, step: int, metrics: dict) -> None:
        for k, v in metrics.items():
            self.w.add_scalar(k, v, step)

    def close(self) -> None:
        self.w.close()


class _Wandb:
    def __init__(self, out_dir: Path, run_name: str, config: dict):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "oomdoctor"), name=run_name, dir=str(out_dir), config=config
        )

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, run_name: str, config: dict):
        import mlflow

        self.mlflow = mlflow
        mlflow.start_run(run_name=run_name)
        mlflow.log_params({k: str(v)[:250] for k, v in config.items()})

    def log(self, step: int, metrics: dict) -> None:
        self.mlflow.log_metrics({k.replace("/", "_"): v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class _Trackio:
    def __init__(self, run_name: str, config: dict):
        import trackio

        self.trackio = trackio
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", "oomdoctor"), name=run_name, config=config)

    def log(self, step: int, metrics: dict) -> None:
        self.trackio.log(metrics, step=step)

    def close(self) -> None:
        self.trackio.finish()


def _make_sink(name: str, out_dir: Path, run_name: str, config: dict) -> Any:
    if name == "tensorboard":
        return _TensorBoard(out_dir)
    if name == "wandb":
        return _Wandb(out_dir, run_name, config)
    if name == "mlflow":
        return _Mlflow(run_name, config)
    return _Trackio(run_name, config)


__all__ = ["METRICS_FILE", "NullReporter", "Reporter", "check_sinks"]
