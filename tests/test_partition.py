"""The partition package's renderers and names: one file per vendor's manager, whoever renders it."""

from __future__ import annotations

import json

import pytest
import yaml
from pydantic import ValidationError

from hetsched.catalog import Vendor, load_catalog
from hetsched.optimizer.spec import PoolSpec
from hetsched.partition.layouts import partition_layouts, partition_profiles
from hetsched.partition.mig import larger_first
from hetsched.partition.naming import amd_mode, amd_mode_parts
from hetsched.partition.phases import PARTITION_TIMEOUT_S, PartitionPhase, dcm_step, mig_step, ready_selector
from hetsched.partition.render import dcm_config, dcm_json, mig_parted_config, mig_parted_yaml, node_config_labels
from hetsched.partition.types import MigDeviceGroup, PartitionGroup
from operator_fixtures import mig_plan

CATALOG = load_catalog()


def test_mig_parted_config_lists_each_gpus_instances_largest_first_whatever_order_it_is_given() -> None:
    config = mig_parted_config({"mixed": [MigDeviceGroup(devices=[0], mig_enabled=True,
                                                         mig_devices={"1g.10gb": 2, "3g.40gb": 1, "1g.20gb": 1}),
                                          MigDeviceGroup(devices=[1], mig_enabled=False)]})
    (group, off) = config["mig-configs"]["mixed"]
    assert list(group["mig-devices"]) == ["3g.40gb", "1g.20gb", "1g.10gb"]
    assert off == {"devices": [1], "mig-enabled": False}
    assert config["version"] == "v1"


def test_mig_parted_config_always_holds_all_disabled_and_keeps_a_plans_own() -> None:
    assert mig_parted_config({})["mig-configs"] == {"all-disabled": [{"devices": "all", "mig-enabled": False}]}
    own = [MigDeviceGroup(devices=[0, 1], mig_enabled=False)]
    assert mig_parted_config({"all-disabled": own})["mig-configs"]["all-disabled"] == [
        {"devices": [0, 1], "mig-enabled": False}]


def test_dcm_config_is_the_device_config_managers_layout() -> None:
    profiles = {"b": [PartitionGroup(compute="CPX", memory="NPS1", gpus=4), PartitionGroup(compute="SPX", memory="NPS1",
                                                                                           gpus=4)],
                "a": [PartitionGroup(compute="SPX", memory="NPS1", gpus=8)]}
    text = dcm_json(profiles)
    assert text.endswith("}\n") and json.loads(text) == dcm_config(profiles)
    assert list(dcm_config(profiles)["gpu-config-profiles"]) == ["a", "b"]
    assert list(dcm_config(profiles)["gpu-config-profiles"]["b"]) == ["skippedGPUs", "profiles"]
    assert dcm_config(profiles)["gpu-config-profiles"]["b"]["profiles"][0] == {
        "computePartition": "CPX", "memoryPartition": "NPS1", "numGPUsAssigned": 4}


def test_node_config_labels_select_each_nodes_config() -> None:
    plan = mig_plan("serving/small")
    labels = node_config_labels(plan.nodes)
    assert labels == {n.name: {"nvidia.com/mig.config": n.mig_config} for n in plan.nodes if n.mig_config}


def test_larger_first_orders_by_compute_then_memory() -> None:
    names = ["1g.10gb", "7g.80gb", "1g.20gb", "4g.40gb", "2g.20gb", "3g.40gb"]
    assert sorted(names, key=larger_first) == ["7g.80gb", "4g.40gb", "3g.40gb", "2g.20gb", "1g.20gb", "1g.10gb"]


def test_amd_modes_round_trip_between_catalog_and_manager_names() -> None:
    assert amd_mode("CPX", "NPS4") == "cpx_nps4"
    assert amd_mode_parts("cpx_nps4") == ("CPX", "NPS4")


def test_layouts_and_profiles_of_each_vendor() -> None:
    h100, mi300x, l4 = (CATALOG.get(a) for a in ("h100-sxm", "mi300x", "l4"))
    assert "7g.80gb" not in partition_profiles(h100) and "1g.10gb" in partition_profiles(h100)
    assert all(sum(layout.counts.values()) > 1 or next(iter(layout.counts)) != "7g.80gb"
               for layout in partition_layouts(h100))
    assert [layout.key for layout in partition_layouts(mi300x)] == [f"{n}x{m}" for m, n in
                                                                     zip(partition_profiles(mi300x), (2, 4, 8))]
    assert partition_layouts(l4) == () and partition_profiles(l4) == []


def _node(labels: dict[str, str], taints: list[dict[str, str]] | None = None) -> dict[str, object]:
    return {"metadata": {"name": "n", "labels": labels}, "spec": {"taints": taints or []}}


def test_mig_step_drains_then_labels_then_waits_for_the_manager() -> None:
    draining = mig_step(_node({}), "cfg", 2, now=100.0)
    assert draining.phase is PartitionPhase.DRAINING and draining.labels is None
    switching = mig_step(_node({"nvidia.com/mig.config": "old", "nvidia.com/mig.config.state": "success"}), "cfg", 0,
                         now=100.0)
    assert switching.phase is PartitionPhase.CONFIGURING
    assert switching.labels == {"nvidia.com/mig.config": "cfg", "nvidia.com/mig.config.state": None,
                                "hetsched.io/partitioning-since": "100"}
    asked = {"nvidia.com/mig.config": "cfg", "hetsched.io/partitioning-since": "100"}
    assert mig_step(_node(asked), "cfg", 0, now=100.0 + PARTITION_TIMEOUT_S - 1).phase is PartitionPhase.CONFIGURING
    assert mig_step(_node(asked), "cfg", 0, now=100.0 + PARTITION_TIMEOUT_S + 1).phase is PartitionPhase.FAILED
    done = mig_step(_node({**asked, "nvidia.com/mig.config.state": "success"}), "cfg", 0, now=100.0)
    assert (done.phase, done.labels, done.taints) == (PartitionPhase.READY, None, None)


def test_dcm_step_taints_then_labels_then_untaints() -> None:
    taint = {"key": "amd-dcm", "value": "up", "effect": "NoExecute"}
    first = dcm_step(_node({}), "p", 0, unpartitioned=False, now=5.0)
    assert first.phase is PartitionPhase.CONFIGURING and first.taints == [taint] and first.labels is None
    second = dcm_step(_node({}, [taint]), "p", 0, unpartitioned=False, now=5.0)
    assert second.labels is not None and second.labels["dcm.amd.com/gpu-config-profile"] == "p" and second.taints is None
    applied = {"dcm.amd.com/gpu-config-profile": "p", "dcm.amd.com/gpu-config-profile-state": "success"}
    last = dcm_step(_node(applied, [taint, {"key": "other", "effect": "NoSchedule"}]), "p", 0, unpartitioned=False,
                    now=5.0)
    assert last.phase is PartitionPhase.READY and last.taints == [{"key": "other", "effect": "NoSchedule"}]
    assert dcm_step(_node({}), "p", 0, unpartitioned=True, now=5.0).phase is PartitionPhase.READY


def test_replicas_on_partitioned_gpus_wait_for_their_managers_success() -> None:
    assert ready_selector(Vendor.NVIDIA) == {"nvidia.com/mig.config.state": "success"}
    assert ready_selector(Vendor.AMD) == {"dcm.amd.com/gpu-config-profile-state": "success"}


def test_a_pool_reads_partition_allowed_and_its_former_name_mig_allowed() -> None:
    base = {"name": "h100", "accelerator": "h100-sxm", "nodes": 1}
    assert PoolSpec.model_validate({**base, "partition_allowed": True}).partition_allowed
    assert PoolSpec.model_validate({**base, "mig_allowed": True}).partition_allowed
    assert not PoolSpec.model_validate(base).partition_allowed
    assert PoolSpec.model_validate({**base, "mig_allowed": True}).model_dump()["partition_allowed"] is True


def test_a_pool_may_not_give_both_names() -> None:
    with pytest.raises(ValidationError, match="partition_allowed or its former name mig_allowed"):
        PoolSpec.model_validate({"name": "h100", "accelerator": "h100-sxm", "nodes": 1, "mig_allowed": True,
                                 "partition_allowed": False})
