"""The longest context a card trains on: ``oomdoctor tune MODEL --gpu-mem 80GB --seq-len max`` with and without the
host RAM that offloaded activations need, for any method and for QLoRA (the Llama-3.1-8B rows of docs/tune.md).

    python scripts/longest_context.py [--model meta-llama/Llama-3.1-8B] [--gpu-mem 80GB] [--verify simulate|none]
                                      [--no-tiled-mlp]

``--verify simulate`` (the default) replays the chosen plan on fake tensors at that length, as tune does without a
GPU, and calibrates the length down when the replay finds it over the card; it takes minutes per row at 100k+
tokens. ``--no-tiled-mlp`` pins tiled MLPs off (what the search reaches without them). Prints one row per case: the
length, the plan, the device memory the memory model predicts (resident, the figure compared with the card), the
replayed one and the host RAM the offload uses.
"""

from __future__ import annotations

import argparse

CASES = (
    ("any method", None, "24GiB"),
    ("any method", None, "512GB"),
    ("qlora", "qlora", "24GiB"),
    ("qlora", "qlora", "512GB"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="meta-llama/Llama-3.1-8B")
    ap.add_argument("--gpu-mem", default="80GB")
    ap.add_argument("--verify", default="simulate", choices=("simulate", "none"))
    ap.add_argument("--no-tiled-mlp", action="store_true", help="search without tiled MLPs")
    args = ap.parse_args()
    pins = {"tiled_mlp": False} if args.no_tiled_mlp else None

    from oomdoctor.tune.tuner import tune
    from oomdoctor.units import format_bytes, parse_size

    print(f"{'method':11} {'host RAM':>9} {'tokens':>8}  {'predicted':>10} {'replayed':>10} {'host used':>10}  plan")
    for label, method, host in CASES:
        r = tune(
            args.model,
            gpu_mem=parse_size(args.gpu_mem),
            seq_len="max",
            method=method,
            verify_mode=args.verify,
            gpu=False,
            host_mem=parse_size(host),
            pins=pins,
        )
        trial = r.trials[-1] if r.trials else None
        predicted = trial.predicted_peak_bytes if trial else r.memory.resident_device
        replayed = format_bytes(trial.measured_peak_bytes) if trial and trial.measured_peak_bytes else "-"
        used = format_bytes(r.memory.host_per_node) if r.memory.host_per_node else "-"
        print(
            f"{label:11} {host:>9} {r.seq_len:>8,}  {format_bytes(predicted):>10} {replayed:>10} {used:>10}  "
            f"{r.plan.label()}",
            flush=True,
        )


if __name__ == "__main__":
    main()
