#!/usr/bin/env python
"""Rewrite the ``listing`` of every entry in ``configs/models/registry.json`` from its spec (``load_spec``).

``oomdoctor models`` prints these precomputed fields instead of building a spec per entry (the families without a
builder go through transformers, seconds each); tests/test_bundled_configs.py fails when a listing and its spec
disagree, and this script is the fix. ``--check`` only reports the entries that differ (exit 1 when any does).

Usage: python scripts/registry_listing.py [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="report entries whose listing differs; write nothing")
    a = ap.parse_args()

    from oomdoctor.model.load import MODELS_DIR, listing_of, load_spec

    path = MODELS_DIR / "registry.json"
    doc = json.loads(path.read_text())
    stale = []
    for entry in doc["models"]:
        listing = listing_of(load_spec(entry["id"]))
        if entry.get("listing") != listing:
            stale.append(entry["id"])
            entry["listing"] = listing
    for model_id in stale:
        print(f"{'stale' if a.check else 'updated'}: {model_id}")
    if not a.check and stale:
        path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    print(f"{len(stale)} of {len(doc['models'])} listings {'differ' if a.check else 'rewritten'}")
    return 1 if a.check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
