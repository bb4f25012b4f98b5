"""A cold diagnose makes its block measurements in worker processes (oomdoctor.engines.block_pool), priced byte for
byte as the serial path prices them."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest
from test_blocks import JAMBA, JAMBA_3, tiny

from oomdoctor import cache
from oomdoctor.diagnose.report import diagnose
from oomdoctor.engines import block_pool, blocks
from oomdoctor.errors import BadInput
from oomdoctor.model.load import spec_from_config
from oomdoctor.plan import Plan, validate
from oomdoctor.progress import listening

#: 4 plans, 2 measurements (with and without checkpointing) at a length where Mamba's scan is cut into short sequences.
PINS = dict(method="lora", precision="bf16", seq_len=32)


def test_workers_are_the_idle_cores_or_what_the_environment_says(monkeypatch):
    monkeypatch.delenv(block_pool.WORKERS_ENV, raising=False)
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(block_pool, "busy_cores", lambda: 0.3)
    assert block_pool.worker_count() == cores  # an idle machine: every core
    monkeypatch.setattr(block_pool, "busy_cores", lambda: cores + 1.5)
    assert block_pool.worker_count() == 1  # every core busy: workers would only add their imports
    monkeypatch.setattr(block_pool, "busy_cores", lambda: cores - 0.8)
    assert block_pool.worker_count() == 1  # most of one core idle: one worker is the serial path
    monkeypatch.setenv(block_pool.WORKERS_ENV, "1")
    assert block_pool.worker_count() == 1
    monkeypatch.setenv(block_pool.WORKERS_ENV, "512")
    assert block_pool.worker_count() == cores  # never more processes than cores, whatever the load
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(block_pool.WORKERS_ENV, bad)
        with pytest.raises(BadInput, match=block_pool.WORKERS_ENV):
            block_pool.worker_count()


def test_busy_cores_sees_a_process_that_spins():
    import subprocess
    import sys
    import time

    assert 0 <= block_pool.busy_cores() <= os.cpu_count()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert block_pool.busy_cores() >= 0.5
    finally:
        spinner.kill()
        spinner.wait()


def test_nothing_to_measure_costs_no_look_at_the_machine(monkeypatch, tiny_config):
    """A model the formulas price (or whose measurements are cached) never waits for :func:`busy_cores`."""
    from oomdoctor.diagnose.matrix import enumerate_plans

    def watched():
        raise AssertionError("sampled the machine")

    monkeypatch.delenv(block_pool.WORKERS_ENV, raising=False)
    monkeypatch.setattr(block_pool, "busy_cores", watched)
    spec = spec_from_config(dict(tiny_config), name="tiny-llama")
    assert block_pool.prefetch(spec, enumerate_plans({"seq_len": 64})) == 0


def test_pending_lists_each_uncached_measurement_once(monkeypatch, tmp_path):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    spec = spec_from_config(tiny("jamba", **JAMBA), name="jamba")
    from oomdoctor.diagnose.matrix import enumerate_plans

    plans = enumerate_plans(PINS)
    todo = block_pool.pending(spec, plans)
    assert len(plans) == 4 and [p.gradient_checkpointing for p in todo.values()] == [False, True]
    assert all(blocks.cache_key(spec, p) == k for k, p in todo.items())
    key = next(iter(todo))
    entry = cache.entry_path("blocks", key)
    entry.parent.mkdir(parents=True)
    entry.write_text("{damaged")  # measured again, as the serial path would
    assert list(block_pool.pending(spec, plans)) == list(todo)
    blocks.PREFETCHED[key] = None  # a model a worker could not measure: not tried again
    try:
        assert list(block_pool.pending(spec, plans)) == list(todo)[1:]
    finally:
        del blocks.PREFETCHED[key]
    # a plan the model refuses: nothing measured ahead, the serial pricing reports it first
    assert block_pool.pending(spec, plans + [validate(Plan(method="lora", lora_targets="no_such_module"))]) == {}
    monkeypatch.setenv(block_pool.WORKERS_ENV, "1")
    assert block_pool.prefetch(spec, plans) == 0  # serial: each estimate measures as it needs
    assert [e.name for e in tmp_path.glob("blocks/*")] == [f"{key}.json"]


def _cold(monkeypatch, tmp_path: Path, workers: str, during=None) -> tuple[str, list]:
    """A cold diagnose of the tiny three-block Jamba (fresh cache directory and memory) with ``workers``: its JSON
    document and the progress it reported; ``during(report)`` runs on each report."""
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(block_pool.WORKERS_ENV, workers)
    blocks._cached.cache_clear()
    blocks._LOOPING.clear()
    blocks.PREFETCHED.clear()
    heard: list = []

    def listen(p):
        heard.append(p)
        if during:
            during(p)

    spec = spec_from_config(tiny("jamba", **JAMBA_3), name="jamba")
    with listening(listen):
        doc = diagnose(spec, PINS, advice=False).to_dict()
    return json.dumps(doc, sort_keys=True), heard


def _kill_a_worker(p) -> None:
    """On the pool's first report, SIGKILL one of this process's spawn workers."""
    if p.step != 0:
        return
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                threading.Timer(3.0, os.kill, (int(pid), signal.SIGKILL)).start()  # mid-import or measuring
                return


@pytest.mark.slow
def test_a_cold_parallel_diagnose_prices_what_the_serial_one_does(monkeypatch, tmp_path):
    monkeypatch.setenv(block_pool.WORKERS_ENV, "2")
    if block_pool.worker_count() < 2:
        pytest.skip("one core: the measurements run serially")
    serial, heard = _cold(monkeypatch, tmp_path / "serial", "1")
    assert {p.message.split(" under ")[0] for p in heard} == {"measuring what jamba blocks save"}
    parallel, heard = _cold(monkeypatch, tmp_path / "parallel", "2")
    assert parallel == serial
    # measured by the workers only, reported by the parent as each measurement ends
    assert [(p.step, p.steps) for p in heard] == [(0, 2), (1, 2), (2, 2)]
    assert "in 2 processes" in heard[0].message
    assert _entries(tmp_path / "parallel") == _entries(tmp_path / "serial")
    assert all(e.endswith(".json") for e in _entries(tmp_path / "parallel"))


def _entries(directory: Path) -> list[str]:
    return sorted(e.name for e in (directory / "blocks").iterdir())


@pytest.mark.slow
@pytest.mark.heavy
def test_a_lost_worker_leaves_its_measurement_to_the_serial_path(monkeypatch, tmp_path, capfd):
    """A worker killed mid-import or mid-measurement: the serial path measures what it did not bring back, with the
    same prices and no half-written entry."""
    monkeypatch.setenv(block_pool.WORKERS_ENV, "2")
    if block_pool.worker_count() < 2:
        pytest.skip("one core: the measurements run serially")
    serial, _ = _cold(monkeypatch, tmp_path / "serial", "1")
    capfd.readouterr()
    broken, heard = _cold(monkeypatch, tmp_path / "broken", "2", during=_kill_a_worker)
    assert broken == serial
    assert any(p.message.startswith("measuring what jamba blocks save under lora") for p in heard)  # serially
    assert "Traceback" not in capfd.readouterr().err
    assert _entries(tmp_path / "broken") == _entries(tmp_path / "serial")
