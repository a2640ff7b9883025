"""course_utils.hardware: parsing captured nvidia-smi output, and doctor() on this machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from course_utils import hardware
from course_utils.hardware import GPUInfo, choose_backend, parse_gpu_query, parse_topo_matrix

TOPO = Path(__file__).parent / "data" / "topo"


@pytest.mark.parametrize(
    "name, n, pair, nvlinks, code",
    [
        ("captured_2gpu_h200_nvlink.txt", 2, (0, 1), 18, "NV18"),
        ("2gpu_nvlink.txt", 2, (0, 1), 18, "NV18"),
        ("2gpu_pcie.txt", 2, (0, 1), 0, "SYS"),
        ("captured_4gpu_h200_nvlink.txt", 4, (1, 3), 18, "NV18"),
        ("4gpu_nvlink.txt", 4, (1, 3), 4, "NV4"),
        ("4gpu_pcie.txt", 4, (2, 3), 0, "PXB"),
        ("8gpu_nvlink.txt", 8, (0, 7), 18, "NV18"),
        ("8gpu_pcie.txt", 8, (0, 5), 0, "SYS"),
    ],
)
def test_parse_topo_captures(name, n, pair, nvlinks, code):
    topo = parse_topo_matrix((TOPO / name).read_text())
    assert topo.gpus == [f"GPU{i}" for i in range(n)]
    assert len(topo.links) == n and all(len(r) == n for r in topo.links)
    i, j = pair
    assert topo.links[i][j] == code
    assert topo.nvlinks(i, j) == nvlinks == topo.nvlinks(j, i)
    assert all(topo.links[k][k] == "X" and topo.nvlinks(k, k) == 0 for k in range(n))
    # NIC columns/rows in the 8-GPU capture must not leak into the GPU matrix.
    assert not any(c.startswith("NIC") or "-" in c for row in topo.links for c in row)


def test_parse_topo_pcie_layout_details():
    topo = parse_topo_matrix((TOPO / "4gpu_pcie.txt").read_text())
    assert topo.links[0][1] == "PIX" and topo.describe(0, 1) == "PCIe, one switch"
    assert topo.describe(0, 2).startswith("PCIe across NUMA")
    nv = parse_topo_matrix((TOPO / "8gpu_nvlink.txt").read_text())
    assert nv.describe(3, 4) == "NVLink x18"


def test_parse_topo_rejects_garbage():
    with pytest.raises(ValueError, match="no GPU header"):
        parse_topo_matrix("No devices were found\n")
    truncated = "\n".join((TOPO / "4gpu_nvlink.txt").read_text().splitlines()[:3])
    with pytest.raises(ValueError, match="GPU rows"):
        parse_topo_matrix(truncated)


def test_parse_topo_ignores_ansi_colour():
    text = (TOPO / "2gpu_nvlink.txt").read_text().replace("GPU0\tGPU1", "\x1b[4mGPU0\x1b[0m\t\x1b[4mGPU1\x1b[0m", 1)
    assert parse_topo_matrix(text).nvlinks(0, 1) == 18


def test_parse_gpu_query_and_pcie_limit():
    text = "0, NVIDIA H100 80GB HBM3, 81559, 9.0, 5, 16\n1, Tesla T4, 15360, 7.5, [N/A], [N/A]\n"
    a, b = parse_gpu_query(text)
    assert (a.index, a.name, a.compute_capability) == (0, "NVIDIA H100 80GB HBM3", "9.0")
    assert (a.pcie_gen, a.pcie_width) == (5, 16)
    assert a.memory_gib == pytest.approx(79.6, abs=0.1)
    assert a.pcie_gbps == pytest.approx(63.0, abs=0.1)  # PCI-SIG: gen5 x16, 128b/130b
    assert b.pcie_gen is None and b.pcie_gbps is None
    assert GPUInfo(0, "x", pcie_gen=3, pcie_width=8).pcie_gbps == pytest.approx(7.9, abs=0.1)


def test_choose_backend():
    assert choose_backend(0, True)[0] == "gloo"
    assert choose_backend(2, True)[0] == "nccl"
    assert choose_backend(1, True, nproc=2)[0] == "gloo"
    assert choose_backend(4, False)[0] == "gloo"
    assert "no NCCL" in choose_backend(4, False)[1]


def test_doctor_reports_this_machine(capsys):
    import torch

    m = hardware.doctor()
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out
    assert m.torch == torch.__version__
    assert m.cpu_cores >= 1 and m.cpu_cores_usable >= 1
    assert m.backend in {"gloo", "nccl"}
    assert f"Backend for 2 ranks: {m.backend}" in out
    if torch.cuda.is_available():
        assert m.gpu_count == torch.cuda.device_count()
        assert all(f"GPU{g.index}: {g.name}" in out for g in m.gpus)
    else:
        assert m.gpus == [] and "GPUs: none" in out


def test_doctor_does_not_initialise_cuda():
    """Checked in a fresh interpreter: other tests in this worker may have initialised CUDA already."""
    code = "import torch, course_utils as cu; cu.doctor(); print('initialised:', torch.cuda.is_initialized())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "initialised: False"


def test_doctor_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(hardware.shutil, "which", lambda name: None)
    hardware.probe.cache_clear()
    try:
        m = hardware.probe()
    finally:
        hardware.probe.cache_clear()
    assert m.topology is None
    assert any("nvidia-smi not found" in n for n in m.notes)
    assert "note: nvidia-smi not found" in hardware.format_report(m)


def test_report_with_captured_four_gpu_box(monkeypatch):
    """The whole probe on canned nvidia-smi answers: links and PCIe appear; a CPU torch is flagged."""
    query = "".join(f"{i}, NVIDIA A100-SXM4-80GB, 81920, 8.0, 4, 16\n" for i in range(4))
    answers = {
        "--query-gpu=index,name,memory.total,compute_cap,pcie.link.gen.max,pcie.link.width.max": query,
        "--query-gpu=driver_version": "550.54.15\n" * 4,
        "topo": (TOPO / "4gpu_nvlink.txt").read_text(),
    }
    monkeypatch.setattr(hardware, "_run", lambda cmd, timeout=20: answers[cmd[1]])
    import torch

    # As on a box with a CPU build of torch: nvidia-smi answers, torch sees no CUDA.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    hardware.probe.cache_clear()
    try:
        m = hardware.probe()
    finally:
        hardware.probe.cache_clear()
    report = hardware.format_report(m)
    assert m.gpu_count == 4 and m.driver == "550.54.15"
    assert "GPU1-GPU3: NVLink x4" in report
    assert "PCIe gen4 x16" in report
    assert m.backend == "gloo"
    assert any("torch cannot use them" in n for n in m.notes)
