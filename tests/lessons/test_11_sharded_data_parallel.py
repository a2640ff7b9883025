"""Lesson 11 (sharded data parallel): both exercises' judges on plain data, the memory model on the ZeRO paper's
numbers, and the exercises against the master's solutions and every wrong answer (all on the CPU, gloo ranks for
ShardedAdam). The master's ShardedAdam goes through the whole check (world sizes 2 and 3); each wrong answer
through the check at one world size (ADAM_WORLDS), which is enough to fail it at a fraction of the CPU time."""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import functools
import json
import random
import re
from pathlib import Path

import pytest
import torch

from course_utils import checks, launch
from course_utils.checks import sharded_data_parallel as c11
from course_utils.grading import release
from tests.exercise_cells import run_in_process

pytestmark = pytest.mark.ranks

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "11_sharded_data_parallel.ipynb"
STEM = NOTEBOOK.stem
WRONG = ROOT / "tests" / "wrong_answers" / STEM
MEM, ADAM = "ex11_memory_model", "ex11_sharded_adam"


@pytest.fixture(scope="module")
def notebook() -> dict:
    return json.loads(NOTEBOOK.read_text())


def code_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def setup_cells(nb: dict) -> list[str]:
    return ["".join(c["source"]) for c in code_cells(nb) if "setup" in c["metadata"].get("tags", [])]


def exercise_program(nb: dict, ex: str, wrong: str | None) -> list[str]:
    """Setup cells, the exercise's solution cell (with `wrong` in place of its blocks) and its check cell."""
    if wrong is not None:
        import nbformat

        nb = json.loads(nbformat.writes(release.substitute(nbformat.reads(json.dumps(nb), as_version=4),
                                                           {ex: wrong}, STEM)))
    cells = code_cells(nb)
    grade = [c["metadata"].get("nbgrader", {}).get("grade_id") for c in cells]
    return setup_cells(nb) + ["".join(cells[grade.index(f"{ex}_solution")]["source"]),
                              "".join(cells[grade.index(ex)]["source"])]


run_here = functools.partial(run_in_process, module="__lesson11__")


def wrong(ex: str) -> list[Path]:
    return sorted(WRONG.glob(f"{ex}*.py"))


def master_namespace(nb: dict, ex: str) -> dict:
    """The setup cells and the master's solution cell of `ex`, run here."""
    ns: dict = {"__name__": "__lesson11__"}
    for src in exercise_program(nb, ex, None)[:-1]:
        exec(src, ns)
    return ns


# ------------------------------------------------------------------------------ the notebook's cells


def test_both_exercises_are_gradeable_on_a_cpu():
    for ex, entry in ((MEM, "bytes_per_rank"), (ADAM, "ShardedAdam")):
        assert checks.exercise(ex).entry == entry and not checks.exercise(ex).needs_gpu


def test_the_student_versions_stubs_raise_not_implemented(notebook):
    student = release.student_version(__import__("nbformat").reads(json.dumps(notebook), as_version=4), STEM)
    src = {c.get("metadata", {}).get("nbgrader", {}).get("grade_id"): c.source for c in student.cells}
    ns: dict = {}
    exec(compile("\n".join(setup_cells(notebook)) + "\n" + src[f"{MEM}_solution"] + "\n" + src[f"{ADAM}_solution"],
                 "<student>", "exec"), ns)  # the function and the class still define ...
    with pytest.raises(NotImplementedError):  # ... and only using them says "not written yet"
        ns["bytes_per_rank"](1000, 4, "zero1")
    with pytest.raises(NotImplementedError):
        ns["ShardedAdam"]([torch.nn.Parameter(torch.zeros(3))], lr=1e-2)


def test_no_solution_in_course_utils():
    for path in (ROOT / "course_utils").rglob("*.py"):
        text = path.read_text()
        assert "class ShardedAdam" not in text and "def bytes_per_rank" not in text, path


# ------------------------------------------------------------------------------ ex11_memory_model (CPU)


PSI, N = 7_500_000_000, 64  # the ZeRO paper's Figure 1: 7.5B parameters on 64 GPUs, K = 12


@pytest.mark.parametrize("method,total", [
    ("ddp", 16 * PSI),                                     # (2 + 2 + K) Ψ = 120 GB
    ("zero1", 4 * PSI + 12 * PSI // N),                    # 4Ψ + KΨ/N = 31.4 GB
    ("zero2", 2 * PSI + (2 + 12) * PSI // N),              # 2Ψ + (2 + K)Ψ/N = 16.6 GB
    ("zero3", (2 + 2 + 12) * PSI // N),                    # (2 + 2 + K)Ψ/N = 1.9 GB
])
def test_model_bytes_gives_the_zero_papers_numbers(method, total):
    got = c11.model_bytes(PSI, N, method, True)
    assert sum(got.values()) == total
    assert round(total / 1e9, 1) == {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}[method]


def test_model_bytes_on_hand_worked_cases():
    # fp32: 4 + 4 + 8 bytes per parameter; 10 values over 3 ranks: the fullest rank holds 4 (padded to 12)
    assert c11.model_bytes(10, 3, "ddp", False) == {"params": 40, "grads": 40, "optimizer": 80}
    assert c11.model_bytes(10, 3, "zero1", False) == {"params": 40, "grads": 40, "optimizer": 32}
    assert c11.model_bytes(10, 3, "zero2", False) == {"params": 40, "grads": 16, "optimizer": 32}
    assert c11.model_bytes(10, 3, "zero3", False) == {"params": 16, "grads": 16, "optimizer": 32}
    # mixed precision: 2 + 2 + 12; 1001 values over 8 ranks: 126 each
    assert c11.model_bytes(1001, 8, "zero3", True) == {"params": 252, "grads": 252, "optimizer": 1512}
    assert c11.model_bytes(1000, 4, "zero1", True) == {"params": 2000, "grads": 2000, "optimizer": 3000}
    # more ranks than values: one value each; one rank: nothing to shard
    assert c11.model_bytes(3, 8, "zero3", False) == {"params": 4, "grads": 4, "optimizer": 8}
    for method in c11.METHODS:
        assert c11.model_bytes(1000, 1, method, True) == c11.model_bytes(1000, 1, "ddp", True)


def test_master_memory_model_agrees_with_the_model(notebook):
    answer = master_namespace(notebook, MEM)["bytes_per_rank"]
    rng = random.Random(11)
    for _ in range(500):
        case = (rng.randrange(1, 10**12), rng.randrange(1, 4097), rng.choice(c11.METHODS), rng.random() < 0.5)
        assert answer(*case) == c11.model_bytes(*case), case


def test_memory_inputs_are_fresh_and_plain():
    a, b = c11.memory_inputs(), c11.memory_inputs()
    assert a != b and len(a["cases"]) == len(c11.FIXED_MEMORY) + 12
    assert c11.memory_inputs(seed=4) == c11.memory_inputs(seed=4)
    assert checks.plain(a) == checks.plain(checks.plain(a))


def test_memory_judge_on_plain_data():
    inputs = checks.plain(c11.memory_inputs(seed=3))
    cases = inputs["cases"]
    right = [c11.model_bytes(*c) for c in cases]
    assert "DDP and ZeRO-1/2/3" in c11.memory_judge(inputs, {"answers": right})
    i = next(i for i, c in enumerate(cases) if c[2] == "zero2")
    off = copy.deepcopy(right)
    off[i]["grads"] += 4
    call = re.escape(c11._call(cases[i]))
    with pytest.raises(checks.CheckFailed, match=rf"expected [\d,]+ bytes of grads per rank from {call}, saw"):
        c11.memory_judge(inputs, {"answers": off})
    with pytest.raises(checks.CheckFailed, match=rf"keys 'params', 'grads' and 'optimizer' from {call}"):
        c11.memory_judge(inputs, {"answers": right[:i] + [{"params": 1, "grads": 1}] + right[i + 1:]})
    with pytest.raises(checks.CheckFailed, match=rf"from {call}, saw 1.5"):
        c11.memory_judge(inputs, {"answers": right[:i] + [{**right[i], "params": "1.5"}] + right[i + 1:]})
    with pytest.raises(checks.CheckFailed, match="one answer per case"):
        c11.memory_judge(inputs, {"answers": right[:-1]})


def test_memory_probe_keeps_ints_and_describes_the_rest():
    class Sub(dict):
        pass

    answers = iter([{"params": 8.0, "grads": 2.5, "optimizer": True, 3: 1}, Sub(params=1), [1, 2, 3]])
    data = c11.memory_probe(lambda *a: next(answers), {"cases": [[10, 2, "ddp", False]] * 3})["answers"]
    assert data[0] == {"params": 8, "grads": "2.5", "optimizer": "True"}  # a whole float is a count; a bool is not
    assert "Sub, not a dict" in data[1] and "list, not a dict" in data[2]


def test_memory_master_passes(notebook):
    text, error = run_here(exercise_program(notebook, MEM, None))
    assert error is None and checks.PASS_MARKER in text, text


CALL = r"per rank from bytes_per_rank\(\d+, \d+, '(ddp|zero[123])', mixed_precision=(True|False)\)"
MEMORY_WRONG = {  # wrong answer -> what the check must say about it (the cases are shuffled: the first that fails)
    MEM: CALL + r", saw [\d,.]+\.",                                            # a float share of the values
    f"{MEM}__floor": CALL + r", saw [\d,]+\. Hint: \d+ values over \d+ ranks",
    f"{MEM}__zero2_shards_params": r"bytes of params per rank from bytes_per_rank\(\d+, \d+, 'zero2'",
    f"{MEM}__mixed_k8": r"bytes of optimizer per rank from bytes_per_rank\(\d+, \d+, '\w+', mixed_precision=True\)",
    f"{MEM}__zero1_shards_grads": r"bytes of grads per rank from bytes_per_rank\(\d+, \d+, 'zero1'",
    f"{MEM}__ddp_sharded": r"bytes of params per rank from bytes_per_rank\(\d+, \d+, 'ddp'",
    f"{MEM}__equal_to_anything": CALL + r", saw a __lesson11__\.bytes_per_rank\.<locals>\.Anything",
}


def test_every_memory_wrong_answer_has_an_expected_verdict():
    assert {p.stem for p in wrong(MEM)} == set(MEMORY_WRONG)


@pytest.mark.parametrize("stem", sorted(MEMORY_WRONG))
def test_memory_wrong_answers_fail(notebook, stem):
    text, error = run_here(exercise_program(notebook, MEM, (WRONG / f"{stem}.py").read_text()))
    assert error == "CheckFailed", text
    assert re.search(MEMORY_WRONG[stem], text), text


# ------------------------------------------------------------------------------ ex11_sharded_adam: the model


def test_check_net_has_the_traps():
    model = c11.build_model(1)
    assert not any(p.requires_grad for p in model.frozen.parameters())
    # trainable values: 37*131 + 131 + 131*101 = 18,209 in the first group, 101 + 101*13 + 13 = 1,427 in the second
    assert c11.shard_values(3, False) == 6_546  # 19,636 = 3 * 6,545 + 1: a remainder at 3 ranks, and ...
    assert c11.shard_values(3, True) == 6_070 + 476 == 6_546  # ... in each group (18,209 and 1,427 leave 2)
    assert c11.shard_values(2, True) == 9_105 + 714  # both groups are odd: the last rank's shards are padded
    assert c11.shard_values(5, False) == 3_928  # 19,636 = 5 * 3,927 + 1
    assert all(n % 3 for n in (19_636, 18_209, 1_427))
    grouped = c11.groups_of(model, True)
    assert any(p is model.frozen.weight for p in grouped[1]["params"])
    assert {k: grouped[1][k] for k in c11.GROUP_B} == c11.GROUP_B


# ------------------------------------------------------------------------------ ex11_sharded_adam: the judge


OPS = {"c10d::_reduce_scatter_base_": 3, "c10d::_allgather_base_": 3}
ADAM_INPUTS = {"seed": 7, "worlds": [3], "timeout_s": 120.0}
NAMES = [n for n, _ in c11.build_model(0).named_parameters()]


@functools.cache
def _reference(grouped: bool, steps: int) -> list[torch.Tensor]:
    return c11.reference_params(ADAM_INPUTS["seed"], grouped, 3, steps)


def perfect_adam_data() -> dict:
    """What the probe returns for a right answer at 3 ranks, made here without launching anything."""
    cases = [{"params": _reference(False, c11.STEPS), "first": _reference(False, 1), "ops": dict(OPS)},
             {"params": _reference(True, c11.STEPS), "first": _reference(True, 1), "ops": dict(OPS),
              "kept_bytes": 16 * 6_546, "heap_bytes": 1_000}]
    return {"worlds": {"3": [copy.deepcopy(cases) for _ in range(3)]}}


def test_adam_judge_passes_the_right_data():
    assert "states sharded" in c11.adam_judge(ADAM_INPUTS, perfect_adam_data())


def _nudge(key: str, name: str, by: float = 0.01, index: slice | int = slice(None)):
    def fn(case):
        case[key][NAMES.index(name)][index] += by
    return fn


def _unchanged_last_value(case):
    start = c11.build_model(ADAM_INPUTS["seed"]).out.bias.detach()
    case["first"][NAMES.index("out.bias")][-1] = start[-1]


@pytest.mark.parametrize("ranks,grouped,fn,words", [
    ((0,), 0, lambda c: c["ops"].update({"c10d::allreduce_": 1}),
     r"only reduce-scatter and all-gather \(or send/recv\) in step\(\) on rank 0 of 3 gloo ranks \(model\.param"),
    ((1,), 1, lambda c: c["ops"].clear(), r"collectives in step\(\) on rank 1 of 3 gloo ranks, saw none"),
    ((2,), 0, _nudge("first", "frozen.weight"),
     r"`frozen\.weight` on rank 2 of 3 gloo ranks, after 1 step .* saw a frozen parameter .* leave out"),
    ((0, 1, 2), 1, _nudge("first", "mid.bias"), r"`mid\.bias` on rank 0 .*two parameter groups.*its own lr, betas"),
    ((0, 1, 2), 0, _unchanged_last_value, r"`out\.bias` .* saw 1 of its 13 values not changed .* past N \* \(n // N\)"),
    ((1,), 0, _nudge("params", "mid.weight", index=0), r"`mid\.weight` on rank 1 of 3 gloo ranks, after 3 steps "
     r".*saw off by up to 0\.01\. Hint: the ranks disagree"),
    ((2,), 1, lambda c: c.update(heap_bytes=c["heap_bytes"] + 16 * 1024), r"at most 121,120 bytes kept by your "
     r"optimizer on rank 2 of 3 gloo ranks .* saw 122,120 bytes \(104,736 in tensors, 17,384 on Python's heap"),
])
def test_adam_judge_fails(ranks, grouped, fn, words):
    data = perfect_adam_data()
    for rank in ranks:  # one rank: the ranks disagree; every rank: they agree on a mistake
        fn(data["worlds"]["3"][rank][grouped])
    with pytest.raises(checks.CheckFailed, match=words):
        c11.adam_judge(ADAM_INPUTS, data)


def test_adam_judge_reports_a_probe_error_and_malformed_data():
    with pytest.raises(checks.CheckFailed, match="ShardedAdam to run on gloo ranks, saw at world size 3, rank 1"):
        c11.adam_judge(ADAM_INPUTS, {"error": "at world size 3, rank 1: RuntimeError: boom"})
    with pytest.raises(checks.CheckFailed, match=re.escape("results at world sizes [3]")):
        c11.adam_judge(ADAM_INPUTS, {"worlds": {"2": []}})
    with pytest.raises(checks.CheckFailed, match="two cases from each of 3 ranks"):
        c11.adam_judge(ADAM_INPUTS, {"worlds": {"3": perfect_adam_data()["worlds"]["3"][:2]}})


def test_adam_probe_says_not_attempted_for_the_stub():
    class Stub:
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
            raise NotImplementedError()

    Stub.__module__ = "__lesson11__"  # shipped by value, as a notebook's class is
    with pytest.raises(NotImplementedError):
        c11.adam_probe(Stub, checks.plain({**c11.adam_inputs(seed=2), "worlds": [2], "gpu": False}))


# ------------------------------------------------------------------------------ ex11_sharded_adam end to end


def test_adam_master_passes_the_whole_check(notebook):
    assert c11.adam_inputs()["worlds"] == [2, 3]
    text, error = run_here(exercise_program(notebook, ADAM, None))
    assert error is None and checks.PASS_MARKER in text and "world sizes [2, 3]" in text, text


@contextlib.contextmanager
def adam_check_at(worlds: list[int]):
    """ex11_sharded_adam's check, in this process, at these world sizes only (the whole check, at 2 and 3, takes
    about 20 s on two cores)."""
    ex = checks.exercise(ADAM)
    checks._REGISTRY[ADAM] = dataclasses.replace(ex, inputs=lambda: {**c11.adam_inputs(), "worlds": worlds})
    try:
        yield
    finally:
        checks._REGISTRY[ADAM] = ex


ADAM_WRONG = {  # wrong answer -> what the check must say about it, at the world size ADAM_WORLDS gives
    ADAM: r"at most 121,120 bytes kept by your optimizer on rank 0 of 3 gloo ranks .* saw 15\d,\d{3} bytes",
    f"{ADAM}__python_floats": r"bytes kept by your optimizer on rank 0 of 3 gloo ranks .* \(0 in tensors, "
                              r"1,\d{3},\d{3} on Python's heap from your code\)",
    f"{ADAM}__global_states": r"bytes kept by your optimizer on rank 0 of 3 gloo ranks .* \(15\d,\d{3} in tensors",
    f"{ADAM}__all_reduce": r"only reduce-scatter and all-gather \(or send/recv\) in step\(\) on rank 0 of 2 gloo "
                           r"ranks \(model\.parameters\(\)\), saw c10d::allreduce_ x3",
    f"{ADAM}__drops_remainder": r"`mid\.weight` on rank 0 of 2 gloo ranks, after 1 step with two parameter groups "
                                r".*saw 1 of its 13,231 values not changed",
    f"{ADAM}__off_by_one": r"`inp\.weight` on rank 0 of 2 gloo ranks, after 1 step with model\.parameters\(\).* "
                           r"saw off by up to",
    f"{ADAM}__no_all_gather": r"on rank 0 of 2 gloo ranks, after 1 step with model\.parameters\(\).* values not "
                              r"changed by the steps\. Hint: the ranks disagree",
    f"{ADAM}__no_division": r"`(inp|mid|out)\.(weight|bias)` on rank 0 of 2 gloo ranks, after \d steps? with .*saw "
                            r"off by up to",
    f"{ADAM}__frozen_updated": r"`frozen\.weight` on rank 0 of 2 gloo ranks, after 1 step with two parameter groups"
                               r".*saw a frozen parameter \(requires_grad=False\) that changed",
    f"{ADAM}__ignores_groups": r"`(mid\.bias|out\.weight|out\.bias)` on rank 0 of 2 gloo ranks, after 1 step with "
                               r"two parameter groups.*Hint: the second group has its own lr",
}
# The world size each wrong answer is checked at. The whole check (2 and 3) costs about 19 s of CPU on two
# cores, 3 ranks about 13 s, 2 ranks about 6 s. So 3, where the bytes are counted, for the answers that keep too
# much; 2 for those that get the parameters or the collectives wrong (at 3 ranks they fail too, the same way:
# every total leaves a remainder at both sizes, see test_check_net_has_the_traps).
ADAM_WORLDS = {stem: 3 if stem in (ADAM, f"{ADAM}__python_floats", f"{ADAM}__global_states") else 2
               for stem in ADAM_WRONG}


def test_every_adam_wrong_answer_has_an_expected_verdict():
    assert {p.stem for p in wrong(ADAM)} == set(ADAM_WRONG)
    for world in (2, 3):  # shards padded at both world sizes: dropping the remainder shows at either
        assert c11.shard_values(world, True) * world > 19_636


@pytest.mark.parametrize("stem", sorted(ADAM_WRONG))
def test_adam_wrong_answers_fail(notebook, stem):
    with adam_check_at([ADAM_WORLDS[stem]]):
        text, error = run_here(exercise_program(notebook, ADAM, (WRONG / f"{stem}.py").read_text()))
    assert error == "CheckFailed", text
    assert re.search(ADAM_WRONG[stem], text), text


# ------------------------------------------------------------------------------ the facts the prose states, on gloo


def definitions(nb: dict) -> dict:
    """The notebook's setup cells, its solutions, then its functions, classes, imports and plain assignments (no
    other cell's calls: nothing here starts a pool)."""
    ns: dict = {"__name__": "__lesson11__"}
    for c in code_cells(nb):
        src = "".join(c["source"])
        if "setup" in c["metadata"].get("tags", []) or c["metadata"].get("nbgrader", {}).get("solution"):
            exec(compile(src, "<setup>", "exec"), ns)
            continue
        tree = ast.parse(src)
        keep = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom))
                or (isinstance(n, ast.Assign) and all(isinstance(t, ast.Name) for t in n.targets)
                    and not any(isinstance(x, (ast.Call, ast.Subscript, ast.comprehension))
                                for x in ast.walk(n.value)))]
        exec(compile(ast.Module(body=keep, type_ignores=[]), "<notebook>", "exec"), ns)
    return ns


def _every_method(train, census, methods: list[str]) -> dict:
    """On each rank: what the notebook's `train` and `collectives_of_a_step` give for every method."""
    return {m: {"train": train(m), "census": census(m)} for m in methods}


@pytest.fixture(scope="module")
def methods_on_gloo(notebook):
    import os

    ns = definitions(notebook)
    saved = os.environ.get("TORCH_FR_BUFFER_SIZE")
    os.environ["TORCH_FR_BUFFER_SIZE"] = "20000"  # as the notebook's imports cell sets it for its pool
    try:
        ranks = launch.run(_every_method, ns["train"], ns["collectives_of_a_step"], list(ns["METHODS"]), nproc=2,
                           backend="gloo", timeout=600)
    finally:
        if saved is None:
            os.environ.pop("TORCH_FR_BUFFER_SIZE")
        else:
            os.environ["TORCH_FR_BUFFER_SIZE"] = saved
    return ns, [ranks[r] for r in range(2)]


def test_every_method_gives_one_process_parameters_bit_for_bit_on_two_ranks(methods_on_gloo):
    ns, ranks = methods_on_gloo
    for m in ns["METHODS"]:
        assert all(r[m]["train"]["max_diff"] == 0.0 for r in ranks), m  # the notebook prints "(bit for bit)"


def test_bytes_held_are_the_models_and_adams_step_counts(methods_on_gloo):
    """Section 1 and 4's sentences: 4 + 4 + 8 bytes per parameter, plus a 4-byte step count per parameter tensor;
    FSDP2 holds ZeRO-3's shares; ZeroRedundancyOptimizer's states are split by whole parameters."""
    ns, ranks = methods_on_gloo
    psi = sum(p.numel() for p in ns["make_model"]().parameters())
    tensors = len(list(ns["make_model"]().parameters()))
    ddp = ranks[0]["ddp"]["train"]["held"]
    assert ddp == {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi + 4 * tensors}
    for r in ranks:
        fsdp = r["fsdp2"]["train"]["held"]
        assert fsdp["params"] == 4 * psi // 2 and fsdp["grads"] == 4 * psi // 2, fsdp  # dims split evenly here
        assert abs(fsdp["optimizer"] - 8 * psi // 2) <= 4 * tensors, fsdp
    zero = [r["zero_redundancy"]["train"]["held"]["optimizer"] for r in ranks]
    assert abs(sum(zero) - 8 * psi) <= 4 * tensors and min(zero) > 0, zero


def test_a_steps_collectives_are_what_the_prose_counts(methods_on_gloo):
    ns, ranks = methods_on_gloo
    depth = ns["DEPTH"]
    census = {m: ranks[0][m]["census"] for m in ns["METHODS"]}
    assert set(census["ddp"]) == {"gloo:all_reduce"}
    assert census["fsdp2"]["gloo:all_gather"][0] == 2 * depth  # forward and backward, per block
    assert census["fsdp2"]["gloo:all_reduce"][0] == depth      # a reduce-scatter per block, run as an all-reduce
    assert set(census["yours"]) == {"gloo:all_gather", "gloo:all_reduce"}  # gloo's reduce-scatter inside
    assert census["zero_redundancy"]["gloo:broadcast"][0] == len(list(ns["make_model"]().parameters()))
    psi = sum(p.numel() for p in ns["make_model"]().parameters())
    sent = {m: ns["sent_in_all"](c, 2) / psi for m, c in census.items()}
    assert sent["ddp"] == pytest.approx(1.0) and sent["fsdp2"] == pytest.approx(2.0), sent
