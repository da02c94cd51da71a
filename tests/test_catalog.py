"""Accelerator catalog and MIG geometry rules."""

from __future__ import annotations

import pytest

from hetsched.catalog import Device, load_catalog
from hetsched.catalog.host import HostInfo
from hetsched.errors import InputError, NotFoundError, SpecError
from hetsched.partition.mig import MigPlacement, check_layout, enumerate_layouts, place, validate_counts
from hetsched.specs.dtypes import DType

CATALOG = load_catalog()
H100 = CATALOG.get("h100-sxm")
assert H100.mig is not None
MIG = H100.mig


def test_every_reference_accelerator_is_in_the_catalog() -> None:
    expected = {"b200", "h200", "h100-sxm", "h100-pcie", "a100-80gb", "a100-40gb", "a30", "l40s", "l4", "a10g",
                "t4", "mi325x", "mi300x", "mi250x"}
    assert expected <= set(CATALOG.accelerators)
    assert CATALOG.get("h100-sxm").tflops[DType.BF16] == 989
    assert CATALOG.get("mi300x").memory_gb == 192


def test_cpu_entry_comes_from_the_host() -> None:
    cpu = CATALOG.get("cpu", host=HostInfo(cores=16, memory_gb=64, cpu_model="Test CPU", clock_ghz=3.0))
    assert cpu.memory_gb == 64
    assert cpu.tflops[DType.FP32] == pytest.approx(16 * 3.0 * 32 / 1e3)
    assert "Test CPU" in cpu.name


def test_a_catalog_on_a_host_resolves_cpu_everywhere_it_is_passed() -> None:
    host = HostInfo(cores=8, memory_gb=32, cpu_model="Test CPU", clock_ghz=2.0)
    on_host = CATALOG.on_host(host).with_prices({"l4": 0.5})
    assert on_host.get("cpu") == CATALOG.get("cpu", host=host)
    assert on_host.device("cpu").accelerator.id == "cpu"
    with pytest.raises(NotFoundError) as without_host:
        CATALOG.get("cpu")
    assert "did you mean 'cpu'" not in str(without_host.value)  # cpu needs a host; it is not a typo


def test_t4_has_no_bf16_and_falls_back_to_fp16() -> None:
    t4 = CATALOG.get("t4")
    assert DType.BF16 not in t4.tflops
    assert t4.peak_tflops(DType.BF16) == 65


def test_fp8_falls_back_to_16_bit_without_fp8_units() -> None:
    assert CATALOG.get("a100-80gb").peak_tflops(DType.FP8) == 312
    assert CATALOG.get("h100-sxm").peak_tflops(DType.FP8) == 1979


def test_unknown_accelerator_suggests_a_close_match() -> None:
    with pytest.raises(NotFoundError, match="did you mean 'h100-sxm'"):
        CATALOG.get("h100-sx")


def test_product_labels_identify_accelerators() -> None:
    assert CATALOG.by_product("NVIDIA-H100-80GB-HBM3").id == "h100-sxm"
    assert CATALOG.by_product("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb").id == "a100-40gb"
    assert CATALOG.by_product("AMD_Instinct_MI300X").id == "mi300x"
    assert CATALOG.by_product("NVIDIA-Unknown-9000") is None


def test_price_override_and_unknown_override() -> None:
    assert CATALOG.with_prices({"l4": 0.5}).get("l4").price_per_hour == 0.5
    with pytest.raises(NotFoundError):
        CATALOG.with_prices({"l5": 0.5})


def test_bad_catalog_names_the_field() -> None:
    with pytest.raises(SpecError, match="schema_version"):
        load_catalog("schema_version: 7\n")
    broken = "schema_version: 1\naccelerators:\n  x: {name: X, vendor: nvidia, tflops: {bf16: 1}}\ncpu: {}\n"
    with pytest.raises(SpecError, match="accelerators.x.memory_gb"):
        load_catalog(broken)


@pytest.mark.parametrize(("units", "field"), [("compute_units: 108", "clock_ghz"),
                                              ("compute_units: 108.5, clock_ghz: 1.4", "compute_units"),
                                              ("compute_units: 108, clock_ghz: -1", "clock_ghz")])
def test_compute_units_and_clock_come_together_and_are_checked(units: str, field: str) -> None:
    entry = ("{name: X, vendor: nvidia, tflops: {bf16: 1}, memory_gb: 1, memory_tbs: 1, interconnect_gbs: 0, "
             f"network_gbs: 0, price_per_hour: 1, gpus_per_node: 1, {units}}}")
    with pytest.raises(SpecError, match=f"accelerators.x.{field}"):
        load_catalog(f"schema_version: 1\naccelerators:\n  x: {entry}\ncpu: {{}}\n")
    assert CATALOG.get("a100-80gb").compute_units == 108


# --- MIG rules from the reference ---------------------------------------------

def test_seven_1g_leave_memory_slice_7_idle() -> None:
    layout = place(MIG, {"1g.10gb": 7})
    assert layout is not None
    assert sorted(p.start for p in layout.placements) == [0, 1, 2, 3, 4, 5, 6]
    assert place(MIG, {"1g.10gb": 8}) is None


def test_4g_plus_3g_is_valid_and_3g_goes_to_slice_4() -> None:
    layout = place(MIG, {"4g.40gb": 1, "3g.40gb": 1})
    assert layout is not None
    assert {(p.profile, p.start) for p in layout.placements} == {("4g.40gb", 0), ("3g.40gb", 4)}


def test_two_3g_fill_the_gpu() -> None:
    layout = place(MIG, {"3g.40gb": 2})
    assert layout is not None
    assert place(MIG, {"3g.40gb": 2, "1g.10gb": 1}) is None


def test_4g_plus_4g_is_invalid() -> None:
    assert place(MIG, {"4g.40gb": 2}) is None
    with pytest.raises(InputError, match="4g.40gb: expected 0..1 instances"):
        validate_counts(MIG, {"4g.40gb": 2})


def test_check_layout_explains_overlap_and_bad_start() -> None:
    assert check_layout(MIG, [MigPlacement("3g.40gb", 0), MigPlacement("4g.40gb", 0)]) is not None
    assert "cannot start" in (check_layout(MIG, [MigPlacement("3g.40gb", 2)]) or "")
    assert check_layout(MIG, [MigPlacement("4g.40gb", 0), MigPlacement("3g.40gb", 4)]) is None


def test_enumerated_layouts_are_all_valid_and_include_the_known_ones() -> None:
    layouts = enumerate_layouts(MIG)
    keys = {layout.key for layout in layouts}
    assert {"1x7g.80gb", "2x3g.40gb", "1x4g.40gb+1x3g.40gb", "7x1g.10gb", "3x2g.20gb+1x1g.10gb"} <= keys
    assert all(check_layout(MIG, layout.placements) is None for layout in layouts)
    assert len(keys) == len(layouts)
    maximal = {layout.key for layout in enumerate_layouts(MIG, maximal_only=True)}
    assert "1x3g.40gb" not in maximal and "2x3g.40gb" in maximal and "7x1g.10gb" in maximal


def test_a30_four_slice_geometry() -> None:
    a30 = CATALOG.get("a30").mig
    assert a30 is not None
    assert place(a30, {"1g.6gb": 4}) is not None
    assert place(a30, {"2g.12gb": 2}) is not None
    assert place(a30, {"4g.24gb": 1, "1g.6gb": 1}) is None


def test_mig_device_gets_its_share() -> None:
    device = Device.of(H100, "3g.40gb")
    assert device.memory_gb == 40
    assert device.compute_fraction == pytest.approx(3 / 7)
    assert device.memory_tbs == pytest.approx(3.35 * 4 / 8)
    with pytest.raises(NotFoundError):
        Device.of(H100, "5g.50gb")
    with pytest.raises(InputError, match="does not support MIG"):
        Device.of(CATALOG.get("l4"), "1g.10gb")


def test_amd_partitions() -> None:
    mi300 = CATALOG.get("mi300x")
    assert mi300.amd_partitions is not None
    assert set(mi300.amd_partitions.valid_modes()) == {"spx_nps1", "dpx_nps1", "qpx_nps1", "cpx_nps1", "cpx_nps4"}
    assert Device.of(mi300, "cpx_nps4").memory_gb == pytest.approx(24)
    with pytest.raises(NotFoundError):
        Device.of(mi300, "spx_nps4")


def test_device_ids_name_whole_gpus_slices_and_partitions() -> None:
    assert CATALOG.device("h100-sxm").profile is None
    assert CATALOG.device("h100-sxm:3g.40gb").memory_gb == 40
    assert CATALOG.device("mi300x:cpx_nps4").id == "mi300x:cpx_nps4"
    with pytest.raises(NotFoundError, match="did you mean 'h100-sxm'"):
        CATALOG.device("h100-sx:3g.40gb")
