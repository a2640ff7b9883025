"""course_utils.measure.count_syncs: which calls count as host syncs, on CPU (as if the tensors lived on a
GPU) and on a GPU (where set_sync_debug_mode also reports syncs made inside C++)."""

from __future__ import annotations

import io
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from course_utils.measure import SYNC_WARNING, count_syncs

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()

# call -> (how it is written, syncs expected); the same list on CPU (cpu_as_device) and on a GPU.
CALLS = {
    "t.shape": (lambda t: t.shape, 0),
    "t * 2": (lambda t: t * 2, 0),
    "t.sum()": (lambda t: t.sum(), 0),
    "t.to(float64)": (lambda t: t.to(torch.float64), 0),
    "t[0].item()": (lambda t: t[0].item(), 1),
    "float(t[0])": (lambda t: float(t[0]), 1),
    "int(t[0])": (lambda t: int(t[0]), 1),
    "if t.sum() > 0": (lambda t: 1 if t.sum() > 0 else 0, 1),
    "print(t)": (lambda t: print(t, file=io.StringIO()), 1),
    "f'{t.sum():.2f}'": (lambda t: f"{t.sum():.2f}", 1),
    "t.cpu()": (lambda t: t.cpu(), 1),
    "t.tolist()": (lambda t: t.tolist(), 1),
    "t.cpu().tolist()": (lambda t: t.cpu().tolist(), 1),   # the copy syncs; reading the host copy does not
    "t.cpu().sum().item()": (lambda t: t.cpu().sum().item(), 1),
    "torch.nonzero(t)": (lambda t: torch.nonzero(t), 1),
    "t[t > 2]": (lambda t: t[t > 2], 1),
    "t[t.argmax()]": (lambda t: t[t.argmax()], 1),        # a 0-d tensor index becomes a Python int
    "torch.unique(t)": (lambda t: torch.unique(t), 1),
    "torch.equal(t, t)": (lambda t: torch.equal(t, t), 1),
    "torch.allclose(t, t)": (lambda t: torch.allclose(t, t), 1),
    "max(t[0], t[1])": (lambda t: max(t[0], t[1]), 1),
    "stack([...]).tolist()": (lambda t: torch.stack([t.sum(), t.mean()]).tolist(), 1),
}


# Syncs that set_sync_debug_mode("warn") did not report (torch 2.11, H100): count_syncs counts them as aten ops.
NOT_REPORTED_BY_DEBUG_MODE = {"torch.equal(t, t)"}


def _count(op, t, **kw):
    with count_syncs(**kw) as s:
        op(t)
    return s


@pytest.mark.parametrize("name", list(CALLS))
def test_each_call_counts_as_on_a_gpu_on_cpu_tensors(name):
    op, want = CALLS[name]
    s = _count(op, torch.arange(8.0), cpu_as_device=True)
    assert s.count == want, (name, s.calls)
    assert len(s.calls) == len(s.where) == want


def test_where_points_at_the_line_that_read():
    t = torch.arange(4.0)
    with count_syncs(cpu_as_device=True) as s:
        t.sum().item()  # the line
    line = Path(__file__).read_text().splitlines().index("        t.sum().item()  # the line") + 1
    assert s.calls == ["Tensor.item"] and s.where == [f"{__file__}:{line}"]


def test_without_cpu_as_device_cpu_tensors_are_host_data():
    s = _count(lambda t: (t.sum().item(), print(t, file=io.StringIO()), torch.nonzero(t)), torch.arange(4.0),
               cpu_as_device=False)
    assert s.count == 0 and s.calls == []


def test_non_blocking_copy_is_not_a_sync_and_to_cpu_is_a_move_to_the_device_here():
    t = torch.arange(4.0)
    assert _count(lambda t: t.to("cpu", non_blocking=True), t, cpu_as_device=True).count == 0
    assert _count(lambda t: t.to("cpu"), t, cpu_as_device=True).count == 0  # on CPU: cannot tell from .to(device)


def test_a_cpu_copy_behaves_like_a_new_tensor_and_keeps_autograd():
    w = torch.ones(3, requires_grad=True)
    with count_syncs(cpu_as_device=True) as s:
        c = w.cpu()
        (c * 2).sum().backward()
        w.sum().item()  # the original still counts as device data
    assert c is not w and torch.equal(w.grad, torch.full((3,), 2.0))
    assert s.calls == ["Tensor.cpu", "Tensor.item"]


def test_training_step_reads_are_counted_once_each():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))

    def step(history, read):
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        acc = (out.argmax(1) == y).float().mean()
        history.append((loss.item(), float(norm), acc.cpu().tolist()) if read else (loss.detach(), norm, acc))

    for read, per_step in ((True, 3), (False, 0)):
        with count_syncs(cpu_as_device=True) as s:
            for _ in range(3):
                step([], read)
        assert s.count == 3 * per_step, s.calls


def test_modes_are_gone_and_other_warnings_pass_through_after_the_block():
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(ValueError):
            with count_syncs(cpu_as_device=True):
                warnings.warn("a warning of the user's own", stacklevel=1)
                raise ValueError("the block failed")
    assert not _get_current_function_mode_stack() and not _get_current_dispatch_mode_stack()
    assert "a warning of the user's own" in [str(w.message) for w in seen]


def test_a_debug_mode_report_after_its_counted_op_is_not_counted_again(monkeypatch):
    """On CUDA, C++ passes set_sync_debug_mode's warning to Python when the outer call (torch.nonzero) returns,
    after the dispatch mode has counted aten.nonzero: that report is the same sync. A report no counted
    call explains still counts. Simulated here: a sync debug mode that does nothing, and warnings by hand."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)

    @torch.overrides.wrap_torch_function(lambda t: (t,))
    def nonzero_then_report(t):  # a Python-level call, like torch.nonzero's binding
        out = torch.nonzero(t)  # the dispatch mode counts aten.nonzero here...
        warnings.warn(f"torch.nonzero {SYNC_WARNING}", UserWarning, stacklevel=1)  # ...then the report arrives
        return out

    @torch.overrides.wrap_torch_function(lambda t: (t,))
    def report_only(t):  # a sync inside C++ that no read op explains
        warnings.warn(f"stream.synchronize {SYNC_WARNING}", UserWarning, stacklevel=1)
        return t

    with count_syncs(cpu_as_device=True) as s:
        nonzero_then_report(torch.arange(4.0))
        report_only(torch.arange(4.0))
    assert s.calls == ["aten.nonzero", "CUDA sync (set_sync_debug_mode)"], s.calls
    assert s.count == 2 and s.debug_syncs == 2 and len(s.where) == 2


def test_debug_syncs_is_none_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with count_syncs() as s:  # default: cpu_as_device where there is no CUDA
        torch.ones(2).sum().item()
    assert s.count == 1 and s.debug_syncs is None


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CALLS))
def test_each_call_counts_on_a_cuda_tensor(name):
    op, want = CALLS[name]
    t = torch.arange(8.0, device="cuda")
    op(t)  # warm-up
    torch.cuda.synchronize()
    s = _count(op, t)
    print(name, s.count, s.calls, s.debug_syncs)
    if name == "t[t.argmax()]":  # PyTorch may read a 0-d CUDA index (a sync) or index with it on the GPU
        assert s.count == min(1, s.debug_syncs), s.calls
        return
    assert s.count == want, (name, s.calls)
    if name not in NOT_REPORTED_BY_DEBUG_MODE:
        assert s.debug_syncs >= want  # print(t) syncs many times inside its one counted call


@pytest.mark.gpu
def test_cuda_syncs_inside_cpp_are_counted_and_explicit_device_sync_is_not():
    t = torch.ones(4, device="cuda")
    with count_syncs() as s:
        torch.cuda.current_stream().synchronize()  # c10 stream_synchronize: reported by the debug mode
    print("stream.synchronize():", s.calls, s.debug_syncs)
    assert s.count == 1 and s.calls == ["CUDA sync (set_sync_debug_mode)"]
    with count_syncs() as s:
        torch.cuda.synchronize()  # cudaDeviceSynchronize: a wait you wrote, not reported
    assert s.count == 0 and s.debug_syncs == 0
    assert torch.cuda.get_sync_debug_mode() == 0
    with count_syncs() as s:
        t.to("cpu")
        t.to("cpu", non_blocking=True)
    assert s.calls == ["Tensor.to"], s.calls


@pytest.mark.gpu
def test_prototype_notice_of_a_fresh_process_is_neither_counted_nor_repeated():
    code = (
        "import warnings, torch; from course_utils.measure import count_syncs\n"
        "t = torch.ones(4, device='cuda'); torch.cuda.synchronize()\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    with count_syncs() as a: t.shape\n"
        "    with count_syncs() as b: t.sum().item()\n"
        "print(a.count, b.count, len(w))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["0", "1", "0"]
