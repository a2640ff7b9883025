"""What this machine is: GPUs, memory, how they are linked, CPU, versions, and the backend to use.

`probe()` gathers the facts once per process and returns a `Machine`; `doctor()` prints a compact
report of it. Missing tools (no NVML, no nvidia-smi, no GPU, no NCCL) are reported as such and never raise.

Where the facts come from, one module each:
- `nvml`: the driver's own view through NVML (nvidia-ml-py), read without a CUDA context;
- `smi_text`: nvidia-smi's text output, the fallback when NVML cannot be used from Python;
- `visible`: which physical GPUs CUDA shows this process, and under which numbers
  (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER);
- `cuda_child`: what only CUDA can say, asked in a short-lived child process;
- `report`: puts them together (`probe`) and prints them (`doctor`).

The notebook's own process never initialises CUDA here: a CUDA context would hold GPU memory for the
whole session and get in the way of the worker processes.
"""

from __future__ import annotations

from .model import PCIE_LANE_GBPS, GPUInfo, Machine, Topology
from .report import NO_GPU, choose_backend, doctor, format_report, probe
from .smi_text import parse_gpu_query, parse_topo_matrix
from .visible import parse_visible_devices, select_visible

__all__ = [
    "NO_GPU", "PCIE_LANE_GBPS", "GPUInfo", "Machine", "Topology", "choose_backend", "doctor", "format_report",
    "parse_gpu_query", "parse_topo_matrix", "parse_visible_devices", "probe", "select_visible",
]
