"""``oomdoctor train CONFIG``: run the plan for real, recovering from OOM without losing a step (or --dry-run it)."""

from __future__ import annotations

import os
import sys
import uuid
from contextlib import nullcontext
from dataclasses import replace
from typing import Optional

import typer

from oomdoctor.cli.app import app
from oomdoctor.cli.console import showing_progress
from oomdoctor.cli.output import emit_json
from oomdoctor.progress import report

HELP = """Train from a YAML config (what `oomdoctor tune` writes; `oomdoctor keys` lists every key with its meaning).

Every technique in the config is really applied (precision, bitsandbytes 4/8-bit + LoRA, gradient checkpointing,
the optimizer, optimizer/activation offload). When a micro-batch runs out of memory it is split in two and both
halves are accumulated: same data, same effective batch; the smaller micro-batch is kept. If one sample does not
fit, a checkpoint is saved and the run exits 4. Checkpoints are atomic; --resume continues exactly.

--dry-run validates and prices the config without training: exit 0 fits, 3 does not (with the changes that fit).
On a CPU, --gpu-mem SIZE caps live tensor bytes and raises torch's OutOfMemoryError past it (a simulated GPU).

An output_dir that already holds a run is refused unless --resume (continue it) or --overwrite (replace it); a lock
stops a second run into the same directory. Ctrl-C finishes the step, saves a checkpoint and exits 130.

Several processes: --nproc-per-node N (or world_size in the config) runs torchrun inside; strategy ddp replicates
the model, fsdp shards it with FSDP2 (sharded checkpoints; an OOM on a rank restarts every rank with half the
micro-batch, --max-restarts). offload_params: true runs FSDP2 with CPU offload, on one process too. zero2/zero3 run
DeepSpeed ZeRO (pip install 'oomdoctor\\[deepspeed]'): same loop, checkpoints and OOM restarts as fsdp.

Exit codes: 0 done / fits, 2 bad input (every config problem listed), 3 does not fit, 4 OOM not recoverable,
74 a checkpoint or output could not be written (disk full: the previous checkpoint is intact), 130 interrupted
(checkpoint saved).
"""
HELP = "\n\n".join(" ".join(par.split()) for par in HELP.strip().split("\n\n"))


def _fmt(n) -> str:
    from oomdoctor.units import format_bytes

    return format_bytes(n)


class _Reporter:
    """Progress: rich live bar (loss, tokens/s, peak memory) on a terminal, plain lines otherwise (stderr)."""

    def __init__(self, tty: bool):
        from rich.console import Console

        self.tty = tty
        self.console = Console(stderr=True)
        self.setup_view = None
        """The set-up's progress display (``oomdoctor.cli.console.showing_progress``), closed when training starts."""
        self.progress = None
        self.task = None
        self._first: tuple[int, float] | None = None

    def __call__(self, e: dict) -> None:
        kind = e["type"]
        if kind == "start":
            if self.setup_view is not None:
                self.setup_view.close()
            line = (
                f"training on {e['device']}: {e['plan']}; {e['params']:,} params ({e['trainable']:,} trainable); "
                f"{e['samples']} samples; effective batch {e['effective_batch']} (micro {e['micro_batch']})"
                + (f"; memory cap {_fmt(e['cap'])}" if e.get("cap") else "")
            )
            self._print(line)
            if self.tty:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )

                self.progress = Progress(
                    TextColumn("[bold]train"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"),
                    TimeElapsedColumn(),
                    TextColumn("eta"),
                    TimeRemainingColumn(),
                    console=self.console,
                    transient=False,
                )
                self.progress.start()
                self.task = self.progress.add_task("train", total=e["max_steps"], completed=e["step"], info="")
        elif kind == "step":
            info = (
                f"loss {e['loss']:.4f}  {e['tokens_per_s']:,.0f} tok/s  peak {_fmt(e['peak_bytes'])}  "
                f"micro {e['micro_batch']}x{e['grad_accum']}"
            )
            if self.progress is not None:
                self.progress.update(self.task, completed=e["step"], info=info)
            else:
                self._print(
                    f"step {e['step']}/{e['max_steps']}  {info}  lr {e['lr']:.3g}  epoch {e['epoch']:.2f}"
                    + self._eta(e["step"], e["max_steps"])
                )
        elif kind == "eval":
            self._print(f"eval at step {e['step']}: eval_loss {e['eval_loss']:.4f} ({e['samples']} samples)")
        elif kind == "oom":
            self._print(
                f"OOM at step {e['step']} ({e['phase']}) with micro-batch {e['failed_micro_batch']}: split "
                f"into {e['new_micro_batch']} + {e['failed_micro_batch'] - e['new_micro_batch']}"
                f"{' (step replayed)' if e['replayed'] else ''}; now micro {e['new_micro_batch']} x "
                f"{e['grad_accum']} accumulation, same effective batch"
            )
        elif kind == "checkpoint":
            self._print(f"checkpoint {e['path']}")
        elif kind == "info":
            self._print(e["message"])

    def _eta(self, step: int, total: int) -> str:
        """``  eta 1m05s`` from the pace since the first logged step (plain lines; the bar has its own)."""
        import time

        now = time.perf_counter()
        if self._first is None:
            self._first = (step, now)
            return ""
        s0, t0 = self._first
        if step <= s0:
            return ""
        left = (total - step) * (now - t0) / (step - s0)
        return f"  eta {int(left // 60)}m{int(left % 60):02d}s"

    def _print(self, line: str) -> None:
        if self.progress is not None:
            self.progress.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _print_dry(d) -> None:
    from oomdoctor.cli.console import out_console, print_table
    from oomdoctor.cli.render import breakdown_table

    con = out_console()
    ranks = f" x {d.plan.world_size} GPUs" if d.plan.world_size > 1 else ""
    con.print(
        f"[bold]{d.spec.name}[/]: {d.plan.label()}; micro-batch {d.plan.micro_batch} x {d.plan.grad_accum} "
        f"accumulation{ranks} = effective batch {d.plan.effective_batch}; seq_len {d.plan.seq_len}"
    )
    print_table(con, breakdown_table(d.memory))
    if d.eval_memory is not None:
        e = d.eval_memory
        con.print(
            f"eval phase (per_device_eval_batch_size, no gradients): {d.compared.replace('_', ' ')} "
            f"{_fmt(int(getattr(e, d.compared)))} = states {_fmt(e.states)} + logits {_fmt(e.logits)} + "
            f"activations {_fmt(e.activations)} + AMP copies {_fmt(e.amp_copies)}"
            + (f" + overheads {_fmt(e.overheads)}" if d.compared == "resident_device" else "")
        )
    for n in d.notes:
        con.print(f"[dim]note: {n}[/]")
    if d.fits is None:
        con.print(f"predicted {d.compared.replace('_', ' ')}: {_fmt(d.needed)}; no budget given: no verdict")
        return
    verdict = "[green]fits[/]" if d.fits else "[red]does not fit[/]"
    con.print(
        f"{verdict}: {d.compared.replace('_', ' ')} {_fmt(d.needed)} vs {_fmt(d.budget.limit_bytes)} "
        f"({d.capacity_source} {_fmt(d.capacity)} - margin {_fmt(d.budget.margin_bytes)})"
    )
    if d.fits or d.train_fits:
        return
    comps = {
        k: getattr(d.memory, k)
        for k in (
            "parameters",
            "master_weights",
            "gradients",
            "optimizer_states",
            "activations",
            "logits",
            "temporaries",
        )
    }
    top = max(comps, key=comps.get)
    con.print(f"largest component: {top.replace('_', ' ')} {_fmt(comps[top])}")
    adv = d.advice
    if adv is None:
        return
    fitting = [c for c in adv.single if c.fits]
    if fitting:
        con.print("changes that make it fit:")
        for c in fitting[:5]:
            con.print(f"  - {c.description} (saves {_fmt(c.saves_bytes)}; {c.yaml})")
    elif adv.path:
        con.print(
            "no single change is enough; cheapest combination"
            + (" that fits:" if adv.path_fits else " (still does not fit):")
        )
        for k, c in enumerate(adv.path, 1):
            con.print(f"  {k}. {c.description} (saves {_fmt(c.saves_bytes)}; {c.yaml})")
    else:
        for c in adv.single[:3]:
            con.print(f"  - {c.description} (saves {_fmt(c.saves_bytes)})")


#: Flags the launcher consumes (the processes it starts get the rest of the command line).
_LAUNCH_FLAGS = {
    "--nproc-per-node": 1,
    "--nnodes": 1,
    "--node-rank": 1,
    "--rdzv-endpoint": 1,
    "--rdzv-id": 1,
    "--max-restarts": 1,
}


def _without_launch_flags(args: list[str]) -> list[str]:
    out, skip = [], 0
    for a in args:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in _LAUNCH_FLAGS:
            skip = 0 if "=" in a else _LAUNCH_FLAGS[name]
            continue
        out.append(a)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return int(sock.getsockname()[1])


def _torchrun(
    nproc: int,
    max_restarts: int,
    nnodes: str | None,
    node_rank: int | None,
    rdzv: str | None,
    command: list[str],
    rdzv_id: str | None = None,
) -> int:
    """Run ``command`` (``-m oomdoctor train ...``) in ``nproc`` processes through torch's own launcher
    (``torch.distributed.run``, in this process); the exit code of the first failed rank, or 0."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from oomdoctor.errors import EXIT_INTERRUPTED
    from oomdoctor.noise import quiet_planned_restarts

    quiet_planned_restarts()
    argv = ["--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts)]
    if rdzv is None and nnodes is None:
        rdzv = f"localhost:{_free_port()}"
    if rdzv_id is None and nnodes is None:
        rdzv_id = uuid.uuid4().hex  # this launch's TORCHELASTIC_RUN_ID (restart markers name it)
    for flag, value in (
        ("--nnodes", nnodes),
        ("--node-rank", node_rank),
        ("--rdzv-endpoint", rdzv),
        ("--rdzv-id", rdzv_id),
    ):
        if value is not None:
            argv += [flag, str(value)]
    # the c10d rendezvous on a fixed port: with --standalone (port 0) or the static one, torch 2.13's restarted
    # ranks hang in gloo's connectFullMesh (measured), so --max-restarts could not restart anything
    argv += ["--rdzv-backend", "c10d"]
    args = get_args_parser().parse_args(argv + ["--no-python", sys.executable] + command)
    try:
        run(args)
    except ChildFailedError as exc:  # the ranks already printed their one-line messages
        _, first = exc.get_first_failure()  # the rank that failed first (the others were stopped because of it)
        return first.exitcode if first.exitcode and first.exitcode > 0 else 1
    except SignalException:  # Ctrl-C: the launcher passed it on; the ranks finished the step and saved
        print(
            "interrupted: the ranks finished their step and saved a checkpoint; continue with --resume", file=sys.stderr
        )
        return EXIT_INTERRUPTED
    return 0


def _failed_because_of_a_peer(cfg, job) -> bool:
    """Under torchrun: another rank already failed (an OOM restart, or an error it reported): this rank's own
    failure (a collective whose peer is gone) is a consequence, exit quietly."""
    from pathlib import Path

    from oomdoctor.train import restart

    if not job.run_id:
        return False
    if restart.peer_ran_out(Path(cfg.output_dir).expanduser(), job):
        return True
    return restart.earlier_failure(job, any_attempt=True) is not None


@app.command(help=HELP)
def train(
    config: str = typer.Argument(..., help="train YAML (e.g. configs/train/tiny-cpu.yaml)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="validate and estimate only: exit 0 fits, 3 does not"),
    gpu_mem: Optional[str] = typer.Option(
        None,
        "--gpu-mem",
        "--mem",
        help="memory budget of the device, e.g. 24GB / 24GiB: the dry-run verdict; caps "
        "the run (on the CPU: its live tensor bytes)",
    ),
    engine: str = typer.Option("analytic", "--engine", help="estimator: analytic | simulate | measure"),
    resume: bool = typer.Option(False, "--resume", help="continue from the newest checkpoint in output_dir"),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="replace the run already in output_dir (HF overwrite_output_dir)"
    ),
    json_out: bool = typer.Option(False, "--json", help="print one JSON summary object on stdout"),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="override max_steps of the config"),
    strategy: Optional[str] = typer.Option(
        None,
        "--strategy",
        help="single | ddp | fsdp | zero2 | zero3 (overrides the config's strategy): ddp "
        "replicates the model, fsdp shards it with FSDP2, zero2/zero3 with DeepSpeed ZeRO",
    ),
    nproc_per_node: Optional[int] = typer.Option(
        None,
        "--nproc-per-node",
        help="data-parallel processes on this node: runs torch's launcher, "
        "torch.distributed.run (torchrun), with this command in every process "
        "(default: the config's world_size on this node, else 1)",
    ),
    nnodes: Optional[str] = typer.Option(None, "--nnodes", help="torchrun --nnodes (multi-node)"),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="torchrun --node-rank"),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="torchrun --rdzv-endpoint host:port"),
    rdzv_id: Optional[str] = typer.Option(
        None,
        "--rdzv-id",
        help="torchrun --rdzv-id: a job id unique to this run, the same on every node "
        "(single node: a fresh one is made)",
    ),
    max_restarts: Optional[int] = typer.Option(
        None,
        "--max-restarts",
        help="torchrun --max-restarts (default 3 with fsdp/zero2/zero3: each OOM restarts the "
        "job with half the micro-batch; 0 otherwise)",
    ),
) -> None:
    # before anything can initialize CUDA (the allocator reads it once); a user's own setting wins
    from oomdoctor.memory.runtime import set_allocator_env

    set_allocator_env()
    from oomdoctor.engines import ENGINES
    from oomdoctor.errors import BadInput
    from oomdoctor.train.config import load_train_config
    from oomdoctor.units import parse_size

    if engine not in ENGINES:
        raise BadInput(f"--engine {engine!r}: use one of {', '.join(ENGINES)}")
    if max_steps is not None and max_steps < 1:
        raise BadInput(f"--max-steps must be >= 1, got {max_steps}")
    cap = parse_size(gpu_mem, what="--gpu-mem") if gpu_mem is not None else None
    from oomdoctor.train import restart

    earlier = restart.earlier_failure(restart.job())
    if earlier is not None:  # torchrun restarted a job that failed for another reason than an OOM: stop at once
        raise typer.Exit(earlier)
    cfg = load_train_config(config)
    if strategy is not None:
        from oomdoctor.plan.plan import STRATEGIES

        if strategy not in STRATEGIES:
            raise BadInput(f"--strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
        cfg = replace(cfg, strategy=strategy)
    if nproc_per_node is not None and nproc_per_node < 1:
        raise BadInput(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    launched = "LOCAL_RANK" in os.environ
    nproc = nproc_per_node or (cfg.world_size if not nnodes else 1)
    world = nproc * int(nnodes) if nnodes and nnodes.isdigit() else (None if nnodes else nproc)
    if dry_run and world is not None and cfg.world_size == 1:
        cfg = replace(cfg, world_size=world)
    elif not dry_run and not launched and world is not None:
        from oomdoctor.train.setup import resolve_topology

        cfg = resolve_topology(cfg, world)  # one message here rather than one per rank
    if not dry_run and (nproc > 1 or nnodes) and not launched:
        from oomdoctor.train.preflight import check

        check(cfg, source=config)  # one message here rather than one per rank
        rest = sys.argv[sys.argv.index("train") + 1 :] if "train" in sys.argv else [config]
        if max_restarts is None:
            from oomdoctor.plan.plan import SHARDED

            max_restarts = 3 if cfg.to_plan(micro_batch=1).strategy in SHARDED else 0
        raise typer.Exit(
            _torchrun(
                nproc,
                max_restarts,
                nnodes,
                node_rank,
                rdzv_endpoint,
                ["-m", "oomdoctor", "train"] + _without_launch_flags(rest),
                rdzv_id,
            )
        )
    if dry_run:  # priced per rank, for the world size the launch flags (or the config) give
        from oomdoctor.train.dryrun import dry_run as do_dry

        with showing_progress():
            d = do_dry(cfg, gpu_mem=cap, engine=engine, source=config)
        if json_out:
            emit_json({"config": config, **d.to_dict()}, indent=1)
        else:
            _print_dry(d)
        if d.fits is False:
            raise typer.Exit(code=3)
        return

    from oomdoctor.errors import OomDoctorError

    rep = _Reporter(tty=sys.stderr.isatty() and not json_out)
    job = restart.job()
    try:
        with showing_progress() if os.environ.get("RANK", "0") == "0" else nullcontext() as rep.setup_view:
            report("train", "setting up: loading torch and transformers")
            from oomdoctor.train.loop import train as run_train

            res = run_train(
                cfg,
                gpu_mem=cap,
                max_steps=max_steps,
                resume=resume,
                overwrite=overwrite,
                engine=engine,
                on_event=rep,
                command=f"oomdoctor train {config}",
                source=config,
            )  # --json: cli.output
    except OomDoctorError as exc:
        if _failed_because_of_a_peer(cfg, job):
            raise typer.Exit(restart.earlier_failure(job) or 1) from None
        restart.record_failure(exc.exit_code, job)
        if json_out:  # CI still gets one JSON object; the message also goes to stderr (oomdoctor.cli.main)
            emit_json({"config": config, "error": exc.message, "hint": exc.hint, "exit_code": exc.exit_code}, indent=1)
        raise
    except Exception:
        if _failed_because_of_a_peer(cfg, job):  # the peer's message is the one to read
            raise typer.Exit(restart.earlier_failure(job) or 1) from None
        restart.record_failure(1, job)
        raise
    finally:
        rep.close()
    if os.environ.get("RANK", "0") != "0":
        return  # rank 0 reports for the job
    if json_out:
        emit_json({"config": config, **res.to_dict()}, indent=1)
        return
    pred = res.memory.get("peak_allocated_bytes") if res.memory else None
    loss = (
        f"loss {res.first_loss:.4f} -> {res.final_loss:.4f}"
        if res.first_loss is not None and res.final_loss is not None
        else "no step run"
    )
    print(
        f"done: {res.optimizer_steps} optimizer steps, effective batch {res.effective_batch_size} "
        f"(micro {res.micro_batch_size} x {res.gradient_accumulation_steps}), {loss}"
    )
    print(
        f"peak memory {_fmt(res.measured_peak_bytes)} measured"
        + (
            f" vs {_fmt(pred)} predicted (peak allocated"
            + (", at the configured micro-batch)" if res.oom_recoveries else ")")
            if pred
            else ""
        )
        + f"; OOM recoveries {res.oom_recoveries}; {res.tokens_per_second:,.0f} tokens/s"
    )
    if res.eval_loss is not None:
        print(f"eval_loss {res.eval_loss:.4f} after {res.epoch:.2f} epoch(s)")
    print(
        f"model: {res.output_dir} (from_pretrained-loadable); last checkpoint: {res.checkpoint}; "
        f"metrics: {res.output_dir}/metrics.jsonl"
    )
    for n in res.notes:
        print(f"note: {n}")
