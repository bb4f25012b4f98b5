"""The block measurements a set of plans needs, made before pricing them on every core (``engines/blocks.py``).

``diagnose`` and ``tune`` price tens of plans one after the other, and each analytic estimate of a model whose blocks
the formulas do not know measures them on first use (seconds of CPU each: a cold diagnose of Jamba makes 18). Before
pricing, :func:`prefetch` collects the distinct measurements the plans need (``blocks.measured_plan``, keyed by
``blocks.cache_key``) that are not cached yet and, when there are two or more, makes them in a pool of worker
processes (one per idle core, :func:`worker_count`; ``spawn``: torch and ``fork`` do not mix). Each
worker imports only what measuring needs (``oomdoctor.imports.cheap_imports`` first) and writes each cache entry as
the serial path does (``blocks.measure_entry``: a file of its own renamed into place), so the serial pricing that
follows reads what it would have measured, byte for byte. The parent reports each finished measurement
(``oomdoctor.progress``, task ``blocks``). A measurement a worker fails to make (a worker killed, a result that does
not come back, a pool the system cannot start) is left to the serial path, which makes it as it always did; an
interrupt ends the workers.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from oomdoctor.errors import BadInput
from oomdoctor.progress import report

if TYPE_CHECKING:
    from oomdoctor.memory.measured import BlockSaves
    from oomdoctor.model.spec import ModelSpec
    from oomdoctor.plan import Plan

#: Environment variable capping the worker processes (default: the cores this process may run on); ``1`` measures
#: in this process, one plan after the other, as each estimate needs it.
WORKERS_ENV = "OOMDOCTOR_WORKERS"


def worker_count() -> int:
    """Processes the measurements may use: :data:`WORKERS_ENV` when set (at most the cores this process may run on),
    else the cores other processes leave idle now (:func:`busy_cores`; at least one): each worker imports torch,
    transformers and peft (~8 s of CPU) and warms its caches again, which only pays where it gets a core of its own
    (on 2 busy cores, 2 workers made a cold diagnose of Gemma 4 153 s where the serial path took 134 s:
    benchmarks/cold_diagnose.py). This process waits for the workers meanwhile."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    raw = os.environ.get(WORKERS_ENV, "").strip()
    if not raw:
        return max(1, min(cores, round(cores - busy_cores())))
    if not raw.isdigit() or int(raw) < 1:
        raise BadInput(
            f"{WORKERS_ENV}={raw!r}: give a number of processes (1 measures in this one)",
            f"unset {WORKERS_ENV} to use every core, or set it to 1",
        )
    return min(int(raw), cores)


#: How long :func:`busy_cores` watches the machine's CPU time.
SAMPLE_S = 0.2


def busy_cores() -> float:
    """Cores the machine's other processes keep busy now: the CPU time ``/proc/stat`` counts over :data:`SAMPLE_S`
    (this process sleeps meanwhile), else (no ``/proc``: macOS) the last minute's load average, which also counts
    what ended up to a minute ago (a diagnose just before this one)."""
    import time

    try:
        before = _cpu_ticks()
        time.sleep(SAMPLE_S)
        after = _cpu_ticks()
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]
    busy, total = after[0] - before[0], after[1] - before[1]
    return (os.cpu_count() or 1) * busy / total if total > 0 else 0.0


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of every core since boot (the ``cpu`` line of ``/proc/stat``: user nice system idle
    iowait irq softirq steal ...; idle and iowait are the idle ones)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def pending(spec: "ModelSpec", plans: Iterable["Plan"]) -> dict[str, "Plan"]:
    """The measurements pricing ``plans`` on ``spec`` with the analytic engine needs and the cache does not hold, by
    cache key, in the order the plans first need them. Empty when a plan is refused (``check_plan_for_model``): the
    serial pricing reports it before measuring anything more."""
    from oomdoctor.engines.blocks import PREFETCHED, cache_key, measured_plan, measures_blocks, read_entry
    from oomdoctor.model.execution import check_plan_for_model

    needed: dict[str, Plan] = {}
    for plan in plans:
        try:
            check_plan_for_model(spec, plan)
        except BadInput:
            return {}
        if measures_blocks(spec, plan):
            measured = measured_plan(plan)
            needed.setdefault(cache_key(spec, measured), measured)
    return {key: plan for key, plan in needed.items() if key not in PREFETCHED and read_entry(key) is None}


def prefetch(spec: "ModelSpec", plans: Iterable["Plan"]) -> int:
    """Make the measurements :func:`pending` for ``plans`` in worker processes when two or more are missing and
    more than one process may run (:func:`worker_count`); returns how many the workers made."""
    todo = pending(spec, plans)
    if len(todo) < 2:  # before counting idle cores: that watches the machine for a moment
        return 0
    workers = min(worker_count(), len(todo))
    if workers < 2:
        return 0
    return _in_pool(spec, todo, workers)


def _in_pool(spec: "ModelSpec", todo: dict[str, "Plan"], workers: int) -> int:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from oomdoctor.cache import entry_path
    from oomdoctor.engines.blocks import PREFETCHED
    from oomdoctor.files import discard_partial_write

    message = (
        f"measuring what {spec.model_type} blocks save under {len(todo)} sets of knobs in {workers} "
        "processes (once: cached)"
    )
    try:
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker)
    except (OSError, ImportError):  # no process-shared semaphores here (a sandbox without /dev/shm): serially
        return 0
    made = 0
    try:
        futures = _submitted(pool, spec, todo)
        report("blocks", message, 0, len(todo))
        for done, future in enumerate(as_completed(futures), 1):
            key = futures[future]
            try:
                PREFETCHED[key] = future.result()
                made += 1
            except Exception:  # noqa: BLE001 - a worker lost (killed, out of memory): the serial path measures it
                discard_partial_write(entry_path("blocks", key))  # what a killed worker was writing
            report("blocks", message, done, len(todo))
    except BaseException:  # an interrupt: end the workers now, not after their measurement
        for process in list(getattr(pool, "_processes", {}).values()):  # no public way before Python 3.14
            process.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return made


def _submitted(pool, spec: "ModelSpec", todo: dict[str, "Plan"]) -> dict:
    """The measurements handed to ``pool``'s workers (future: cache key); those a pool broken on the way (a worker
    that could not start) did not take are left to the serial path."""
    futures: dict = {}
    with _main_left_out():  # the workers start as the first tasks are submitted
        for key, plan in todo.items():
            try:
                futures[pool.submit(_measure, spec, plan)] = key
            except Exception:  # noqa: BLE001 - BrokenProcessPool, a process the system refused to start
                break
    return futures


@contextmanager
def _main_left_out() -> Iterator[None]:
    """``spawn`` runs the parent's ``__main__`` again in each worker, a script's top level included when it lacks an
    ``if __name__ == "__main__"`` guard (a library caller's script would diagnose again in every worker): the workers
    need nothing from it, so the processes started inside see an empty one."""
    import sys
    import types

    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _start_worker() -> None:
    """A worker's set-up: the cheaper bitsandbytes import, the third-party messages the CLI silences, stdout onto
    stderr (a ``--json`` document on stdout stays whole), interrupts left to the parent, and an exit that skips
    the interpreter's teardown (seconds once torch is imported)."""
    import atexit
    import signal
    import sys

    from oomdoctor.imports import cheap_imports
    from oomdoctor.noise import quiet_third_party

    cheap_imports()
    quiet_third_party()
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    atexit.register(_exit_now)  # registered first, runs last: after torch's and multiprocessing's handlers


def _exit_now() -> None:
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _measure(spec: "ModelSpec", plan: "Plan") -> "BlockSaves | None":
    from oomdoctor.engines.blocks import measure_entry

    return measure_entry(spec, plan)


__all__ = ["WORKERS_ENV", "busy_cores", "pending", "prefetch", "worker_count"]
