"""ipywidgets views for the lessons: a stepper through an all-reduce schedule.

A *schedule* is data: a list of steps, each a list of transfers `(src, dst, chunk, kind)` that happen at the
same time; `kind` is "reduce" (dst adds the chunk it receives to its own) or "copy" (dst replaces its chunk).
The buffer is cut into `n_chunks` chunks (default: one per rank). The lesson defines the schedule function
(`ring_schedule(n)` and friends, in the notebook); this module only replays it:

    states = simulate(ring_schedule(4), n=4)        # states[k][rank][chunk]: contributions after k steps
    RingStepper(ring_schedule, n=4)                 # prev/next buttons and a slider over the steps
    RingStepper({"naive": naive_schedule, "ring": ring_schedule}, n=4)   # a menu to switch between schedules

A cell's contributions are counts per original rank: all ones means the full sum; a count above one means a
contribution was added twice (a bug the view marks in red).
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Transfer = tuple[int, int, int, str]
Schedule = Sequence[Sequence[Transfer]]
KINDS = ("reduce", "copy")


def _check_transfer(t: Any, k: int, n: int, n_chunks: int) -> Transfer:
    where = f"step {k + 1}, transfer {t!r}"
    if not isinstance(t, (tuple, list)) or len(t) != 4:
        raise ValueError(f"{where}: a transfer is (src, dst, chunk, kind), e.g. (0, 1, 3, 'reduce')")
    src, dst, chunk, kind = t
    for name, value, top in (("src", src, n), ("dst", dst, n), ("chunk", chunk, n_chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < top:
            raise ValueError(f"{where}: {name} must be an int in [0, {top}), got {value!r}")
    if src == dst:
        raise ValueError(f"{where}: a rank does not send to itself")
    if kind not in KINDS:
        raise ValueError(f"{where}: kind must be 'reduce' or 'copy', got {kind!r}")
    return (src, dst, chunk, kind)


def simulate(schedule: Schedule, n: int, n_chunks: int | None = None) -> list[list[list[tuple[int, ...]]]]:
    """Replay `schedule` on `n` ranks: states[k][rank][chunk] is the tuple of contribution counts (one per
    original rank) after the first k steps; states[0] is the start (each rank holds only its own data).

    All transfers of a step read the state before that step (they happen at the same time)."""
    n_chunks = n if n_chunks is None else n_chunks
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n (ranks) must be a positive int, got {n!r}")
    state = [[tuple(int(i == r) for i in range(n)) for _ in range(n_chunks)] for r in range(n)]
    states = [state]
    for k, step in enumerate(schedule):
        if not isinstance(step, (list, tuple)):
            raise ValueError(f"step {k + 1}: a step is a list of transfers, got {type(step).__name__}")
        before, after = state, [list(row) for row in state]
        for t in step:
            src, dst, chunk, kind = _check_transfer(t, k, n, n_chunks)
            sent = before[src][chunk]
            if kind == "copy":
                after[dst][chunk] = sent
            else:
                after[dst][chunk] = tuple(a + b for a, b in zip(after[dst][chunk], sent, strict=True))
        state = after
        states.append(state)
    return states


@dataclass(frozen=True)
class StepCost:
    """The alpha-beta terms a schedule has paid after some steps: `steps` latencies (alpha each) and
    `chunks` chunk-times (S / n_chunks / B each): per step, the most chunks one rank sends or receives."""

    steps: int
    chunks: int


def cost(schedule: Schedule, upto: int | None = None) -> StepCost:
    """Alpha-beta terms of the first `upto` steps (all by default): each step costs alpha plus the time to move
    the largest number of chunks that any one rank sends or receives in it."""
    steps = list(schedule)[:upto]
    chunks = 0
    for step in steps:
        load: dict[tuple[str, int], int] = {}
        for src, dst, _, _ in step:
            load[("out", src)] = load.get(("out", src), 0) + 1
            load[("in", dst)] = load.get(("in", dst), 0) + 1
        chunks += max(load.values(), default=0)
    return StepCost(steps=sum(1 for s in steps if s), chunks=chunks)


# --------------------------------------------------------------------------------------------- drawing

_LOW, _HIGH = (0xDE, 0xEB, 0xF7), (0x08, 0x51, 0x9C)  # light to dark blue: few to all contributions


def _colour(count: int, n: int) -> str:
    f = 0.0 if n <= 1 else (count - 1) / (n - 1)
    rgb = [round(a + (b - a) * f) for a, b in zip(_LOW, _HIGH, strict=True)]
    return "#" + "".join(f"{c:02x}" for c in rgb)


def _sources(counts: tuple[int, ...]) -> str:
    return " ".join(f"{r}" if c == 1 else f"{r}×{c}" for r, c in enumerate(counts) if c)


def render_html(state: list[list[tuple[int, ...]]], step: Sequence[Transfer] = (), sent: Sequence[int] = ()) -> str:
    """An HTML table: one row per rank, one cell per chunk, coloured by how many ranks' data the chunk holds.
    Cells written by `step` get a thick border; a chunk holding some rank's data twice is red."""
    n, n_chunks = len(state), len(state[0]) if state else 0
    written = {(dst, chunk): kind for _, dst, chunk, kind in step}
    head = "".join(f"<th style='padding:2px 8px'>chunk {c}</th>" for c in range(n_chunks))
    rows = []
    for r, row in enumerate(state):
        cells = []
        for c, counts in enumerate(row):
            distinct, twice = sum(1 for x in counts if x), any(x > 1 for x in counts)
            bg = "#d62728" if twice else _colour(distinct, n)
            fg = "white" if twice or distinct > (n + 1) / 2 else "black"
            border = "3px solid #ff7f0e" if (r, c) in written else "1px solid #999"
            mark = {"reduce": " +", "copy": " ="}.get(written.get((r, c), ""), "")
            tip = html.escape(f"rank {r}, chunk {c}: data of ranks {_sources(counts)}")
            cells.append(f"<td title='{tip}' style='background:{bg};color:{fg};border:{border};padding:4px 8px;"
                         f"text-align:center;font-family:monospace'>{distinct}/{n}{mark}</td>")
        extra = f"<td style='padding:2px 8px'>{sent[r]}</td>" if sent else ""
        rows.append(f"<tr><th style='padding:2px 8px'>rank {r}</th>{''.join(cells)}{extra}</tr>")
    sent_head = "<th style='padding:2px 8px'>chunks sent so far</th>" if sent else ""
    return (f"<table style='border-collapse:collapse'><tr><th></th>{head}{sent_head}</tr>{''.join(rows)}</table>")


def render_text(state: list[list[tuple[int, ...]]]) -> str:
    """The same grid as text: contributions held, per rank and chunk ('!' where some data was added twice)."""
    n = len(state)
    lines = []
    for r, row in enumerate(state):
        cells = [f"{sum(1 for x in c if x)}/{n}{'!' if any(x > 1 for x in c) else ' '}" for c in row]
        lines.append(f"rank {r}: " + " ".join(f"{c:>6}" for c in cells))
    return "\n".join(lines)


def describe_step(step: Sequence[Transfer]) -> str:
    """One line per step: who sends which chunk to whom, and whether the receiver adds or replaces it."""
    if not step:
        return "nothing moves"
    verb = {"reduce": "adds", "copy": "copies"}
    return "; ".join(f"rank {s} → rank {d}: chunk {c} ({d} {verb[k]} it)" for s, d, c, k in step)


class RingStepper:
    """Step through an all-reduce schedule: prev/next buttons, a step slider, a rank-count slider, and (when given
    several schedules) a menu. The grid shows, per rank and chunk, how many ranks' data the chunk holds.

    `schedule`: a function n -> list of steps (see the module docstring), or a dict name -> such function.
    """

    def __init__(self, schedule: Callable[[int], Schedule] | dict[str, Callable[[int], Schedule]], n: int = 4,
                 n_chunks: Callable[[int], int] | None = None, max_n: int = 8):
        import ipywidgets as w

        self.schedules = dict(schedule) if isinstance(schedule, dict) else {getattr(schedule, "__name__",
                                                                                    "schedule"): schedule}
        if not self.schedules or not all(callable(f) for f in self.schedules.values()):
            raise TypeError("schedule must be a function n -> list of steps, or a dict name -> such function")
        self.n_chunks = n_chunks or (lambda k: k)
        self.menu = w.Dropdown(options=list(self.schedules), description="schedule")
        self.n_slider = w.IntSlider(value=n, min=2, max=max(max_n, n), description="ranks")
        self.prev_button = w.Button(description="◀ prev", layout=w.Layout(width="90px"))
        self.next_button = w.Button(description="next ▶", layout=w.Layout(width="90px"))
        self.step_slider = w.IntSlider(value=0, min=0, max=0, description="step")
        self.caption = w.HTML()
        self.grid = w.HTML()
        self.prev_button.on_click(lambda _: self.prev())
        self.next_button.on_click(lambda _: self.next())
        self.step_slider.observe(lambda _: self._draw(), names="value")
        self.n_slider.observe(lambda _: self._load(), names="value")
        self.menu.observe(lambda _: self._load(), names="value")
        top = [self.menu] if len(self.schedules) > 1 else []
        self.widget = w.VBox(top + [self.n_slider, w.HBox([self.prev_button, self.next_button, self.step_slider]),
                                    self.caption, self.grid])
        self._load()

    # -- state ------------------------------------------------------------------------------------------------

    @property
    def n(self) -> int:
        return self.n_slider.value

    @property
    def step(self) -> int:
        """How many steps have been applied (0: the start)."""
        return self.step_slider.value

    @property
    def state(self) -> list[list[tuple[int, ...]]]:
        return self.states[self.step]

    def _load(self) -> None:
        n = self.n
        self.steps = [list(s) for s in self.schedules[self.menu.value](n)]
        self.states = simulate(self.steps, n, self.n_chunks(n))
        self.step_slider.max = len(self.steps)  # may clamp value, which redraws
        self.step_slider.value = 0
        self._draw()

    def go(self, k: int) -> None:
        self.step_slider.value = max(0, min(len(self.steps), k))

    def next(self) -> None:
        self.go(self.step + 1)

    def prev(self) -> None:
        self.go(self.step - 1)

    # -- view -------------------------------------------------------------------------------------------------

    def _sent(self, k: int) -> list[int]:
        sent = [0] * self.n
        for step in self.steps[:k]:
            for src, _, _, _ in step:
                sent[src] += 1
        return sent

    def caption_text(self) -> str:
        k, total = self.step, len(self.steps)
        paid = cost(self.steps, k)
        done = all(all(x == 1 for x in c) for row in self.state for c in row)
        twice = any(any(x > 1 for x in c) for row in self.state for c in row)
        status = ("every chunk on every rank holds the full sum" if done else
                  "some data was added twice" if twice else "not done yet")
        what = describe_step(self.steps[k - 1]) if k else "the start: each rank holds only its own data"
        chunks = self.n_chunks(self.n)
        return (f"step {k} of {total}: {what}. Cost so far: {paid.steps} × alpha + {paid.chunks} × (S/{chunks})/B. "
                f"{status.capitalize()}.")

    def _draw(self) -> None:
        k = self.step
        self.caption.value = f"<p>{html.escape(self.caption_text())}</p>"
        self.grid.value = render_html(self.state, self.steps[k - 1] if k else (), self._sent(k))
        self.prev_button.disabled = k == 0
        self.next_button.disabled = k == len(self.steps)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = self.widget._repr_mimebundle_(**kwargs) or {}
        bundle = dict(bundle) if isinstance(bundle, dict) else {}
        bundle["text/plain"] = f"{self.caption_text()}\n{render_text(self.state)}"
        return bundle

    def __repr__(self) -> str:
        return f"RingStepper({self.menu.value}, n={self.n}, step {self.step} of {len(self.steps)})"
