"""%%torchrun and %%ranks: run a notebook cell on N ranks. Loaded by `%load_ext course_utils`.

    %%torchrun -n 4                 the cell runs on 4 fresh ranks (torch, dist and os predefined)
    %%torchrun -n 4 --ranks 0       ... showing rank 0's output only
    %%torchrun -n 2 --cli           the same cell through the real torchrun CLI
    %%torchrun -n 2 --gpus          gloo ranks that may use the GPUs (NCCL ranks always do)
    %%ranks -n 4                    the cell runs on a Pool of 4 ranks kept alive: variables persist per rank
    %ranks                          which pool %%ranks uses;  %ranks --close ends it
"""

from __future__ import annotations

from IPython.core.magic import Magics, cell_magic, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .cli import run_cli
from .jobs import run_code
from .options import BACKENDS, pick_backend, pick_gpus
from .pool import Pool, current_pool


def _ranks(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--ranks takes comma-separated rank numbers such as 0,2; got {text!r}") from None


def _results(values: dict) -> dict | None:
    """A cell ending in an expression shows {rank: value}, like Out[] shows one value; otherwise nothing."""
    return values if any(v is not None for v in values.values()) else None


def _mismatch(pool: Pool, backend: str | None, gpus: bool | None) -> str | None:
    """What in the options differs from the open pool (None: it fits)."""
    wanted = backend or pool.backend
    if wanted == "auto":
        wanted = pick_backend("auto", pool.nproc)
    if wanted != pool.backend:
        return f"--backend {backend} (it runs {pool.backend})"
    if gpus is not None and pick_gpus(gpus, wanted) != pool.gpus:
        return f"--gpus (its ranks {'see' if pool.gpus else 'do not see'} the GPUs)"
    return None


@magics_class
class LaunchMagics(Magics):
    @magic_arguments()
    @argument("-n", "--nproc", type=int, default=2, help="number of ranks (default 2)")
    @argument("--backend", default="auto", choices=BACKENDS, help="auto: nccl with a GPU per rank, else gloo")
    @argument("--timeout", type=float, default=120.0, help="seconds before every rank is stopped (default 120)")
    @argument("--ranks", default=None, help="show only these ranks' output, e.g. 0,2")
    @argument("--gpus", action="store_true", default=None, help="let gloo ranks use the GPUs (NCCL ranks always do)")
    @argument("--cli", action="store_true", help="run the cell through the real torchrun CLI, as a script")
    @cell_magic
    def torchrun(self, line: str, cell: str):
        """Run this cell on N fresh ranks with torchrun's environment and an initialised process group."""
        __tracebackhide__ = True
        args = parse_argstring(self.torchrun, line)
        options = dict(nproc=args.nproc, backend=args.backend, timeout=args.timeout, ranks=_ranks(args.ranks),
                       gpus=args.gpus)
        if args.cli:
            run_cli(cell, **options)
            return None
        return _results(run_code(cell, **options))

    @magic_arguments()
    @argument("-n", "--nproc", type=int, default=None, help="pool size; starts a new pool if it differs")
    @argument("--backend", default=None, choices=BACKENDS, help="for a new pool (default auto)")
    @argument("--timeout", type=float, default=120.0, help="seconds this cell may run before the pool is stopped "
                                                           "(default 120)")
    @argument("--ranks", default=None, help="show only these ranks' output, e.g. 0,2")
    @argument("--gpus", action="store_true", default=None, help="for a new pool: let gloo ranks use the GPUs")
    @argument("--close", action="store_true", help="(line magic) end the current pool")
    @line_cell_magic
    def ranks(self, line: str, cell: str | None = None):
        """Run this cell on the current Pool's ranks; each rank keeps its variables between cells."""
        __tracebackhide__ = True
        args = parse_argstring(self.ranks, line)
        pool = current_pool()
        if cell is None:  # line magic: status, start or close
            if args.close:
                if pool is not None:
                    pool.close()
                    print(f"closed {pool!r}")
                else:
                    print("no pool is open")
                return None
            if args.nproc is None and args.backend is None and args.gpus is None:
                print(repr(pool) if pool else "no pool is open; %%ranks -n N starts one")
                return None
        if pool is not None and args.nproc is not None and args.nproc != pool.nproc:
            print(f"closing the {pool.nproc}-rank pool (its variables are gone) to start one of {args.nproc}")
            pool.close()
            pool = None
        if pool is not None:
            differs = _mismatch(pool, args.backend, args.gpus)
            if differs:
                raise ValueError(f"the open pool {pool!r} does not match {differs}. Its ranks keep their variables, "
                                 "so it is not replaced silently: end it with %ranks --close (its variables are "
                                 "lost), or drop the option to use it as it is.")
        if pool is None:
            pool = Pool(args.nproc or 2, backend=args.backend or "auto", timeout=args.timeout, gpus=args.gpus)
            print(f"started {pool!r}; its ranks keep their variables until %ranks --close")
        if cell is None:
            return None
        return _results(pool.exec(cell, timeout=args.timeout, ranks=_ranks(args.ranks)))


def load_ipython_extension(ipython) -> None:
    """Register %%torchrun and %%ranks (called by `%load_ext course_utils`)."""
    ipython.register_magics(LaunchMagics)
