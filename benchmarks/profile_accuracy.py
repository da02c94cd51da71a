"""Accuracy of a measured CPU profile: predicted vs real step time of a whole model.

    .venv/bin/python benchmarks/profile_accuracy.py [--model qwen3-0.6b] [--coarse] [--repeats 3]
    .venv/bin/python benchmarks/profile_accuracy.py --quick    # a tiny model, a small engine budget: a smoke run

Profiles MODEL on the CPU backend (kernel sweep in worker processes, as
``hetsched profile`` does), then builds the whole model in torch with random
weights from the same operators and runs real engine steps of 21 batch
compositions: prefill-only, decode-only and mixed, at several context lengths.
Each step's measured time (median of ``--repeats``) is compared with the
profile's prediction for the forward pass (the step minus the engine's fixed
scheduling overhead, which a bare forward does not have). The catalog
roofline's error on the same steps is printed as the baseline.
Bar: median relative error ≤ 10%.

``--quick`` profiles a two-layer model a few dozen wide (coarse sweep, a 64-token engine budget) and runs the
compositions that budget and the model's context hold: every step above in seconds, the figures not the benchmark's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import torch

from hetsched.backends import BackendKind
from hetsched.backends import torch_ops as ops
from hetsched.backends.cpu import HostClock
from hetsched.catalog import Device, load_catalog
from hetsched.catalog.host import read_host
from hetsched.perf.roofline import RooflineModel
from hetsched.perf.step import StepShape
from hetsched.profiler.driver import profile_kernels
from hetsched.specs.engine import EngineConfig
from hetsched.specs.model import AttentionKind, LayerKind, ModelArch
from hetsched.specs.registry import load_model
import report

DTYPE = torch.bfloat16
QUICK_MODEL = ModelArch(name="tiny-dense", model_type="llama", hidden_size=64, num_heads=4, num_kv_heads=2,
                        head_dim=16, intermediate_size=128, vocab_size=256, tie_embeddings=True,
                        attention=AttentionKind.GQA, layer_kinds=(LayerKind.FULL,) * 2, moe_layers=(False,) * 2,
                        max_context=1024)
QUICK_ENGINE = EngineConfig(max_num_batched_tokens=64, max_num_seqs=8)
CACHE_BYTES_CAP = 3e9  # KV caches beyond this are shared between layers (each still read from memory)

COMPOSITIONS: list[tuple[str, list[tuple[int, int]], list[int]]] = [
    ("prefill 128", [(128, 0)], []),
    ("prefill 256", [(256, 0)], []),
    ("prefill 512", [(512, 0)], []),
    ("prefill 1024", [(1024, 0)], []),
    ("prefill 4×256", [(256, 0)] * 4, []),
    ("prefill 512 after 512", [(512, 512)], []),
    ("prefill 256 after 1536", [(256, 1536)], []),
    ("decode 1 @ 256", [], [256]),
    ("decode 1 @ 4096", [], [4096]),
    ("decode 8 @ 512", [], [512] * 8),
    ("decode 8 @ 2048", [], [2048] * 8),
    ("decode 32 @ 256", [], [256] * 32),
    ("decode 32 @ 1024", [], [1024] * 32),
    ("decode 64 @ 512", [], [512] * 64),
    ("decode 128 @ 128", [], [128] * 128),
    ("mixed 256 + 8 @ 512", [(256, 0)], [512] * 8),
    ("mixed 512 + 16 @ 1024", [(512, 0)], [1024] * 16),
    ("mixed 128 after 512 + 32 @ 256", [(128, 512)], [256] * 32),
    ("mixed 1024 + 4 @ 2048", [(1024, 0)], [2048] * 4),
    ("mixed 2×64 + 16 @ 512 + 16 @ 1024", [(64, 0)] * 2, [512] * 16 + [1024] * 16),
    ("mixed 32 + 64 @ 128", [(32, 0)], [128] * 64),
]


@dataclass
class Layer:
    norm_in: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    norm_post: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class TorchModel:
    """A dense GQA decoder (Llama/Qwen3 layout) with random weights, built from the profiled operators."""

    def __init__(self, arch: ModelArch) -> None:
        assert arch.mla is None and arch.moe is None, "the benchmark model is a dense GQA decoder"
        self.arch = arch
        h, hd = arch.hidden_size, arch.head_dim
        q, kv = arch.num_heads * hd, arch.num_kv_heads * hd

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, dtype=DTYPE) * 0.02

        self.embedding = w(arch.vocab_size, h)
        self.lm_head = self.embedding if arch.tie_embeddings else w(arch.vocab_size, h)
        self.layers = [Layer(torch.ones(h, dtype=DTYPE), w(q + 2 * kv, h), w(h, q), torch.ones(h, dtype=DTYPE),
                             w(2 * arch.intermediate_size, h), w(h, arch.intermediate_size))
                       for _ in range(arch.num_layers)]
        self.final_norm = torch.ones(h, dtype=DTYPE)

    def caches(self, prefill: list[tuple[int, int]], decode: list[int]) -> tuple[list, list]:
        """KV caches per layer set: one [kv_heads, context, d] pair per prefill sequence and one
        [batch, kv_heads, context, d] pair per group of decodes with the same context."""
        a = self.arch
        groups = sorted({c: decode.count(c) for c in decode}.items())
        per_layer = sum(2 * (n + c) for n, c in prefill) + sum(2 * b * c for c, b in groups)
        per_layer *= a.num_kv_heads * a.head_dim * 2
        sets = max(1, min(a.num_layers, int(CACHE_BYTES_CAP // max(per_layer, 1))))
        pre = [[(torch.randn(a.num_kv_heads, n + c, a.head_dim, dtype=DTYPE),
                 torch.randn(a.num_kv_heads, n + c, a.head_dim, dtype=DTYPE)) for n, c in prefill] for _ in range(sets)]
        dec = [[(b, c, torch.randn(b, a.num_kv_heads, c, a.head_dim, dtype=DTYPE),
                 torch.randn(b, a.num_kv_heads, c, a.head_dim, dtype=DTYPE)) for c, b in groups] for _ in range(sets)]
        return pre, dec

    @torch.inference_mode()
    def step(self, prefill: list[tuple[int, int]], decode: list[int], caches: tuple[list, list]) -> torch.Tensor:
        a = self.arch
        heads, kv_heads, hd = a.num_heads, a.num_kv_heads, a.head_dim
        groups = sorted({c: decode.count(c) for c in decode}.items())
        tokens = sum(n for n, _ in prefill) + len(decode)
        positions = torch.cat([torch.arange(c, c + n) for n, c in prefill]
                              + [torch.full((b,), c - 1) for c, b in groups]).long()
        sampled = torch.tensor([i - 1 for i in torch.tensor([n for n, _ in prefill]).cumsum(0).tolist()]
                               + list(range(sum(n for n, _ in prefill), tokens)), dtype=torch.long)
        cos, sin = ops.rope_tables(positions, hd, dtype=DTYPE)
        x = torch.nn.functional.embedding(torch.randint(0, a.vocab_size, (tokens,)), self.embedding)
        pre_caches, dec_caches = caches
        for index, layer in enumerate(self.layers):
            pre, dec = pre_caches[index % len(pre_caches)], dec_caches[index % len(dec_caches)]
            qkv = ops.gemm(ops.rms_norm(x, layer.norm_in), layer.qkv)
            q = qkv[:, :heads * hd].view(tokens, heads, hd)
            k = qkv[:, heads * hd:(heads + kv_heads) * hd].view(tokens, kv_heads, hd)
            v = qkv[:, (heads + kv_heads) * hd:].view(tokens, kv_heads, hd)
            q, k = ops.rope(q, k, cos, sin)
            outs, start = [], 0
            for (new, cached), (k_cache, v_cache) in zip(prefill, pre, strict=True):
                k_cache[:, cached:cached + new] = k[start:start + new].transpose(0, 1)
                v_cache[:, cached:cached + new] = v[start:start + new].transpose(0, 1)
                out = ops.prefill_attention(q[start:start + new].transpose(0, 1), k_cache, v_cache, cached)
                outs.append(out.transpose(0, 1).reshape(new, heads * hd))
                start += new
            for batch, context, k_cache, v_cache in dec:
                k_cache[:, :, context - 1] = k[start:start + batch]
                v_cache[:, :, context - 1] = v[start:start + batch]
                outs.append(ops.decode_attention(q[start:start + batch], k_cache, v_cache).reshape(batch, heads * hd))
                start += batch
            x = x + ops.gemm(torch.cat(outs) if len(outs) > 1 else outs[0], layer.o)
            x = x + ops.gemm(ops.silu_mul(ops.gemm(ops.rms_norm(x, layer.norm_post), layer.gate_up)), layer.down)
        return ops.gemm(ops.rms_norm(x[sampled], self.final_norm), self.lm_head)


def measure(model: TorchModel, prefill: list[tuple[int, int]], decode: list[int], repeats: int,
            clock: HostClock) -> float:
    now = time.perf_counter_ns if clock is HostClock.WALL else time.process_time_ns
    caches = model.caches(prefill, decode)
    model.step(prefill, decode, caches)  # warm-up
    samples = []
    for _ in range(repeats):
        start = now()
        model.step(prefill, decode, caches)
        samples.append((now() - start) / 1e9)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--coarse", action="store_true", help="profile with the coarse sweep (hetsched profile --quick)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_MODEL.name} (two layers, hidden {QUICK_MODEL.hidden_size}), coarse sweep, "
                             f"{QUICK_ENGINE.max_num_batched_tokens}-token budget: a smoke run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads for the profile and the model (default: torch's choice); on a shared "
                             "machine one thread per process is less disturbed by other load")
    parser.add_argument("--clock", choices=[c.value for c in HostClock], default="wall",
                        help="wall: elapsed time; process: CPU time (use with --threads 1 on a busy shared host)")
    args = parser.parse_args()
    clock = HostClock(args.clock)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the profiling worker
        torch.set_num_threads(args.threads)
    arch = QUICK_MODEL if args.quick else load_model(args.model)
    engine = QUICK_ENGINE if args.quick else EngineConfig()
    coarse = args.coarse or args.quick

    started = time.perf_counter()
    profile = profile_kernels(arch, backend=BackendKind.CPU, quick=coarse, engine=engine, host_clock=clock.value)
    profile_s = time.perf_counter() - started
    print(f"profile: {arch.name} on cpu ({'coarse' if coarse else 'full'} sweep, "
          f"{profile.provenance.device.get('extra', {}).get('threads')} threads, {clock} clock), "
          f"{sum(len(t.points) for t in profile.tables)} points, {len(profile.failures)} failed, {profile_s:.0f} s")
    roofline = RooflineModel(arch, Device.whole(load_catalog().get("cpu", host=read_host())), engine=engine)

    model = TorchModel(arch)
    rows = []
    print(f"{'composition':36s} {'tokens':>6s} {'measured ms':>12s} {'profile ms':>11s} {'error':>7s} "
          f"{'roofline ms':>12s} {'error':>7s}")
    for name, prefill, decode in COMPOSITIONS:
        shape = StepShape.build(prefill=prefill, decode_contexts=decode)
        if shape.tokens > engine.max_num_batched_tokens or max(decode + [n + c for n, c in prefill]) > arch.max_context:
            continue
        measured = measure(model, prefill, decode, args.repeats, clock)
        predicted = profile.step_time(shape) - profile.step_overhead_s
        estimated = roofline.step_time(shape) - roofline.step_overhead_s
        error, roof_error = predicted / measured - 1, estimated / measured - 1
        rows.append((abs(error), abs(roof_error)))
        print(f"{name:36s} {shape.tokens:6d} {measured * 1e3:12.1f} {predicted * 1e3:11.1f} {error:+7.1%} "
              f"{estimated * 1e3:12.1f} {roof_error:+7.1%}", flush=True)

    def p90(values: list[float]) -> float:
        return sorted(values)[max(0, -(-9 * len(values) // 10) - 1)]

    errors, baseline = [r[0] for r in rows], [r[1] for r in rows]
    print(f"\n{len(rows)} compositions; profile relative error: median {statistics.median(errors):.1%}, "
          f"p90 {p90(errors):.1%} (bar: median ≤ 10%)")
    print(f"roofline baseline relative error: median {statistics.median(baseline):.1%}, p90 {p90(baseline):.1%}; "
          f"profile/roofline median error ratio {statistics.median(errors) / statistics.median(baseline):.2f}")


if __name__ == "__main__":
    report.main(main, section="profile_accuracy")
