"""Bind each rank's CPU threads to its GPU's NUMA node (data loading and kernel launches stay local).

Integer interfaces only: the node comes from sysfs (/sys/bus/pci/devices/<pci id>/numa_node), its CPUs from
/sys/devices/system/node/node<N>/cpulist, and the binding is os.sched_setaffinity. No libnuma bitmasks (the fourth
seed report's segfaults). Whatever is missing or odd leaves the affinity untouched: no NUMA (-1 or no sysfs), a node
without CPUs (the virtual NVLink nodes of GB200 systems), fewer GPUs than expected, CPUs outside the allowed set.
"""

from __future__ import annotations

import os
from pathlib import Path


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}; '' -> set()."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_node_of(pci_bus_id: str, sysfs: Path = Path("/sys")) -> int | None:
    try:
        node = int((sysfs / "bus/pci/devices" / pci_bus_id.lower() / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def node_cpus(node: int, sysfs: Path = Path("/sys")) -> set[int]:
    try:
        return parse_cpulist((sysfs / f"devices/system/node/node{node}/cpulist").read_text())
    except (OSError, ValueError):
        return set()


def gpu_pci_bus_id(index: int) -> str | None:
    import torch

    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    props = torch.cuda.get_device_properties(index)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:  # older torch: no PCI location on the properties
        return None
    return f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"


def bind_to_numa_node(pci_bus_id: str | None, sysfs: Path = Path("/sys")) -> str:
    """Bind this process to the CPUs of the device's NUMA node; returns what was done, for the log."""
    if not pci_bus_id or not hasattr(os, "sched_setaffinity"):
        return "NUMA binding skipped: GPU location unknown"
    node = numa_node_of(pci_bus_id, sysfs)
    if node is None:
        return f"NUMA binding skipped: no NUMA node for {pci_bus_id}"
    allowed = os.sched_getaffinity(0)
    cpus = node_cpus(node, sysfs) & allowed
    if not cpus:  # a CPU-less (virtual) node, or none of its CPUs are ours
        return f"NUMA binding skipped: node {node} has no usable CPUs"
    os.sched_setaffinity(0, cpus)
    return f"bound to NUMA node {node} ({len(cpus)} CPUs)"
