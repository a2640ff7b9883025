"""Checks for lesson 04 (asynchronous copies)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from . import expect, needs_gpu, passed

EX_PREFETCH = "ex04_prefetcher"
MIN_HIDDEN = 0.5  # fraction of copy time under compute that counts as overlapped


class _Source:
    """Host batches that note how many the prefetcher has taken (to see it reads ahead)."""

    def __init__(self, batches: list[Any]):
        self.batches, self.taken = batches, 0

    def __iter__(self) -> Iterator[Any]:
        for b in self.batches:
            self.taken += 1
            yield b


def late_copy_batches(batches: list[Any], delay_ms: float) -> list[Any]:
    """The same host batches, but every copy of one to the GPU starts `delay_ms` late.

    Before the copy, a sleep kernel is queued on the stream the copy goes to (whichever stream the
    prefetcher chose). Compute that waits for its copy still gets the right data; compute that does not
    wait reads a buffer that has not been filled yet, on any GPU, however fast its copy engines are.
    """
    import torch

    from ..events import cycles_per_ms

    class LateCopy(torch.Tensor):
        cycles = max(1, int(delay_ms * cycles_per_ms()))

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if _copies_to_cuda(func, args, kwargs):
                torch.cuda._sleep(cls.cycles)
            with torch._C.DisableTorchFunctionSubclass():  # results are plain tensors again
                return func(*args, **kwargs)

    return [b.as_subclass(LateCopy) for b in batches]


def _copies_to_cuda(func: Any, args: tuple, kwargs: dict) -> bool:
    """Is this call a host-to-GPU copy (`dst.copy_(src)`, `src.to("cuda")`, `src.cuda()`)?"""
    import torch

    if func is torch.Tensor.copy_:
        return args[0].is_cuda and not args[1].is_cuda
    if func is torch.Tensor.cuda:
        return True
    if func is torch.Tensor.to:
        targets = list(args[1:]) + list(kwargs.values())
        return any((isinstance(t, torch.Tensor) and t.is_cuda) or (isinstance(t, (str, torch.device))
                   and torch.device(t).type == "cuda") for t in targets if not isinstance(t, (bool, torch.dtype)))
    return False


def run_prefetcher(prefetch: Callable, batches: list[Any], device: Any, tl: Any, compute_ms: float = 0.0
                   ) -> tuple[list[Any], list[int]]:
    """Feed `batches` through `prefetch(batches, device, tl)`; compute `b * 2 + 1` on each as it comes.

    Returns the results and, for each batch received, how many batches the prefetcher had taken by then.
    Compute reads its batch first (so a missing wait shows), then spins `compute_ms` on a GPU.
    """
    source = _Source(batches)
    outs, taken = [], []
    for b in prefetch(source, device, tl):
        taken.append(source.taken)
        with tl.span(f"compute {len(outs)}", kind="compute"):
            outs.append(b * 2 + 1)
            if compute_ms > 0:
                from ..events import sleep_ms

                sleep_ms(compute_ms)
    return outs, taken


def judge_prefetcher(n: int, outs: list[Any], expected: list[Any], taken: list[int], device_ok: bool,
                     hidden: float | None = None) -> None:
    """The verdict on what was seen; `hidden` (copy time under compute, 0..1) is None when not measured."""
    import torch

    expect(len(outs) == n, EX_PREFETCH, f"{n} batches out for {n} in", len(outs))
    expect(device_ok, EX_PREFETCH, "batches on the requested device", "a batch elsewhere",
           hint="copy each host batch to `device`")
    wrong = [i for i, (o, e) in enumerate(zip(outs, expected, strict=True)) if not torch.equal(o.cpu(), e)]
    expect(not wrong, EX_PREFETCH, "every batch's result correct", f"wrong results for batches {wrong}",
           hint="compute must wait for its batch's copy (an event), and a buffer must not be overwritten while in use")
    ahead = [t - (i + 1) for i, t in enumerate(taken)]
    expect(all(a >= 1 for a in ahead[:-1]), EX_PREFETCH,
           "batch i+1 already taken (its copy started) when batch i is handed out",
           f"batches taken ahead: {ahead}", hint="start the next copy before you yield the current batch")
    if hidden is not None:
        expect(hidden >= MIN_HIDDEN, EX_PREFETCH, f"at least {MIN_HIDDEN:.0%} of copy time hidden under compute",
               f"{hidden:.0%}", hint="copy on a side stream, wrapped in tl.span(..., kind='h2d') on that stream")


def _one_run(prefetch: Callable, device: Any, tl: Any, batches: list[Any], compute_ms: float = 0.0) -> tuple:
    expected = [b * 2 + 1 for b in batches]
    outs, taken = run_prefetcher(prefetch, batches, device, tl, compute_ms)
    device_ok = all(getattr(o, "device", None) is not None and o.device.type == device.type for o in outs)
    return outs, expected, taken, device_ok


def check_prefetcher(prefetch: Callable, n_batches: int = 6, gpu_batch_mib: int = 32) -> None:
    """`prefetch(batches, device, tl)` yields each batch on `device`, reading ahead; on a GPU, overlapped."""
    import torch

    from ..timeline import Timeline

    cpu = torch.device("cpu")
    batches = [torch.randn(1000) for _ in range(n_batches)]
    outs, expected, taken, dev_ok = _one_run(prefetch, cpu, Timeline(device="cpu"), batches)
    judge_prefetcher(n_batches, outs, expected, taken, dev_ok)
    print(f"{EX_PREFETCH}: correct and reading ahead with device='cpu' (the CPU stand-in)")
    if not needs_gpu(EX_PREFETCH):
        return
    from .. import bench, events

    events.cycles_per_ms()  # calibrate the compute kernel now, not inside a timed run
    gpu = torch.device("cuda")
    numel = gpu_batch_mib * (1 << 20) // 4
    probe = torch.empty(numel, device=gpu)
    pinned = torch.empty(numel).pin_memory()
    copy_ms = bench.measure("h2d", numel * 4, lambda: probe.copy_(pinned, non_blocking=True)).time_ms
    compute_ms = max(0.5, 2 * copy_ms)
    hidden: float | None = None
    # Fresh data each run, so a stale buffer cannot look right. The first two runs compute nothing but
    # b * 2 + 1 and every copy starts 2 ms late, so a compute that does not wait for its copy reads an
    # unfilled buffer; the last run computes about twice as long as a copy takes, and its overlap is judged.
    for run_compute_ms in (0.0, 0.0, compute_ms):
        batches = [torch.rand(numel).pin_memory() for _ in range(n_batches)]
        if run_compute_ms == 0.0:
            batches = late_copy_batches(batches, delay_ms=2.0)
        compute = torch.cuda.Stream()  # a side stream: avoid the legacy default stream's implicit syncs
        with torch.cuda.stream(compute):
            tl = Timeline()
            outs, expected, taken, dev_ok = _one_run(prefetch, gpu, tl, batches, run_compute_ms)
        torch.cuda.synchronize()
        hidden = (tl.stats().copy_compute_overlap or 0.0) if run_compute_ms > 0 else None
        judge_prefetcher(n_batches, outs, expected, taken, dev_ok, hidden)
    hidden = hidden or 0.0
    passed(EX_PREFETCH, f"correct on 3 runs; {hidden:.0%} of copy time hidden under compute")

