"""How long a collective takes on a target's links: NVLink inside a GPU node, InfiniBand between
nodes (priced by the algorithm NCCL picks), or a TPU slice's ICI.

A GPU collective of `n` devices on `k` nodes (`g` = n / k per node) over S bytes (nccl-tests'
size: `collectives.Collective.size`) takes the fastest of NCCL's candidates, each

    t = latency + S · factor / bus bandwidth

with `factor` nccl-tests' bus-bandwidth correction (all-reduce 2(n-1)/n; reduce-scatter,
all-gather, all-to-all (n-1)/n):

* ring, LL protocol: NCCL's small-message path; latency `LL_BASE + hops · LL_HOP` (+ `LL_NET_HOP`
  per step that leaves a node), bus bandwidth NCCL's LL cap (`ll_busbw`);
* ring, Simple protocol: latency `SIMPLE_BASE + hops · SIMPLE_HOP` (+ `SIMPLE_NET_HOP`), the
  fabric's nccl-tests ring bus bandwidth in a node; across nodes each ring crosses on its own
  GPU's NIC, so min(ring, g · NIC);
* NVLink SHARP (NVLS; all-reduce of > 4 GPUs on one NVSwitch gen-3 node: H100, H200): latency
  `NVLS_LATENCY`, the measured NVLS bus bandwidth of that many GPUs;
* hierarchical (all-reduce across nodes, what NCCL's tree does): reduce-scatter inside each node,
  all-reduce of its 1/g share between nodes (each GPU on its own NIC), all-gather inside the
  node, the three pipelined: max(2(g-1)/g · S / ring, 2(k-1)/k · S/g / NIC), latency
  `SIMPLE_BASE + 2 ((g-1) TREE_HOP + log2(k) TREE_NET_HOP)`; with NVLink SHARP in the nodes
  (NCCL's NVLS tree) the node part at the NVLS bus bandwidth, latency
  `NVLS_LATENCY + 2 log2(k) NVLS_TREE_NET_HOP`.

An all-to-all or a collective-permute (point-to-point) moves its bytes at the ring bandwidth
inside a node and the NIC's between nodes. Latencies are NCCL's own tuner constants
(`src/graph/tuning.cc`); bandwidths public nccl-tests figures (sources: `aot/targets/README.md`,
docs/AOT.md). XLA's one-shot all-reduce kernels for tiny arrays are priced as NCCL's LL ring.

A TPU collective runs on the slice's ICI: `n` chips (a v4's two TensorCores share a chip; on one
chip a collective is free), the group's extent per dimension of the slice grid, each dimension a
ring if the slice wraps around it (2 links a chip) or a line (1). The chip with the fewest links
bounds a bandwidth-optimal algorithm: t = TPU_LATENCY + S · factor / (links · ICI link bandwidth).
Not calibrated against a TPU measurement.
"""
from __future__ import annotations

import dataclasses
import math

from micse_jax.aot.collectives import Collective
from micse_jax.aot.topology import GPUS_PER_NODE, TPU_CORES_PER_CHIP, tpu_slice

# NCCL's tuner constants (NVIDIA/nccl src/graph/tuning.cc, ncclTunerConstantsDefaults), seconds.
LL_BASE, LL_HOP, LL_NET_HOP = 6.6e-6, 0.6e-6, 2.7e-6               # ring / LL: base, per NVLink step, per network step
SIMPLE_BASE, SIMPLE_HOP, SIMPLE_NET_HOP = 8.4e-6, 3.4e-6, 14.0e-6  # ring / Simple
TREE_HOP, TREE_NET_HOP = 4.0e-6, 14.0e-6                           # tree / Simple, per NVLink and network step
NVLS_LATENCY, NVLS_TREE_NET_HOP = 25e-6, 20.9e-6                    # NVLS / Simple (NVLink), NVLS tree per network step
TPU_LATENCY = 10e-6  # assumed: a collective's fixed cost on ICI (no public figure)


@dataclasses.dataclass(frozen=True)
class GpuFabric:
  """A GPU target's links (bytes/s, one direction, per GPU): NVLink's line rate, the bus bandwidth
  nccl-tests measures for a ring in one node, NVLS all-reduce bus bandwidth by GPU count (none
  without NVLink SHARP), NCCL's LL-protocol caps (1 node, 2 nodes, more), the NIC's line rate
  and the share of it NCCL reaches."""
  nvlink: str
  nvlink_bw: float
  ring_busbw: float
  nvls_busbw: dict
  ll_max: tuple[float, float, float]
  nic: str = "InfiniBand NDR 400 Gb/s per GPU (ConnectX-7)"
  nic_bw: float = 50e9
  nic_efficiency: float = 0.8

  @property
  def nic_busbw(self) -> float:
    """What NCCL moves through one GPU's NIC (bytes/s)."""
    return self.nic_bw * self.nic_efficiency


@dataclasses.dataclass(frozen=True)
class IciFabric:
  """A TPU target's inter-chip interconnect: bytes/s per link and direction, links per chip, and
  which slice dimensions wrap around (`wraps(shape)` → one bool per dimension)."""
  name: str
  link_bw: float
  links: int
  pod_extent: int  # 2D-torus pods (v5e, v6e) wrap only at the pod's full extent; 0: 3D cubes of 4

  def wraps(self, shape: tuple[int, ...]) -> tuple[bool, ...]:
    """Per dimension of a slice: whether it wraps around (a ring) or is a line."""
    if self.pod_extent:
      return tuple(extent == self.pod_extent for extent in shape)
    cubes = all(extent % 4 == 0 for extent in shape)  # whole 4x4x4 cubes, joined by the optical switches
    return tuple(cubes for _ in shape)


_NVLINK4 = dict(nvlink="NVLink 4 (18 links) via NVSwitch gen 3", nvlink_bw=450e9, ring_busbw=370e9,
                nvls_busbw={5: 420e9, 6: 440e9, 7: 460e9, 8: 480e9}, ll_max=(141e9, 45e9, 35e9))
FABRICS = {
    "h100": GpuFabric(**_NVLINK4),
    "h200": GpuFabric(**_NVLINK4),
    "a100": GpuFabric("NVLink 3 (12 links) via NVSwitch gen 2", 300e9, 235e9, {}, (87.7e9, 22.5e9, 19.0e9)),
    "v100": GpuFabric("NVLink 2 (6 links), hybrid cube mesh", 150e9, 120e9, {}, (39.0e9, 39.0e9, 20.4e9)),
    "tpu-v4": IciFabric("ICI, 3D torus (6 links a chip)", 45e9, 6, 0),
    "tpu-v5e": IciFabric("ICI, 2D torus (4 links a chip)", 50e9, 4, 16),
    "tpu-v5p": IciFabric("ICI, 3D torus (6 links a chip)", 100e9, 6, 0),
    "tpu-v6e": IciFabric("ICI, 2D torus (4 links a chip)", 100e9, 4, 16),
}

FACTORS = {"all-reduce": lambda n: 2 * (n - 1) / n, "reduce-scatter": lambda n: (n - 1) / n,
           "all-gather": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n}


def _steps(kind: str, n: int) -> int:
  """A ring's steps: all-reduce 2(n-1), the others n-1 (NCCL's `nsteps`)."""
  return 2 * (n - 1) if kind == "all-reduce" else n - 1


def _ring_candidates(fabric: GpuFabric, kind: str, size: float, n: int, k: int, g: int) -> dict:
  """{algorithm: seconds} of NCCL's ring, LL and Simple protocols, for `n` GPUs on `k` nodes."""
  steps, net = _steps(kind, n), (_steps(kind, k) if k > 1 else 0)
  moved = size * FACTORS[kind](n)
  ring = fabric.ring_busbw if k == 1 else min(fabric.ring_busbw, g * fabric.nic_busbw)
  ll = min(fabric.ll_max[min(k, 3) - 1], ring / 2)
  return {"ring/LL": LL_BASE + (steps - net) * LL_HOP + net * LL_NET_HOP + moved / ll,
          "ring/Simple": SIMPLE_BASE + (steps - net) * SIMPLE_HOP + net * SIMPLE_NET_HOP + moved / ring}


def _hierarchical(fabric: GpuFabric, size: float, k: int, g: int) -> dict:
  """{algorithm: seconds} of an all-reduce across `k` nodes of `g` GPUs: node reduce-scatter,
  network all-reduce of the 1/g share, node all-gather, pipelined (the slowest of the NVLink and
  the network parts); the node part by NVLink SHARP too where the node has it."""
  network = 2 * (k - 1) / k * size / g / fabric.nic_busbw
  found = {"hierarchical": SIMPLE_BASE + 2 * ((g - 1) * TREE_HOP + math.log2(k) * TREE_NET_HOP)
                           + max(2 * (g - 1) / g * size / fabric.ring_busbw, network)}
  if g in fabric.nvls_busbw:
    found["NVLS tree"] = (NVLS_LATENCY + 2 * math.log2(k) * NVLS_TREE_NET_HOP
                          + max(2 * (g - 1) / g * size / fabric.nvls_busbw[g], network))
  return found


def _gpu_point_to_point(fabric: GpuFabric, collective: Collective, group: tuple[int, ...]) -> tuple[float, str]:
  """An all-to-all (every pair) or a collective-permute (its pairs): bytes inside the node at the
  ring bandwidth, across nodes through each GPU's NIC."""
  node = lambda d: d // GPUS_PER_NODE
  if collective.kind == "collective-permute":
    crosses = any(node(a) != node(b) for a, b in collective.pairs)
    bandwidth = fabric.nic_busbw if crosses else fabric.ring_busbw
    return SIMPLE_BASE + (SIMPLE_NET_HOP if crosses else SIMPLE_HOP) + collective.size / bandwidth, "p2p"
  n, local = len(group), sum(node(d) == node(group[0]) for d in group)
  inside = (local - 1) / n * collective.size / fabric.ring_busbw
  outside = (n - local) / n * collective.size / fabric.nic_busbw
  return SIMPLE_BASE + (SIMPLE_NET_HOP if n > local else SIMPLE_HOP) + max(inside, outside), "p2p"


def gpu_seconds(fabric: GpuFabric, collective: Collective, group: tuple[int, ...]) -> tuple[float, str]:
  """(seconds, NCCL algorithm) of one group of a GPU collective (see the module docstring)."""
  n = len(group)
  if n <= 1 or collective.size <= 0:
    return 0.0, "none"
  if collective.kind in ("all-to-all", "collective-permute"):
    return _gpu_point_to_point(fabric, collective, group)
  nodes = {d // GPUS_PER_NODE for d in group}
  k = len(nodes)
  g = max(sum(d // GPUS_PER_NODE == x for d in group) for x in nodes)
  candidates = _ring_candidates(fabric, collective.kind, collective.size, n, k, g)
  if collective.kind == "all-reduce" and k == 1 and n in fabric.nvls_busbw:
    candidates["NVLS"] = NVLS_LATENCY + collective.size * FACTORS["all-reduce"](n) / fabric.nvls_busbw[n]
  if collective.kind == "all-reduce" and k > 1:
    candidates.update(_hierarchical(fabric, collective.size, k, g))
  algorithm = min(candidates, key=candidates.get)
  return candidates[algorithm], algorithm


def _chip_coords(device: int, shape: tuple[int, ...], cores: int) -> tuple[int, ...]:
  """A TPU device's chip coordinates in the slice grid (libtpu's device order: x fastest)."""
  index, coords = device // cores, []
  for extent in shape:
    coords.append(index % extent)
    index //= extent
  return tuple(coords)


def tpu_seconds(fabric: IciFabric, collective: Collective, group: tuple[int, ...], shape: tuple[int, ...],
                cores: int = 1) -> tuple[float, str]:
  """(seconds, "ICI") of one group of a TPU collective on a slice of chip grid `shape` (see the
  module docstring)."""
  chips = {_chip_coords(d, shape, cores) for d in group}
  n = len(chips)
  if n <= 1 or collective.size <= 0:
    return 0.0, "none"
  extents = [len({c[i] for c in chips}) for i in range(len(shape))]
  wraps = fabric.wraps(shape)
  links = sum((2 if wraps[i] and e == shape[i] and e >= 3 else 1) for i, e in enumerate(extents) if e >= 2)
  if collective.kind == "collective-permute":
    return TPU_LATENCY + collective.size / fabric.link_bw, "ICI"
  return TPU_LATENCY + collective.size * FACTORS[collective.kind](n) / (links * fabric.link_bw), "ICI"


def seconds(collective: Collective, target: str, num_devices: int) -> tuple[float, str]:
  """(seconds, algorithm) of a collective on `target` with `num_devices`: its slowest group (the
  groups run at once, each on its own devices' links)."""
  fabric = FABRICS[target]
  if isinstance(fabric, GpuFabric):
    priced = [gpu_seconds(fabric, collective, g) for g in collective.groups]
  else:
    shape, cores = tpu_slice(target, num_devices), TPU_CORES_PER_CHIP.get(target, 1)
    priced = [tpu_seconds(fabric, collective, g, shape, cores) for g in collective.groups]
  return max(priced, default=(0.0, "none"))


def links(target: str) -> str:
  """A target's links in words (the report's line)."""
  fabric = FABRICS[target]
  if isinstance(fabric, GpuFabric):
    return (f"{fabric.nvlink} ({fabric.nvlink_bw / 1e9:.0f} GB/s a direction, NCCL ring "
            f"{fabric.ring_busbw / 1e9:.0f} GB/s), {GPUS_PER_NODE} GPUs a node; between nodes {fabric.nic} "
            f"({fabric.nic_busbw / 1e9:.0f} GB/s reached)")
  return f"{fabric.name}, {fabric.link_bw / 1e9:.0f} GB/s a link and direction"
