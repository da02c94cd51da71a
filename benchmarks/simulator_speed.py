"""Simulator speed and behaviour: simulated requests per wall second, time per capacity search,
a full catalog table, and checks that the simulator behaves like a continuous-batching engine.

    .venv/bin/python benchmarks/simulator_speed.py
    .venv/bin/python benchmarks/simulator_speed.py --all-models   # every bundled model × catalog
    .venv/bin/python benchmarks/simulator_speed.py --quick        # every part on small inputs, seconds

Speed figures come with a baseline from the same run (the roofline without the
step-time memo) as a ratio, and with CPU seconds of this process beside wall
seconds, since the machine is shared and noisy. Rates are multiples of the
replica's SLO capacity from the simulator's search, so they follow the step
model. Bars: one capacity search under 2 s median; one model over the whole
catalog under 30 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass
from functools import cache, partial

from hetsched.catalog import Device, load_catalog
from hetsched.perf.roofline import RooflineModel
from hetsched.perf.step import StepShape
from hetsched.sim.capacity import (DEFAULT_SEEDS, Replica, device_capacity, find_capacity, run_at_rate,
                                   search_rate)
from hetsched.sim.simulator import simulate
from hetsched.sim.step_cache import MemoizedStepModel
from hetsched.specs.registry import bundled_model_names, load_model
from hetsched.specs.workload import SLO, LengthDistribution, Workload
import report

CATALOG = load_catalog()
CHAT = Workload.chat()
SLO_CHAT = SLO(ttft_ms=500, tpot_ms=50)
SEARCHES = (("llama-3.1-8b", "h100-sxm", 1), ("llama-3.1-8b", "a100-80gb", 1), ("qwen3-0.6b", "l4", 1),
            ("llama-3.1-70b", "h100-sxm", 4), ("qwen3-30b-a3b", "mi300x", 1))
KV_CASES = (("llama-3.1-8b", "a10g"), ("llama-3.1-8b", "l4"), ("qwen3-8b", "a100-40gb"))


@dataclass(frozen=True)
class Sizes:
    """How much each part simulates."""

    requests: int
    """Requests per rate in the speed table."""
    loads: tuple[float, ...]
    """Speed table rates, × the replica's SLO capacity."""
    searches: tuple[tuple[str, str, int], ...]
    repeats: int
    """Runs of each capacity search (the median is reported)."""
    accelerators: int | None
    """Catalog accelerators in the full-table part (None: all)."""
    sweep: tuple[float, ...]
    """Load sweep, × capacity."""
    sweep_requests: int
    kv_cases: tuple[tuple[str, str], ...]
    batches: tuple[int, ...]
    models: int | None
    """Bundled models in ``--all-models`` (None: all)."""
    seeds: tuple[int, ...]
    """Seeds of every capacity search."""


FULL = Sizes(requests=3000, loads=(0.2, 0.75, 1.5, 3.0), searches=SEARCHES, repeats=3, accelerators=None,
             sweep=(0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0), sweep_requests=4000, kv_cases=KV_CASES,
             batches=(1, 4, 16, 64, 128, 256), models=None, seeds=DEFAULT_SEEDS)
QUICK = Sizes(requests=200, loads=(0.5, 3.0), searches=SEARCHES[:1], repeats=1, accelerators=1, sweep=(0.5, 2.0),
              sweep_requests=200, kv_cases=KV_CASES[:1], batches=(1, 16), models=1, seeds=(0,))
"""Every part once on small inputs: a smoke run, its figures not the benchmark's."""


def device(acc: str) -> Device:
    return Device.whole(CATALOG.accelerators[acc])


@cache
def chat_capacity(seeds: tuple[int, ...]) -> float:
    """SLO capacity (req/s) of llama-3.1-8b on one h100-sxm for the chat workload: the unit of the parts' rates."""
    replica = Replica.build(load_model("llama-3.1-8b"), device("h100-sxm"), workload=CHAT)
    return search_rate(replica, CHAT, SLO_CHAT, seeds=seeds)[0].rate


class Timer:
    """Wall and CPU seconds of a block."""

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *_: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def requests_per_wall_second(sizes: Sizes) -> None:
    model, dev = load_model("llama-3.1-8b"), device("h100-sxm")
    replica = Replica.build(model, dev, workload=CHAT)
    raw = RooflineModel(model, dev)
    capacity = chat_capacity(sizes.seeds)
    print(f"\n## Simulated requests per second (llama-3.1-8b on h100-sxm, chat workload, capacity {capacity:.1f} req/s, "
          f"{sizes.requests} requests, fresh memo)\n")
    print(f"{'× capacity':>10} {'rate req/s':>10} {'req/wall s':>11} {'req/CPU s':>10} {'raw req/CPU s':>14} "
          f"{'memo speed-up':>14} {'steps':>8} {'steps/CPU s':>12}")
    for load in sizes.loads:
        rate = load * capacity
        requests = CHAT.sample(sizes.requests, rate=rate, seed=0)
        kwargs = dict(engine=replica.engine, num_blocks=replica.num_blocks, max_model_len=replica.max_model_len)
        with Timer() as memo:
            run = simulate(MemoizedStepModel(raw), requests, **kwargs)  # type: ignore[arg-type]
        with Timer() as base:
            simulate(raw, requests, **kwargs)  # type: ignore[arg-type]
        n = sizes.requests
        print(f"{load:10.2f} {rate:10.1f} {n / memo.wall:11,.0f} {n / memo.cpu:10,.0f} {n / base.cpu:14,.0f} "
              f"{base.cpu / memo.cpu:13.1f}x {run.steps:8,d} {run.steps / memo.cpu:12,.0f}")


def capacity_search_time(sizes: Sizes) -> None:
    print(f"\n## Time per capacity search (chat workload, P99 TTFT 500 ms, TPOT 50 ms; median of {sizes.repeats}, "
          "fresh memo each)\n")
    print(f"{'model':16} {'device':10} {'TP':>2} {'req/s':>7} {'binding':>8} {'wall s':>7} {'CPU s':>6}")
    walls, cpus = [], []
    for name, acc, tp in sizes.searches:
        model = load_model(name)
        wall, cpu, cap = [], [], None
        for _ in range(sizes.repeats):
            with Timer() as t:
                cap = find_capacity(model, device(acc), tp=tp, workload=CHAT, slo=SLO_CHAT, seeds=sizes.seeds)
            wall.append(t.wall)
            cpu.append(t.cpu)
        walls.append(statistics.median(wall))
        cpus.append(statistics.median(cpu))
        assert cap is not None
        print(f"{name:16} {acc:10} {tp:2d} {cap.requests_per_s:7.2f} {cap.binding:>8} {walls[-1]:7.2f} {cpus[-1]:6.2f}")
    print(f"\nmedian over searches: {statistics.median(walls):.2f} s wall, {statistics.median(cpus):.2f} s CPU "
          "(bar: < 2 s)")


def catalog_table_time(sizes: Sizes) -> None:
    model = load_model("llama-3.1-8b")
    find = partial(find_capacity, seeds=sizes.seeds)
    with Timer() as t:
        rows = [device_capacity(model, Device.whole(a), workload=CHAT, slo=SLO_CHAT, find=find)
                for a in list(CATALOG.accelerators.values())[:sizes.accelerators]]
    served = sum(r.capacity is not None for r in rows)
    print(f"\n## Full catalog table: llama-3.1-8b over {len(rows)} accelerators ({served} meet the SLO): "
          f"{t.wall:.1f} s wall, {t.cpu:.1f} s CPU (bar: < 30 s)")


def behaviour(sizes: Sizes) -> None:
    model, dev = load_model("llama-3.1-8b"), device("h100-sxm")
    replica = Replica.build(model, dev, workload=CHAT)
    capacity = chat_capacity(sizes.seeds)
    print(f"\n## Load sweep (llama-3.1-8b on h100-sxm, chat; capacity {capacity:.1f} req/s)\n")
    print(f"{'× capacity':>10} {'offered':>8} {'served':>7} {'TTFT P99 ms':>12} {'TPOT P99 ms':>12} {'running':>8}")
    for k in sizes.sweep:
        # one long run per rate: past saturation the queue never settles, so the window must span many answers
        s = run_at_rate(replica, CHAT, SLO_CHAT, capacity * k, seeds=(0,), measured_per_seed=sizes.sweep_requests,
                        stop_early=False).summary
        print(f"{k:10.2f} {s.rate:8.1f} {s.throughput_rps:7.1f} {s.ttft_ms.p99:12,.0f} {s.tpot_ms.p99:12.1f} "
              f"{s.mean_running:8.0f}")

    long_docs = Workload(name="long", input_len=LengthDistribution.fixed(6000), output_len=LengthDistribution.fixed(300))
    slo = SLO(ttft_ms=10_000, tpot_ms=200)
    print("\n## KV capacity and long contexts (6000-token prompts, 300-token answers; TTFT 10 s, TPOT 200 ms)\n")
    print(f"{'model / device':28} {'KV tokens':>10} {'req/s':>7} {'binding':>8} {'2× KV req/s':>12} {'ratio':>6}")
    for name, acc in sizes.kv_cases:
        base_replica = Replica.build(load_model(name), device(acc), workload=long_docs)
        doubled = dataclasses.replace(base_replica, num_blocks=base_replica.num_blocks * 2)
        base, binding = search_rate(base_replica, long_docs, slo, seeds=sizes.seeds)
        more, _ = search_rate(doubled, long_docs, slo, seeds=sizes.seeds)
        print(f"{name + ' / ' + acc:28} {base_replica.kv_tokens:10,d} {base.rate:7.2f} {binding:>8} "
              f"{more.rate:12.2f} {more.rate / base.rate:5.2f}x")

    fixed = Workload(input_len=LengthDistribution.fixed(500), output_len=LengthDistribution.fixed(500))
    print("\n## TPOT against batch size (500-token prompts and answers arriving together; llama-3.1-8b on h100-sxm)\n")
    print(f"{'batch':>6} {'simulated TPOT ms':>18} {'step model ms':>14} {'ratio':>6}")
    for batch in sizes.batches:
        run = simulate(replica.step_model, fixed.sample(batch, rate=1e6, seed=0), engine=replica.engine,
                       num_blocks=replica.num_blocks, max_model_len=replica.max_model_len)
        simulated = statistics.median(run.times.tpot.tolist()) * 1e3
        # decodes run from context 500 to 1000; the step model at the mean context
        predicted = replica.step_model.step_time(StepShape(decode_seqs=batch, decode_kv_tokens=batch * 750)) * 1e3
        print(f"{batch:6d} {simulated:18.2f} {predicted:14.2f} {simulated / predicted:5.2f}")


def all_models(sizes: Sizes) -> None:
    """Every bundled model on every catalog accelerator: a capacity, or the reason there is none."""
    print("\n## Every bundled model × catalog accelerator (chat, P99 TTFT 500 ms, TPOT 50 ms, smallest TP that works)\n")
    print(f"{'model':20} {'served':>6} {'no fit':>6} {'SLO infeasible':>14} {'CPU s':>6}")
    totals = [0, 0, 0]
    find = partial(find_capacity, seeds=sizes.seeds)
    for name in bundled_model_names()[:sizes.models]:
        model = load_model(name)
        with Timer() as t:
            rows = [device_capacity(model, Device.whole(a), workload=CHAT, slo=SLO_CHAT, find=find)
                    for a in list(CATALOG.accelerators.values())[:sizes.accelerators]]
        served = sum(r.capacity is not None for r in rows)
        no_fit = sum(r.capacity is None and "does not fit" in (r.reason or "") for r in rows)
        counts = [served, no_fit, len(rows) - served - no_fit]
        totals = [a + b for a, b in zip(totals, counts)]
        print(f"{name:20} {counts[0]:6d} {counts[1]:6d} {counts[2]:14d} {t.cpu:6.1f}")
    print(f"{'total':20} {totals[0]:6d} {totals[1]:6d} {totals[2]:14d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-models", action="store_true", help="every bundled model on every catalog accelerator")
    parser.add_argument("--quick", action="store_true", help="every part on small inputs: a smoke run")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.all_models:
        all_models(sizes)
        return
    requests_per_wall_second(sizes)
    capacity_search_time(sizes)
    catalog_table_time(sizes)
    behaviour(sizes)


if __name__ == "__main__":
    report.main(main, section=lambda args: "simulator_all_models" if "--all-models" in args else "simulator_speed")
