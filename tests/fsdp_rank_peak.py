"""One rank of a real FSDP2 job, started by torchrun (not a test module; used by tests/test_simulate_fsdp.py).

    torchrun --standalone --nproc-per-node 2 tests/fsdp_rank_peak.py '<config.json dict>' '<Plan kwargs>' OUT_DIR

Joins the gloo process group, then runs the plan's two steps through the shared executor -- meta build
(``oomdoctor.execute.build``), ``apply_fsdp`` (``oomdoctor.execute.shard``), each rank materializing its own shards,
the executor's ``TrainStep`` (``oomdoctor.execute.step``) under ``LiveBytes`` -- via the simulated engine's real-tensor
reference :func:`oomdoctor.engines.simulate.real_cpu_run`, and writes one JSON file per rank,
``OUT_DIR/rank<N>.json`` = ``{"rank", "peak", "phase_peaks"}`` (a file each: two ranks printing to one inherited stdout
interleave their lines).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    import torch.distributed as dist

    from oomdoctor.engines.simulate import real_cpu_run
    from oomdoctor.model.load import spec_from_config
    from oomdoctor.plan import Plan, validate

    cfg, plan_kw = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    try:
        stats = real_cpu_run(spec_from_config(cfg, name="tiny-llama"), validate(Plan(**plan_kw)))
        rank = dist.get_rank()
        out = {"rank": rank, "peak": stats.peak, "phase_peaks": stats.phase_peaks}
        Path(sys.argv[3], f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
