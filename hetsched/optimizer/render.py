"""Render: a Plan as terminal tables and YAML (its partition managers' configs: :mod:`hetsched.partition.render`).
Returns values; prints nothing."""

from __future__ import annotations

import yaml
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from hetsched.optimizer.plan import GpuMode, GpuPlan, NodePlan, Plan, PlanStatus
from hetsched.optimizer.spec import Role

MAX_NODE_ROWS = 40
"""Nodes listed in the terminal view; the rest are counted (every node is in -o yaml/json)."""


def plan_view(plan: Plan) -> RenderableType:
    """Everything a person needs to read a plan in a terminal."""
    parts: list[RenderableType] = [_headline(plan)]
    if plan.status is PlanStatus.INFEASIBLE:
        parts.append(_reasons("No plan: why", plan.explanation.infeasible, "red"))
    else:
        parts += [_replicas_table(plan), _models_table(plan), _pools_table(plan), _nodes_table(plan)]
        binding = [f"[{b.kind.value}] {b.detail}" for b in plan.explanation.binding]
        parts.append(_reasons("Binding constraints", binding, "yellow"))
    if plan.explanation.corrections:
        parts.append(_reasons("Step models", [f"{c.model} on {c.device} TP={c.tp}: corrected by {c.label}"
                                              for c in plan.explanation.corrections], "dim"))
    if plan.explanation.notes:
        parts.append(_reasons("Notes", plan.explanation.notes, "dim"))
    return Group(*parts)


def plan_yaml(plan: Plan) -> str:
    return yaml.safe_dump(plan.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def _headline(plan: Plan) -> Text:
    stats = plan.solver
    colour = {"optimal": "green", "feasible": "yellow", "infeasible": "red"}[plan.status.value]
    text = Text.assemble(("Plan ", "bold"), (plan.name, "bold cyan"), "  ", (plan.status.value, f"bold {colour}"))
    if plan.status is not PlanStatus.INFEASIBLE:
        text.append(f"  ${plan.cost_per_hour:,.2f}/hour", style="bold")
        gpus = sum(p.gpus_used for p in plan.pools)
        text.append(f"  {gpus} GPUs  {sum(g.replicas for m in plan.models for g in m.replicas)} replicas")
    gap = f"{stats.gap:.2%}" if stats.gap is not None else "—"
    text.append(f"\nsolver: {stats.message}; {stats.time_s:.2f} s, gap {gap}, "
                f"{stats.variables} variables ({stats.integer_variables} integer), {stats.constraints} constraints",
                style="dim")
    if plan.replicas_moved:
        text.append(f"\n{plan.replicas_moved} replicas moved against the current plan", style="dim")
    return text


def _replicas_table(plan: Plan) -> Table:
    table = _table("Replicas", ("model", "config", "pool", "replicas", "GPUs", "load/capacity req/s", "$/hour"),
                   text=("model", "config", "pool"))
    for model in plan.models:
        for g in model.replicas:
            who = g.model if g.role is Role.UNIFIED else f"{g.model} ({g.role.value})"
            gpus = f"{g.gpus_per_replica * g.replicas:.2f}".rstrip("0").rstrip(".")
            table.add_row(escape(who), escape(_config(g.device, g.tp)), escape(g.pool), str(g.replicas), gpus,
                          f"{g.load_rps:,.1f}/{g.capacity_rps:,.1f}", f"{g.cost_per_hour:,.2f}")
    return table


def _models_table(plan: Plan) -> Table:
    table = _table("Models", ("model", "req/s", "replicas", "headroom", "buckets → configs", "$/hour"),
                   text=("model", "buckets → configs"))
    for model in plan.models:
        split: dict[str, list[str]] = {}
        for share in model.split:
            split.setdefault(f"{share.bucket}{_role_suffix(share.role)}", []).append(
                f"{share.fraction:.0%} {_config(share.device, share.tp)}")
        buckets = "\n".join(f"{bucket}: {', '.join(targets)}" for bucket, targets in split.items())
        table.add_row(escape(model.name), f"{model.demand_rps:,.2f}", str(sum(g.replicas for g in model.replicas)),
                      f"{model.headroom:.0%}", escape(buckets), f"{model.cost_per_hour:,.2f}")
    return table


def _pools_table(plan: Plan) -> Table:
    table = _table("Pools", ("pool", "accelerator", "GPUs used", "of", "split", "$/GPU·h", "$/hour"),
                   text=("pool", "accelerator"))
    for pool in plan.pools:
        table.add_row(escape(pool.pool), escape(pool.accelerator), str(pool.gpus_used), str(pool.gpus_total), str(pool.gpus_mig),
                      f"{pool.price_per_hour:,.2f}", f"{pool.cost_per_hour:,.2f}")
    return table


def _nodes_table(plan: Plan) -> Table:
    shown = plan.nodes[:MAX_NODE_ROWS]
    caption = f"{len(plan.nodes) - len(shown)} more nodes in -o yaml" if len(plan.nodes) > len(shown) else None
    table = Table(title="Nodes", header_style="bold", title_justify="left", caption=caption)
    for name in ("node", "MIG config / partition profile", "GPUs"):
        table.add_column(name)
    for node in shown:
        table.add_row(escape(node.name), escape(node.mig_config or node.partition_profile or ""),
                      escape(_gpu_summary(node)))
    return table


def _gpu_summary(node: NodePlan) -> str:
    """One line per run of GPUs doing the same thing, e.g. ``0-3  llama-3.1-70b TP4``."""
    lines: list[str] = []
    runs: list[tuple[list[int], str]] = []
    for gpu in node.gpus:
        what = _gpu_text(gpu)
        if runs and runs[-1][1] == what and runs[-1][0][-1] == gpu.index - 1:
            runs[-1][0].append(gpu.index)
        else:
            runs.append(([gpu.index], what))
    for indices, what in runs:
        span = str(indices[0]) if len(indices) == 1 else f"{indices[0]}-{indices[-1]}"
        lines.append(f"{span:>5}  {what}")
    return "\n".join(lines)


def _gpu_text(gpu: GpuPlan) -> str:
    if gpu.mode is GpuMode.IDLE:
        return "idle"
    if gpu.mode is GpuMode.WHOLE:
        return f"{gpu.model}{_role_suffix(gpu.role)}"
    parts = [f"{i.profile}@{i.start}:{i.model or 'idle'}{_role_suffix(i.role)}" for i in gpu.instances]
    return ("MIG " if gpu.mode is GpuMode.MIG else f"{gpu.partition} ") + " ".join(parts)


def _table(title: str, columns: tuple[str, ...], *, text: tuple[str, ...]) -> Table:
    """A titled table: the ``text`` columns left-aligned, figures right-aligned."""
    table = Table(title=title, header_style="bold", title_justify="left")
    for name in columns:
        table.add_column(name, justify="left" if name in text else "right")
    return table


def _config(device: str, tp: int) -> str:
    return device if tp == 1 else f"{device} TP{tp}"


def _role_suffix(role: Role | None) -> str:
    """`` prefill`` or `` decode`` after a name; nothing for a unified replica."""
    return "" if role is None or role is Role.UNIFIED else f" {role.value}"


def _reasons(title: str, lines: list[str], style: str) -> Text:
    text = Text(f"{title}\n", style="bold")
    for line in lines or ["none"]:
        text.append(f"  • {line}\n", style=style)
    return text
