import os

import pytest

from shardfit.parallel.affinity import bind_to_numa_node, numa_node_of, parse_cpulist

BUS = "0000:1b:00.0"


def _sysfs(tmp_path, numa_node: str | None, nodes: dict[int, str]):
    if numa_node is not None:
        dev = tmp_path / "bus/pci/devices" / BUS
        dev.mkdir(parents=True)
        (dev / "numa_node").write_text(numa_node + "\n")
    for n, cpulist in nodes.items():
        d = tmp_path / f"devices/system/node/node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
    return tmp_path


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == set()


@pytest.mark.parametrize("numa_node, nodes, needle", [
    (None, {}, "no NUMA node"),  # no sysfs entry (VMs, containers)
    ("-1", {0: "0-1"}, "no NUMA node"),  # no NUMA
    ("2", {0: "0-1", 2: ""}, "node 2 has no usable CPUs"),  # a virtual, CPU-less node
    ("1", {0: "0", 1: "4096-4100"}, "node 1 has no usable CPUs"),  # none of its CPUs are ours
    ("garbage", {}, "no NUMA node"),
])
def test_odd_topologies_leave_affinity_untouched(tmp_path, numa_node, nodes, needle):
    before = os.sched_getaffinity(0)
    msg = bind_to_numa_node(BUS, _sysfs(tmp_path, numa_node, nodes))
    assert needle in msg and os.sched_getaffinity(0) == before
    assert "unknown" in bind_to_numa_node(None, tmp_path)  # fewer GPUs than ranks, or an old torch


def test_binds_to_the_gpu_node(tmp_path):
    before = os.sched_getaffinity(0)
    cpu = min(before)
    sysfs = _sysfs(tmp_path, "1", {0: "4096", 1: str(cpu)})
    assert numa_node_of(BUS.upper(), sysfs) == 1
    try:
        assert bind_to_numa_node(BUS, sysfs) == "bound to NUMA node 1 (1 CPUs)"
        assert os.sched_getaffinity(0) == {cpu}
    finally:
        os.sched_setaffinity(0, before)
