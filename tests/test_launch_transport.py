"""What travels between the notebook and its ranks: frames of any size in linear time, pickling onto the
CPU only (results, exceptions), calls that refuse tensors on a device, the one output routine, and the
readable stacks of stuck ranks. CPU only; the CUDA side of these is in test_launch_gpu.py.
"""

from __future__ import annotations

import io
import os
import pickle
import selectors
import sys
import threading
import time

import pytest
import torch

from course_utils import launch
from course_utils.launch import WorkerError, WorkerTimeout, output, pickling, stacks, transport
from tests.launch_helpers import (
    assert_clean,
    assert_cuda_untouched,
    cell_function,
    snapshot,
    tcpstore_warmed,  # noqa: F401  (an autouse fixture)
)

pytestmark = pytest.mark.ranks

# ---- frames ------------------------------------------------------------------------------------------


def _receive_all(read_fd: int, expect: int) -> list[tuple[tuple, bytes]]:
    os.set_blocking(read_fd, False)
    reader, got = transport.FrameReader(), []
    with selectors.DefaultSelector() as sel:
        sel.register(read_fd, selectors.EVENT_READ)
        while len(got) < expect and not reader.eof:
            sel.select(5)
            more = True
            while more:
                frames, more = reader.read_some(read_fd)
                got += [(meta, bytes(payload)) for meta, payload in frames]
    return got


@pytest.mark.timeout(60)
def test_frames_of_any_size_arrive_whole_whatever_the_reads():
    sizes = [0, 1, 15, 16, 17, 65535, 65536, (1 << 20) + 3, 5 << 20]
    payloads = [os.urandom(n) for n in sizes]
    r, w = os.pipe()

    def write():
        for i, p in enumerate(payloads):
            if i % 2:  # split writes too, at awkward places
                parts = transport.encode(("ok", i), p)
                for part in parts:
                    for k in range(0, len(part), 7919):
                        os.write(w, part[k:k + 7919])
            else:
                transport.write_frame(w, ("ok", i), p)
        os.close(w)

    writer = threading.Thread(target=write)
    writer.start()
    got = _receive_all(r, len(payloads))
    writer.join()
    os.close(r)
    assert [meta for meta, _ in got] == [("ok", i) for i in range(len(payloads))]
    assert [p for _, p in got] == payloads


@pytest.mark.timeout(60)
def test_a_large_frame_takes_time_linear_in_its_size():
    """A reader that rebuilds its whole buffer on every 64 KiB read takes time quadratic in the frame's size.
    Here 64 MiB through a pipe must take about as long as writing it (well under a second)."""
    payload = bytes(64 << 20)
    r, w = os.pipe()
    writer = threading.Thread(target=lambda: (transport.write_frame(w, ("ok", 1), payload), os.close(w)))
    start = time.perf_counter()
    writer.start()
    got = _receive_all(r, 1)
    elapsed = time.perf_counter() - start
    writer.join()
    os.close(r)
    assert len(got[0][1]) == len(payload)
    assert elapsed < 3.0, f"64 MiB took {elapsed:.2f} s"


def test_the_worker_side_reads_frames_from_a_blocking_pipe():
    r, w = os.pipe()
    transport.write_frame(w, ("call", 3), b"abc")
    os.close(w)
    meta, payload = transport.read_frame(r)
    assert meta == ("call", 3) and bytes(payload) == b"abc"
    assert transport.read_frame(r) is None  # end of file
    os.close(r)


def test_received_tensors_share_the_frame_and_are_aligned():
    """Tensor bytes travel beside the pickle stream: the tensors that come out use the received buffer itself
    (no copy after the pipe), at aligned addresses."""
    import ctypes

    sent = {"a": torch.arange(1001, dtype=torch.float64), "b": torch.ones(3, dtype=torch.complex128),
            "c": torch.tensor([1, 2, 3], dtype=torch.int8), "d": torch.arange(7.0)}
    r, w = os.pipe()
    writer = threading.Thread(target=lambda: (transport.write_frame(w, ("ok", 1), pickling.dumps_on_cpu(sent)),
                                              os.close(w)))
    writer.start()
    reader = transport.FrameReader()
    frames = []
    while not frames:
        frames, _ = reader.read_some(r)
    writer.join()
    os.close(r)
    meta, payload = frames[0]
    got = pickling.loads_on_cpu(payload)
    assert meta == ("ok", 1) and all(torch.equal(got[k], v) for k, v in sent.items())
    body = payload.obj  # the bytearray the frame arrived in
    start = ctypes.addressof((ctypes.c_char * len(body)).from_buffer(body))
    for t in got.values():
        assert start <= t.data_ptr() < start + len(body)  # inside the received buffer: not copied out of it
        assert t.data_ptr() % pickling.ALIGN == 0


BIG = cell_function("""
    import torch
    import torch.distributed as dist

    def big(mib):
        return torch.full((mib << 18,), float(dist.get_rank() + 1))  # float32: 4 bytes each
""", "big")


@pytest.mark.timeout(120)
def test_two_ranks_return_64_mib_each_well_within_the_timeout():
    before = snapshot()
    start = time.monotonic()
    results = launch.run(BIG, 64, nproc=2, backend="gloo", timeout=100)
    elapsed = time.monotonic() - start
    assert [r.numel() * 4 for r in results.values()] == [64 << 20] * 2
    assert results[0][-1].item() == 1.0 and results[1][12345].item() == 2.0
    assert elapsed < 30, f"2 x 64 MiB took {elapsed:.1f} s"
    assert_clean(before)


SLOW_TO_SEND = cell_function("""
    import time

    class SlowToPickle:
        def __reduce__(self):
            time.sleep(30)  # the function has returned; only the result is still on its way
            return (int, (1,))

    def finished():
        return SlowToPickle()
""", "finished")


@pytest.mark.timeout(90)
def test_a_timeout_while_results_are_on_their_way_blames_no_collective():
    before = snapshot()
    pool = launch.Pool(2, backend="gloo")  # started and ready, so the timeout below measures the call alone
    with pytest.raises(WorkerTimeout) as info:
        pool.run(SLOW_TO_SEND, timeout=4)
    err = info.value
    assert err.sending == [0, 1] and err.running == [] and err.starting == [] and err.stacks == {}
    assert "had finished, but the results were still on the way back" in str(err)
    assert "mismatched" not in str(err) and "still running" not in str(err)
    assert_clean(before)


# ---- pickling: calls out, results and exceptions back on the CPU ---------------------------------------


def _pickled_as_if_on_cuda(obj, monkeypatch) -> bytes:
    """Pickle obj with torch's own pickling, its storages labelled cuda:0, as a GPU rank's would be."""
    import torch.serialization as ser

    with monkeypatch.context() as m:
        m.setattr(ser, "location_tag", lambda storage: "cuda:0")
        return pickle.dumps(obj)


def test_storages_saved_on_a_gpu_unpickle_onto_the_cpu(monkeypatch):
    before = snapshot()  # (a test file run earlier in this worker may have initialised CUDA)
    t = torch.arange(6.0).reshape(2, 3)
    data = _pickled_as_if_on_cuda({"t": t, "err": ValueError(t)}, monkeypatch)
    if not torch.cuda.is_available():  # plain pickle would rebuild them on the GPU: here, it cannot
        with pytest.raises(RuntimeError, match="CUDA"):
            pickle.loads(data)
    out = pickling.loads_pickle_on_cpu(data)
    assert out["t"].device.type == "cpu" and torch.equal(out["t"], t)
    assert isinstance(out["err"], ValueError) and torch.equal(out["err"].args[0], t)
    assert_cuda_untouched(before)


def test_tensors_round_trip_with_dtype_shape_strides_and_type():
    cases = [torch.arange(10.0), torch.arange(10.0)[2:7:2], torch.tensor([], dtype=torch.bfloat16),
             torch.randn(3, 4).t(), torch.nn.Parameter(torch.ones(3)), torch.tensor([True, False]),
             torch.ones(2, dtype=torch.complex64), torch.arange(5, dtype=torch.int64)]
    for t in cases:
        back = pickling.loads_on_cpu(pickling.dumps_on_cpu({"t": t}))["t"]
        assert type(back) is type(t) and back.dtype == t.dtype and back.stride() == t.stride()
        assert torch.equal(back, t)
    module = torch.nn.Linear(4, 3)
    back = pickling.loads_on_cpu(pickling.dumps_on_cpu(module.state_dict()))
    assert all(torch.equal(back[k], v) for k, v in module.state_dict().items())


def test_tensors_on_a_device_are_refused_with_a_clear_error():
    on_device = torch.empty(4, device="meta")  # a device that every torch build has; cuda:0 reads the same
    uses_it = cell_function("""
        def uses_it():
            return weights.sum()
    """, "uses_it")
    uses_it.__globals__["weights"] = on_device
    with pytest.raises(TypeError, match=r"fn uses a tensor on meta, which cannot be sent to the ranks") as info:
        launch.run(uses_it, nproc=2, backend="gloo")
    assert "x.cpu()" in str(info.value) and "LOCAL_RANK" in str(info.value)
    with pytest.raises(TypeError, match=r"argument 0 holds a tensor on meta"):
        launch.run(print, on_device, nproc=2, backend="gloo")
    with pytest.raises(TypeError, match=r"keyword argument 'w' holds a tensor on meta"):
        launch.run(print, w={"layer": [on_device]}, nproc=2, backend="gloo")


RAISES_WITH_TENSOR = cell_function("""
    import torch
    import torch.distributed as dist

    def raises_with_tensor():
        raise ValueError(torch.full((2,), float(dist.get_rank())))
""", "raises_with_tensor")


@pytest.mark.timeout(60)
def test_an_exception_holding_a_tensor_comes_back_through_the_cpu_unpickler(monkeypatch):
    calls = []
    real = pickling.loads_on_cpu

    def counting(data):
        calls.append(len(data))
        return real(data)

    monkeypatch.setattr("course_utils.launch.group.loads_on_cpu", counting)
    with pytest.raises(WorkerError) as info:
        launch.run(RAISES_WITH_TENSOR, nproc=2, backend="gloo")
    exc = info.value.exception
    assert isinstance(exc, ValueError) and exc.args[0].device.type == "cpu"
    assert calls, "the exception was not unpickled by the CPU unpickler"


# ---- output: one routine for both paths ------------------------------------------------------------------


def test_lines_split_across_reads_are_printed_whole_with_their_rank(capsys):
    out = output.RankOutput(nproc=12, colour=False)
    for chunk in (b"hel", b"lo\nwor", b"ld\n", b"no end"):
        out.feed("fd", chunk, sys.stdout, 3)
    out.feed("torchrun", b"[default11]:from torchrun\nagent says hi\n[default2]:x", sys.stderr, None)
    out.end_all()
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["[rank  3] hello", "[rank  3] world", "[rank  3] no end"]
    assert captured.err.splitlines() == ["[rank 11] from torchrun", "agent says hi", "[rank  2] x"]
    assert out.last == {3: "no end", 11: "from torchrun", 2: "x"}


def test_only_chosen_ranks_are_printed_but_every_last_line_is_kept(capsys):
    out = output.RankOutput(nproc=2, show=frozenset({1}), colour=True)
    out.feed(1, b"zero\n", sys.stdout, 0)
    out.feed(2, b"one\n", sys.stdout, 1)
    printed = capsys.readouterr().out
    assert "zero" not in printed and printed.startswith("\033[") and "[rank 1]\033[0m one" in printed
    assert out.last == {0: "zero", 1: "one"}


def test_kinetos_profiler_markers_are_dropped_and_nothing_else(capsys):
    """torch 2.13's kineto prints a USDT line at every profiler start and stop (on stderr: a learner sees it in
    red), torch 2.11's reports "no CUDA device" in ranks whose GPUs are hidden (gloo ranks on a GPU machine); lines
    that only look alike, and kineto's other errors, still reach the learner."""
    out = output.RankOutput(nproc=2, colour=False)
    out.feed("fd", b"USDT:2026-11-26 14:17:31 25539:25539 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
                   b"USDT:2026-11-26 14:17:31 25539:25539 SyncActivityProfilerHandler.cpp:59] profiler_stop\n"
                   b"ERROR:2026-11-26 11:22:08 51:51 DeviceProperties.cpp:48] gpuGetDeviceCount failed with code 100\n"
                   b"ERROR:2026-11-26 14:17:31 25539:25539 DeviceProperties.cpp:48] gpuGetDeviceCount failed\n"
                   b"ERROR:2026-11-26 14:17:31 25:25 DeviceProperties.cpp:48] gpuGetDeviceCount failed with code 3\n"
                   b"USDT: profiler_start, said my own code\n", sys.stderr, 0)
    torchrun_line = b"[default1]:USDT:2026-11-26 14:17:31 2:2 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
    out.feed("torchrun", torchrun_line, sys.stderr, None)
    out.end_all()
    assert capsys.readouterr().err.splitlines() == [
        "[rank 0] ERROR:2026-11-26 14:17:31 25539:25539 DeviceProperties.cpp:48] gpuGetDeviceCount failed",
        "[rank 0] ERROR:2026-11-26 14:17:31 25:25 DeviceProperties.cpp:48] gpuGetDeviceCount failed with code 3",
        "[rank 0] USDT: profiler_start, said my own code"]


def test_colour_only_inside_a_jupyter_kernel(monkeypatch):
    import ipykernel  # noqa: F401  (imported, as grading or kernelspec lookups do, but no kernel runs here)

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    assert not output.in_jupyter_kernel()
    assert output.use_colour() == sys.stdout.isatty()
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert output.use_colour()
    monkeypatch.setenv("NO_COLOR", "1")
    assert not output.use_colour()


# ---- stacks ----------------------------------------------------------------------------------------------

FAULTHANDLER_DUMP = '''\
Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "{launch}/worker.py", line 40 in watchdog
  File "/usr/lib/python3.11/threading.py", line 975 in run
  File "/usr/lib/python3.11/threading.py", line 1038 in _bootstrap_inner
  File "/usr/lib/python3.11/threading.py", line 995 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "/site-packages/torch/distributed/distributed_c10d.py", line 4000 in barrier
  File "<cell demo>", line 2 in demo
  File "{launch}/worker.py", line 90 in _call
  File "{launch}/worker.py", line 140 in main
  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 198 in _run_module_as_main
'''


def test_a_faulthandler_dump_reads_like_a_traceback_of_the_students_code():
    import linecache

    linecache.cache["<cell demo>"] = (30, None, ["def demo():\n", "    dist.barrier()\n"], "<cell demo>")
    launch_dir = os.path.dirname(stacks.__file__)
    text = stacks.readable(FAULTHANDLER_DUMP.format(launch=launch_dir))
    assert text.splitlines() == [
        '  File "<cell demo>", line 2, in demo',
        "    dist.barrier()",
        '  File "/site-packages/torch/distributed/distributed_c10d.py", line 4000, in barrier',
    ]
    assert stacks.readable("") == "(no Python stack came back)"


def test_a_cpu_unpickler_file_reads_like_bytesio():
    data = pickle.dumps({"a": list(range(1000)), "b": b"x" * 100000}, protocol=0)  # protocol 0 uses readline
    assert pickling.loads_pickle_on_cpu(data) == pickle.load(io.BytesIO(data))
