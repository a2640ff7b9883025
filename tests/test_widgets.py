"""course_utils.widgets: the schedule replay (simulate, cost) and the RingStepper widget, driven by its buttons.

The schedules are written here, independently of lesson 07's notebook (which defines its own)."""

from __future__ import annotations

import math

import pytest

from course_utils import widgets


def ring(n: int) -> list[list[tuple]]:
    """Reduce-scatter then all-gather around the ring 0 -> 1 -> ... -> n-1 -> 0."""
    rs = [[(r, (r + 1) % n, (r - s) % n, "reduce") for r in range(n)] for s in range(n - 1)]
    ag = [[(r, (r + 1) % n, (r + 1 - s) % n, "copy") for r in range(n)] for s in range(n - 1)]
    return rs + ag


def naive(n: int) -> list[list[tuple]]:
    """Every rank sends its whole buffer to rank 0 in turn; rank 0 sends the sum back to each in turn."""
    up = [[(src, 0, c, "reduce") for c in range(n)] for src in range(1, n)]
    down = [[(0, dst, c, "copy") for c in range(n)] for dst in range(1, n)]
    return up + down


def tree(n: int) -> list[list[tuple]]:
    levels = math.ceil(math.log2(n))
    up = [[(r, r - (1 << k), c, "reduce") for r in range(n) if r % (2 << k) == 1 << k for c in range(n)]
          for k in range(levels)]
    down = [[(r - (1 << k), r, c, "copy") for r in range(n) if r % (2 << k) == 1 << k for c in range(n)]
            for k in reversed(range(levels))]
    return up + down


def complete(state) -> bool:
    return all(all(x == 1 for x in chunk) for row in state for chunk in row)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("schedule", [ring, naive, tree])
def test_correct_schedules_end_with_the_full_sum_everywhere(schedule, n):
    states = widgets.simulate(schedule(n), n)
    assert len(states) == len(schedule(n)) + 1
    assert not complete(states[0]) and complete(states[-1])
    assert states[0][1][0] == tuple(int(i == 1) for i in range(n))  # rank 1 starts with only its own data


def test_after_the_reduce_scatter_each_rank_owns_one_full_chunk():
    n = 5
    state = widgets.simulate(ring(n), n)[n - 1]
    for r in range(n):
        full = [c for c in range(n) if state[r][c] == (1,) * n]
        assert full == [(r + 1) % n]


def test_transfers_of_a_step_read_the_state_before_it():
    # 0 -> 1 and 1 -> 2 in one step: rank 2 gets rank 1's own data, not what rank 1 receives in the same step
    states = widgets.simulate([[(0, 1, 0, "reduce"), (1, 2, 0, "reduce")]], 3, n_chunks=1)
    assert states[1][1][0] == (1, 1, 0) and states[1][2][0] == (0, 1, 1)


def test_a_contribution_added_twice_is_counted_twice():
    states = widgets.simulate([[(0, 1, 0, "reduce")], [(0, 1, 0, "reduce")]], 2, n_chunks=1)
    assert states[-1][1][0] == (2, 1)
    assert "2/2!" in widgets.render_text(states[-1])
    assert "#d62728" in widgets.render_html(states[-1])  # drawn red


@pytest.mark.parametrize("step, words", [
    ([(0, 1, 0)], "a transfer is"),
    ([(0, 4, 0, "reduce")], "dst must be an int in"),
    ([(0, 1, 9, "reduce")], "chunk must be an int in"),
    ([(1, 1, 0, "reduce")], "does not send to itself"),
    ([(0, 1, 0, "add")], "kind must be"),
    ([(0, 1.0, 0, "copy")], "dst must be an int"),
])
def test_bad_transfers_are_clear_errors(step, words):
    with pytest.raises(ValueError, match=words):
        widgets.simulate([[], step], 3)
    with pytest.raises(ValueError, match="step 1: a step is a list"):
        widgets.simulate(["oops"], 3)


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8])
def test_cost_matches_the_alpha_beta_formulas(n):
    levels = math.ceil(math.log2(n))
    assert widgets.cost(ring(n)) == widgets.StepCost(steps=2 * (n - 1), chunks=2 * (n - 1))  # chunks of S/n
    assert widgets.cost(naive(n)) == widgets.StepCost(steps=2 * (n - 1), chunks=2 * (n - 1) * n)  # whole buffers
    assert widgets.cost(tree(n)) == widgets.StepCost(steps=2 * levels, chunks=2 * levels * n)
    assert widgets.cost(ring(n), upto=1) == widgets.StepCost(steps=1, chunks=1)


def test_cost_counts_what_one_rank_receives_too():
    # three ranks send to rank 0 at once: rank 0 receives three chunks in that step
    assert widgets.cost([[(1, 0, 0, "reduce"), (2, 0, 0, "reduce"), (3, 0, 0, "reduce")]]).chunks == 3


# ------------------------------------------------------------------------------------------ the widget


def test_stepper_buttons_move_through_the_steps_and_change_the_view():
    s = widgets.RingStepper(ring, n=4)
    assert s.step == 0 and s.prev_button.disabled and not s.next_button.disabled
    start_grid, start_caption = s.grid.value, s.caption.value
    assert "step 0 of 6" in start_caption and "1/4" in start_grid and "4/4" not in start_grid
    s.next_button.click()
    assert s.step == 1 and s.grid.value != start_grid and "step 1 of 6" in s.caption.value
    assert "rank 0 → rank 1: chunk 0" in s.caption.value and "2/4 +" in s.grid.value
    for _ in range(10):  # past the end: stays on the last step
        s.next_button.click()
    assert s.step == 6 and s.next_button.disabled
    assert s.grid.value.count("4/4") == 16 and "full sum" in s.caption.value
    assert "12 × alpha" not in s.caption.value and "6 × alpha + 6 × (S/4)/B" in s.caption.value
    s.prev_button.click()
    assert s.step == 5 and not s.next_button.disabled and "full sum" not in s.caption.value
    s.step_slider.value = 0
    assert s.grid.value == start_grid and s.caption.value == start_caption


def test_stepper_shows_chunks_sent_per_rank():
    s = widgets.RingStepper(ring, n=3)
    s.go(4)
    assert "chunks sent so far" in s.grid.value and s._sent(4) == [4, 4, 4]


def test_stepper_follows_the_rank_slider_and_the_menu():
    s = widgets.RingStepper({"ring": ring, "naive": naive, "tree": tree}, n=4)
    s.go(3)
    s.n_slider.value = 5
    assert s.step == 0 and s.step_slider.max == 8 and s.grid.value.count("<tr>") == 6  # header + 5 ranks
    s.menu.value = "tree"
    assert s.step_slider.max == 6  # 2 x ceil(log2 5)
    s.go(6)
    assert complete(s.state) and "full sum" in s.caption.value


def test_stepper_shows_a_broken_schedule_as_broken():
    def lossy(n):  # the all-gather replaced by reduces: data is added twice
        return [[(a, b, c, "reduce") for a, b, c, _ in step] for step in ring(n)]

    s = widgets.RingStepper(lossy, n=3)
    s.go(len(s.steps))
    assert "added twice" in s.caption.value and "#d62728" in s.grid.value


def test_stepper_text_form_for_frontends_without_widgets():
    s = widgets.RingStepper(ring, n=2)
    s.next()
    bundle = s._repr_mimebundle_()
    assert "step 1 of 2" in bundle["text/plain"] and "rank 1:" in bundle["text/plain"]
    assert "RingStepper(ring, n=2, step 1 of 2)" == repr(s)


def test_stepper_refuses_what_is_not_a_schedule_function():
    with pytest.raises(TypeError, match="schedule must be"):
        widgets.RingStepper([[(0, 1, 0, "copy")]], n=2)
