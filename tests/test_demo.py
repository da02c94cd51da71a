"""The demo's steps run against the code they show (``make demo`` itself is too slow for the suite)."""

from __future__ import annotations

import pytest

from hetsched import demo


def test_the_operator_step_shows_a_deployment_for_each_planned_model(capsys: pytest.CaptureFixture[str]) -> None:
    demo.show_operator_objects()
    shown = capsys.readouterr().out
    assert "Operator: Deployments for the plan" in shown
    assert "chat-h100-h100-sxm-tp1-unified" in shown and "tiny-h100-h100-sxm-tp1-unified" in shown


def test_the_endpoint_picker_step_spreads_its_picks_as_load_grows(capsys: pytest.CaptureFixture[str]) -> None:
    demo.show_endpoint_picker()
    shown = capsys.readouterr().out
    assert "Endpoint picker" in shown
    firsts = {line.split("│")[2].split("→")[0].strip() for line in shown.splitlines() if "→" in line}
    assert len(firsts) >= 2  # the first choice moves off the endpoint that fills up


def test_the_flow_control_step_serves_the_urgent_class_first_and_the_tenants_in_turn(
        capsys: pytest.CaptureFixture[str]) -> None:
    demo.show_flow_control()
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in capsys.readouterr().out.splitlines()
            if line.startswith("│") and line.split("│")[1].strip().isdigit()]
    assert [r[2] for r in rows[:2]] == ["interactive", "interactive"]
    batch_tenants = [r[3] for r in rows[2:]]
    assert batch_tenants[:3].count("flood") == 1  # the flood's head start does not keep the others waiting
    assert batch_tenants[-4:] == ["flood"] * 4


def test_the_kv_routing_step_follows_the_engines_events_and_beats_round_robin_on_hits(
        capsys: pytest.CaptureFixture[str]) -> None:
    demo.show_kv_routing()
    rows = {cells[0]: cells for line in capsys.readouterr().out.splitlines()
            if line.startswith("│") and (cells := [c.strip() for c in line.split("│")[1:-1]])[0] in
            ("kv-aware", "round-robin")}
    assert rows["kv-aware"][1] == "kv-events"  # every endpoint's cached prefix came from its events
    assert rows["kv-aware"][2] == rows["round-robin"][2]  # the same prompts
    hits = {policy: int(cells[3].replace(",", "")) for policy, cells in rows.items()}
    assert hits["kv-aware"] > 1.1 * hits["round-robin"]
