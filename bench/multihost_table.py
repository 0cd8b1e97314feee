"""The multi-host section's table and totals from `tests/cluster/test_multihost.py`'s records.

    .venv/bin/python bench/multihost_table.py [bench/results/multihost.jsonl]

Each line of the file is one run of the test with SLINFER_MULTIHOST_RECORD set (`make test`
appends them); this prints the markdown table of BENCHMARKS' "Several hosts" section (stall per
fault: min, median and max over the runs) and the sentence of totals under it.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from pathlib import Path

DEFAULT = Path(__file__).resolve().parent / "results" / "multihost.jsonl"
# The record names a fault with the host it hit ("host h2 killed"); the table names the fault.
FAULTS = [("nats stream leader", "nats-server leading the request stream killed"),
          ("valkey primary", "valkey primary killed (Sentinel failover)"),
          ("cut off", "node-1's host cut off the network for 8 s"),
          ("killed", "a whole host killed (the drained node's)")]


def stalls(runs: list[dict], part: str) -> list[float]:
    """Every run's stall for the fault whose recorded name contains `part`."""
    return [s for run in runs for name, s in run["stall_s"].items() if part in name]


def table(runs: list[dict]) -> str:
    rows = ["| fault | runs | min s | median s | max s |", "|---|---:|---:|---:|---:|"]
    for part, label in FAULTS:
        values = stalls(runs, part)
        rows.append(f"| {label} | {len(values)} | {min(values):.1f} | "
                    f"{statistics.median(values):.1f} | {max(values):.1f} |")
    return "\n".join(rows)


def totals(runs: list[dict]) -> str:
    errors = Counter()
    for run in runs:
        errors.update(run["errors"])
    moved = sum(1 for run in runs if len(run["long_request_moved"]) == 2)
    left = [run["node_left_view_after_s"] for run in runs]
    cast = [run["multicast"]["seconds"] * 1e3 for run in runs]
    back = [run["cut_node_back_in_view_after_s"] for run in runs
            if "cut_node_back_in_view_after_s" in run]  # recorded since 36e941c
    back_line = (f" The cut host's node was back in the view {min(back):.1f}-{max(back):.1f} s "
                 f"after its network was{_by_primary(runs)}." if back else "")
    answers = [run["cut_node_answers_after_s"] for run in runs
               if "cut_node_answers_after_s" in run]  # recorded since the eleventh session
    if answers:
        back_line += (f" It answered over NATS {min(answers):.1f}-{max(answers):.1f} s after "
                      "(its NATS client reconnects on a schedule of its own).")
    answered = ", ".join(f"{n} answered {code}" for code, n in sorted(errors.items())) or "no errors"
    return (f"Over the {len(runs)} runs: {sum(r['requests'] for r in runs)} requests, "
            f"{sum(r['completed'] for r in runs)} completed with the fault-free text, {answered}, "
            f"{sum(r['ran_twice'] for r in runs)} ran twice. The dead node left the cluster view "
            f"{min(left):.1f}-{max(left):.1f} s after its host died.{back_line} The multicast moved "
            f"{runs[0]['multicast']['bytes'] / 1e6:.1f} MB ({runs[0]['multicast']['blocks_received']}"
            f" blocks) between the hosts in {min(cast):.0f}-{max(cast):.0f} ms; the 1,500-token "
            f"request moved live from the drained node to the other host in {moved} of "
            f"{len(runs)} runs. The fault-free request took "
            f"{statistics.median(r['fault_free_request_s'] for r in runs):.2f} s (median).")


def _by_primary(runs: list[dict]) -> str:
    """Each run's return after the heal with where the valkey primary was during the cut
    (recorded since the cut-off primary refuses writes), where known."""
    known = [(r["cut_node_back_in_view_after_s"], r["valkey_primary_during_cut"]) for r in runs
             if "valkey_primary_during_cut" in r]
    if not known:
        return ""
    return " (" + ", ".join(f"{s:.1f} s with the primary on {host}" for s, host in known) + ")"


def main() -> int:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    print(table(runs))
    print()
    print(totals(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
