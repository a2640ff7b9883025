"""A launch's arguments, checked before any process starts, and the backend and GPUs the ranks get."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

BACKENDS = ("auto", "nccl", "gloo")

_said: set[str] = set()


def say_once(message: str) -> None:
    """Print a launcher notice once per session (not once per cell)."""
    if message not in _said:
        _said.add(message)
        print(f"course_utils.launch: {message}", flush=True)


def check_nproc(nproc: Any) -> int:
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer (the number of ranks), got {nproc!r}")
    return nproc


def check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds (or None for no limit), got {timeout!r}")
    return float(timeout)


def check_ranks(ranks: Iterable[int] | None, nproc: int) -> frozenset[int] | None:
    if ranks is None:
        return None
    chosen = frozenset(ranks)
    bad = sorted(r for r in chosen if not isinstance(r, int) or not 0 <= r < nproc)
    if bad:
        raise ValueError(f"ranks to show must be between 0 and {nproc - 1} (nproc={nproc}), got {bad}")
    return chosen


def pick_backend(backend: str = "auto", nproc: int = 2) -> str:
    """'auto' -> 'nccl' when there is one CUDA GPU per rank, else 'gloo' (saying so once).

    Counts GPUs with torch.cuda.device_count(), which asks NVML when it can, so the notebook's process
    does not create a CUDA context.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(map(repr, BACKENDS))}")
    nproc = check_nproc(nproc)
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count()
    if backend == "gloo":
        return "gloo"
    if backend == "nccl":
        if gpus < nproc or not dist.is_nccl_available():
            why = "this PyTorch build has no NCCL" if not dist.is_nccl_available() else (
                f"nproc={nproc} ranks but this machine has {gpus} CUDA GPU{'s' if gpus != 1 else ''}")
            raise ValueError(f"backend='nccl' needs one CUDA GPU per rank: {why}. "
                             "Use backend='gloo' (CPU) or 'auto', or lower nproc.")
        return "nccl"
    if gpus >= nproc and dist.is_nccl_available():
        return "nccl"
    if gpus == 0:
        say_once("no CUDA GPU here, so ranks run on the CPU with the gloo backend.")
    else:
        say_once(f"{nproc} ranks but {gpus} GPU{'s' if gpus != 1 else ''} (NCCL needs one per rank), "
                 "so ranks run on the CPU with the gloo backend.")
    return "gloo"


def pick_gpus(gpus: bool | None, backend: str) -> bool:
    """Whether the ranks see this machine's GPUs: NCCL ranks always (one each), gloo ranks only with gpus=True.

    Hiding them (CUDA_VISIBLE_DEVICES="") keeps a gloo lesson on a GPU box from opening one CUDA context per
    rank on GPU 0 as soon as anything touches CUDA, and makes the ranks' Timelines default to the host clock,
    which is what gloo's CPU work runs on.
    """
    if gpus is not None and not isinstance(gpus, bool):
        raise ValueError(f"gpus must be True, False or None (None: only NCCL ranks see GPUs), got {gpus!r}")
    if backend == "nccl":
        if gpus is False:
            raise ValueError("gpus=False with backend='nccl': NCCL ranks need their GPUs; use backend='gloo' "
                             "for ranks on the CPU")
        return True
    return bool(gpus)
