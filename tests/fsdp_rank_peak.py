"""One rank of a real FSDP2 job, started by torchrun (not a test module; used by tests/test_simulate_fsdp.py).

    torchrun --standalone --nproc-per-node 2 tests/fsdp_rank_peak.py '<config.json dict>' '<Plan kwargs>'

Joins the gloo process group, then runs the plan's two steps through the shared executor -- meta build
(``oomdoctor.execute.build``), ``apply_fsdp`` (``oomdoctor.execute.shard``), each rank materializing its own shards,
the executor's ``TrainStep`` (``oomdoctor.execute.step``) under ``LiveBytes`` -- via the simulated engine's real-tensor
reference :func:`oomdoctor.engines.simulate.real_cpu_run`, and prints one JSON line per rank:
``{"rank", "peak", "phase_peaks"}``.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import torch.distributed as dist

    from oomdoctor.engines.simulate import real_cpu_run
    from oomdoctor.model.load import spec_from_config
    from oomdoctor.plan import Plan, validate

    cfg, plan_kw = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    try:
        stats = real_cpu_run(spec_from_config(cfg, name="tiny-llama"), validate(Plan(**plan_kw)))
        print(json.dumps({"rank": dist.get_rank(), "peak": stats.peak, "phase_peaks": stats.phase_peaks}), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
