"""Derive this folder's slimmed files from a checkout of Vidur's repository (the H100 operators, one-node collectives).

    python data/measurements/vidur/derive.py PATH_TO_VIDUR_CHECKOUT

Writes ``h100/ops/<model>.csv`` (the median of each operator, in the slimmed layout the other
devices use) and ``<device>/network/<device>_dgx-all_reduce.csv`` for the A100 and H100 with the
rows whose ranks all sit on one node (Vidur's ``devices_per_node`` ≥ ``num_workers``): the
placement tensor parallelism uses. Vidur's sweep also times each size with the ranks spread over
nodes, which the slimmed files cannot tell apart.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
       "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
SHAPE = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp", "num_tokens",
         "num_tensor_parallel_workers")


def slim_ops(source: Path, device: str, model: str, target: Path) -> int:
    with source.open() as f:
        rows = list(csv.DictReader(f))
    ops = [op for op in OPS if f"time_stats.{op}.median" in rows[0]]
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["device", "model", *SHAPE, *(f"{op}_ms" for op in ops)])
        for row in rows:
            writer.writerow([device, model, *(row[c] for c in SHAPE), *(row[f"time_stats.{op}.median"] for op in ops)])
    return len(rows)


def one_node_all_reduce(source: Path, device: str, target: Path) -> int:
    with source.open() as f:
        rows = [r for r in csv.DictReader(f) if int(r["devices_per_node"]) >= int(r["num_workers"])]
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["device", "topology", "collective", "num_workers", "size_bytes", "median_ms"])
        for r in rows:
            writer.writerow([device, f"{device}_dgx", "all_reduce", r["num_workers"], r["size"],
                             r["time_stats.all_reduce.median"]])
    return len(rows)


def main(vidur: Path) -> None:
    profiling = vidur / "data" / "profiling"
    for mlp in sorted((profiling / "compute" / "h100").glob("*/*/mlp.csv")):
        model = mlp.parent.name
        print(f"h100 {model}: {slim_ops(mlp, 'h100', model, HERE / 'h100' / 'ops' / f'{model}.csv')} rows")
    for device in ("a100", "h100"):
        source = profiling / "network" / f"{device}_dgx" / "all_reduce.csv"
        target = HERE / device / "network" / f"{device}_dgx-all_reduce.csv"
        print(f"{device} all-reduce, one node: {one_node_all_reduce(source, device, target)} rows")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
