"""``make demo``: the most complete path hetsched has, on embedded defaults."""

from __future__ import annotations

from hetsched.catalog import Device, load_catalog
from hetsched.cli.output import console, print_table
from hetsched.perf.memory import smallest_fit
from hetsched.specs.registry import load_model

DEMO_MODELS = ("qwen3-0.6b", "llama-3.1-8b", "qwen3-30b-a3b", "gpt-oss-20b", "llama-3.1-70b", "deepseek-v3")


def show_fit_matrix(context: int = 8192) -> None:
    """Smallest TP and KV capacity of several bundled models on every catalog accelerator."""
    models = [load_model(name) for name in DEMO_MODELS]
    rows = []
    for acc in load_catalog().accelerators.values():
        row: list[object] = [acc.id]
        for model in models:
            f = smallest_fit(model, Device.whole(acc), context_len=context)
            row.append(f"TP{f.tp} {f.max_kv_tokens / 1000:,.0f}k" if f.fits else "—")
        rows.append(row)
    print_table(f"Smallest TP and KV tokens per replica ({context}-token context)",
                ["accelerator", *DEMO_MODELS], rows)


def main() -> None:
    console.rule("[bold]hetsched demo")
    show_fit_matrix()


if __name__ == "__main__":
    main()
