"""Lesson 09 (DDP in practice): the notebook's conventions, the three judges on plain data (no ranks needed),
the master's solutions through the real probes, and every wrong answer failing its check (all on the CPU:
the probes start two gloo ranks)."""

from __future__ import annotations

import ast
import functools
import json
import re
from pathlib import Path

import pytest
import torch

from course_utils import checks, reference
from course_utils.checks import ddp as c09
from tests.exercise_cells import exercise_cells, run_cells, run_in_process

pytestmark = pytest.mark.ranks

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "09_ddp.ipynb"
STEM = NOTEBOOK.stem
WRONG = ROOT / "tests" / "wrong_answers" / STEM
ACC, CKPT, DEV = "ex09_accumulate", "ex09_checkpoint", "ex09_local_device"
ENTRIES = {ACC: "train", CKPT: "Checkpoint", DEV: "local_device"}


@pytest.fixture(scope="module")
def notebook() -> dict:
    return json.loads(NOTEBOOK.read_text())


run_here = functools.partial(run_in_process, module="__lesson09__")


def wrong(ex: str) -> list[Path]:
    return sorted(WRONG.glob(f"{ex}*.py"))


def code_source(nb: dict) -> str:
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")


# ------------------------------------------------------------------------------ the notebook's cells


def test_every_exercise_is_gradeable_on_a_cpu(notebook):
    cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    graded = {c["metadata"]["nbgrader"]["grade_id"] for c in cells if c["metadata"].get("nbgrader", {}).get("grade")}
    assert graded == set(ENTRIES)
    for ex, entry in ENTRIES.items():
        assert checks.exercise(ex).entry == entry and checks.exercise(ex).needs_gpu is False


def test_the_notebook_runs_the_real_script_and_scripts(notebook):
    src = code_source(notebook)
    assert '"launch" / "train_ddp.py"' in src and "multinode_local.sh" in src and '"--standalone"' in src
    assert 'Recorder("09_ddp", live=USE_GPUS)' in src and {"sync_bn", "scaling"} <= taken_keys(notebook)
    assert "pool.close()" in src and "WORK.cleanup()" in src  # nothing left behind
    assert not re.search(r"from course_utils(\.| import )[^\n]*\b(ddp|data_parallel)\b", src)  # no lesson helpers


def taken_keys(nb: dict) -> set[str]:
    return set(re.findall(r'rec\.take\("(\w+)"', code_source(nb)))


# ------------------------------------------------------------------------------ ex09_accumulate: the judge

ACC_INPUTS = checks.plain({**c09.accumulate_inputs(seed=5), "gpu": False})


def acc_rank(inputs: dict, rank: int, **change) -> dict:
    """What a right answer's rank reports, computed from the judge's own model of the job."""
    orders = c09.sampler_orders(inputs)
    n_steps = inputs["epochs"] * (len(orders[0][0]) // inputs["batch"]) // inputs["accum"]
    data = {"indices": [i for epoch in orders[rank] for i in epoch], "syncs_at_steps": list(range(1, n_steps + 1)),
            "syncs": n_steps, "weights": c09.reference_weights(inputs)}
    return {**data, **change}


def acc_judge(*ranks: dict) -> str:
    return c09.accumulate_judge(ACC_INPUTS, checks.from_bytes(checks.to_bytes({"ranks": list(ranks)})))


def test_accumulate_judge_passes_the_model_of_a_right_answer():
    assert "one all-reduce each" in acc_judge(acc_rank(ACC_INPUTS, 0), acc_rank(ACC_INPUTS, 1))


def test_sampler_orders_are_disjoint_shards_and_change_with_the_epoch():
    orders = c09.sampler_orders(ACC_INPUTS)
    for epoch in range(ACC_INPUTS["epochs"]):
        assert sorted(orders[0][epoch] + orders[1][epoch]) == list(range(ACC_INPUTS["n"]))
    assert orders[0][0] != orders[0][1] != orders[0][2]


def test_reference_weights_are_one_big_batch_per_step():
    """With accum=1 and one step, the reference is one SGD step on the mean loss of both ranks' batch."""
    import torch.nn.functional as F

    inputs = {**ACC_INPUTS, "n": 8, "batch": 4, "accum": 1, "epochs": 1}
    x, y = c09.accumulate_data(inputs)
    model = c09.accumulate_model(inputs)
    orders = c09.sampler_orders(inputs)
    idx = orders[0][0] + orders[1][0]
    F.cross_entropy(model(x[idx]), y[idx]).backward()
    want = [p.detach() - inputs["lr"] * p.grad for p in model.parameters()]
    got = c09.reference_weights(inputs)
    assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("change, words", [
    ({"indices": None}, "samples per epoch"),
    ("same_order", "the order of epoch 0"),
    ("shifted_order", "sampler's order for epoch 1"),
    ({"syncs_at_steps": [3 * k for k in range(1, 13)], "syncs": 36}, "one gradient all-reduce per optimizer step"),
    ({"syncs_at_steps": [0] * 12, "syncs": 0}, "one gradient all-reduce per optimizer step"),
    ({"syncs_at_steps": list(range(1, 37)), "syncs": 36}, "12 optimizer steps"),
    ("scaled_weights", "final weights"),
    ({"weights": "ok"}, "final weights"),
])
def test_accumulate_judge_fails(change, words):
    right = acc_rank(ACC_INPUTS, 0)
    if change == "same_order":
        per = len(right["indices"]) // ACC_INPUTS["epochs"]
        change = {"indices": right["indices"][:per] * ACC_INPUTS["epochs"]}
    elif change == "shifted_order":
        per = len(right["indices"]) // ACC_INPUTS["epochs"]
        change = {"indices": right["indices"][:per] + right["indices"][per + 1:2 * per] + right["indices"][per:per + 1]
                  + right["indices"][2 * per:]}
    elif change == "scaled_weights":
        change = {"weights": [w * 1.01 for w in right["weights"]]}
    with pytest.raises(checks.CheckFailed, match=words):
        acc_judge(acc_rank(ACC_INPUTS, 0, **change), acc_rank(ACC_INPUTS, 1))


def test_accumulate_judge_reports_a_failed_run_and_missing_ranks():
    with pytest.raises(checks.CheckFailed, match="run on both ranks"):
        c09.accumulate_judge(ACC_INPUTS, {"error": "rank 1 failed: RuntimeError"})
    with pytest.raises(checks.CheckFailed, match="ranks' results"):
        c09.accumulate_judge(ACC_INPUTS, {"ranks": [acc_rank(ACC_INPUTS, 0)]})


# ------------------------------------------------------------------------------ ex09_checkpoint: the judge

CKPT_INPUTS = checks.plain({**c09.checkpoint_inputs(seed=3), "gpu": False})


def ckpt_rank(rank: int, **change) -> dict:
    weights, exp_avg, exp_avg_sq = c09.trained_state(CKPT_INPUTS)
    keys = sorted(n for n, _ in c09.checkpoint_model(CKPT_INPUTS).named_parameters())
    data = {"saves": [0] if rank == 0 else [], "map_locations": ["cpu"], "epoch": CKPT_INPUTS["epoch"],
            "weights": weights, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
            "file_keys": ["epoch", "model", "optimizer"], "model_keys": keys}
    return {**data, **change}


def ckpt_judge(r0: dict, r1: dict) -> str:
    return c09.checkpoint_judge(CKPT_INPUTS, checks.from_bytes(checks.to_bytes({"ranks": [r0, r1]})))


def test_checkpoint_judge_passes_a_right_run():
    assert "rank 0 wrote" in ckpt_judge(ckpt_rank(0), ckpt_rank(1))


@pytest.mark.parametrize("which, change, words", [
    (1, {"saves": [1]}, "rank 0 alone to call torch.save"),
    (0, {"saves": [0, 0]}, "rank 0 alone to call torch.save"),
    (0, {"saves": []}, "rank 0 alone to call torch.save"),
    (0, {"model_keys": ["module.0.bias", "module.0.weight", "module.2.bias", "module.2.weight"]}, "inside DDP"),
    (0, {"file_keys": ["model", "optimizer"]}, "keys epoch, model, optimizer"),
    (1, {"epoch": c09.STALE_EPOCH}, "the stale checkpoint's epoch"),
    (1, {"weights": "zeros"}, "weights after load"),
    (1, {"exp_avg": [None] * 4, "exp_avg_sq": [None] * 4}, "Adam state"),
    (1, {"map_locations": ["none"]}, "map onto the device"),
    (0, {"map_locations": []}, "map onto the device"),
])
def test_checkpoint_judge_fails(which, change, words):
    ranks = [ckpt_rank(0), ckpt_rank(1)]
    if change.get("weights") == "zeros":
        change = {"weights": [torch.zeros_like(w) for w in ranks[which]["weights"]]}
    ranks[which] = {**ranks[which], **change}
    with pytest.raises(checks.CheckFailed, match=words):
        ckpt_judge(*ranks)


def test_trained_state_has_adam_moments_from_the_seed():
    a, b = c09.trained_state(CKPT_INPUTS), c09.trained_state(CKPT_INPUTS)
    assert all(torch.equal(x, y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))
    assert all(float(m.abs().sum()) > 0 for m in a[1])
    assert not torch.equal(a[0][0], c09.checkpoint_model(CKPT_INPUTS)[0].weight)  # the steps moved the weights


# ------------------------------------------------------------------------------ ex09_local_device: the judge


def test_layouts_hold_the_cases_that_tell_the_mistakes_apart():
    cases = c09.device_inputs(seed=1)["cases"]
    assert len(cases) == sum(n * p for n, p, _ in c09.LAYOUTS)
    rank_mod = [c for c in cases if c["gpus"] and int(c["env"]["RANK"]) % c["gpus"] != int(c["env"]["LOCAL_RANK"])]
    assert rank_mod  # RANK % gpus is wrong somewhere (4 workers on 8-GPU nodes)
    assert any(c["gpus"] == 0 for c in cases) and any("CUDA_VISIBLE_DEVICES" in c["env"] for c in cases)


def test_device_judge_on_plain_data():
    inputs = c09.device_inputs(seed=2)
    right = [c09.expected_device(c) for c in inputs["cases"]]
    assert "workers" in c09.device_judge(inputs, {"devices": right})
    for bad in (["cuda:" + c["env"]["RANK"] for c in inputs["cases"]], right[:-1], "cuda:0"):
        with pytest.raises(checks.CheckFailed):
            c09.device_judge(inputs, {"devices": bad})


def test_device_probe_describes_what_is_not_a_device():
    inputs = {"cases": [{"env": {"LOCAL_RANK": "1"}, "gpus": 2}] * 3}
    answers = iter([torch.device("cuda", 1), "cuda:1", 1])
    data = c09.device_probe(lambda env, gpus: next(answers), inputs)
    assert data["devices"] == ["cuda:1", "cuda:1", "a int"]


# ------------------------------------------------------------------------------ end to end, on two gloo ranks


def test_accumulate_master_solution_passes_in_a_fresh_kernel(notebook):
    text, error = run_cells(exercise_cells(notebook, ACC, None))
    assert error is None and checks.PASS_MARKER in text, text


@pytest.mark.parametrize("ex", [CKPT, DEV])
def test_master_solutions_pass(notebook, ex):
    text, error = run_here(exercise_cells(notebook, ex, None))
    assert error is None and checks.PASS_MARKER in text, text


WRONG_SAYS = {  # wrong answer -> what its check must say
    ACC: r"\(train\(ddp, loader, optimizer, epochs=3, accum=3\) on 2 ranks, 96 samples, batches of 4\), saw an "
         r"order starting \[[\d, ]+\], the order of epoch 0",
    f"{ACC}__set_epoch_after_the_epoch": "the order of epoch 0",
    f"{ACC}__no_sync_backward_only": "one gradient all-reduce per optimizer step",
    f"{ACC}__never_syncs": "one gradient all-reduce per optimizer step",
    f"{ACC}__step_every_micro_batch": "optimizer steps on rank 0",
    f"{ACC}__loss_not_averaged": "final weights",
    f"{ACC}__zero_grad_every_micro_batch": "final weights",
    CKPT: r"rank 0 alone to call torch.save, once \(save\(ddp, optimizer, epoch=\d+, path\), then load\(ddp, "
          r"optimizer, path, cpu\) on 2 ranks\)",
    f"{CKPT}__no_barrier": "stale checkpoint",
    f"{CKPT}__barrier_before_save": "stale checkpoint",
    f"{CKPT}__wrapper_state_dict": "inside DDP",
    f"{CKPT}__no_map_location": "map onto the device",
    f"{CKPT}__no_optimizer_state": "Adam state",
    f"{CKPT}__only_rank_0_loads": "rank 1's weights",
    DEV: "for the worker with RANK=",
    f"{DEV}__rank_mod_gpus": "for the worker with",
    f"{DEV}__group_rank": "for the worker with",
    f"{DEV}__always_cuda": "'cpu' for the worker",
    f"{DEV}__bare_cuda": "for the worker with",
    f"{DEV}__equal_to_anything": "a Anything",
}


def test_every_wrong_answer_has_an_expected_verdict():
    assert {p.stem for p in WRONG.glob("*.py")} == set(WRONG_SAYS)


def test_wrong_answers_cover_the_briefs_mistakes():
    assert {f"{ACC}", f"{ACC}__no_sync_backward_only", f"{DEV}", f"{CKPT}__no_barrier",
            f"{CKPT}__no_map_location"} <= set(WRONG_SAYS)


@pytest.mark.slow
@pytest.mark.parametrize("stem", sorted(WRONG_SAYS))
def test_wrong_answers_fail(notebook, stem):
    ex = stem.split("__")[0]
    text, error = run_here(exercise_cells(notebook, ex, (WRONG / f"{stem}.py").read_text()))
    assert error == "CheckFailed", text
    assert re.search(WRONG_SAYS[stem], text), text


def test_a_stub_is_not_attempted(notebook):
    """The student version's `raise NotImplementedError()` inside a worker comes back as NotImplementedError."""
    stub = "    ### BEGIN SOLUTION\n    raise NotImplementedError()\n    ### END SOLUTION\n"
    text, error = run_here(exercise_cells(notebook, ACC, stub))
    assert error == "NotImplementedError", text


# ------------------------------------------------------------------------------ the recording


def test_recording_holds_every_key(notebook):
    if STEM not in reference.available():
        pytest.skip(f"no reference recording {STEM!r} yet: make it on a GPU with "
                    f"python benchmarks/record_references.py {STEM}")
    rec = reference.load(STEM)
    assert taken_keys(notebook) <= set(rec.data), taken_keys(notebook) - set(rec.data)
    rows = rec.data["scaling"]["rows"]
    assert rows[0]["gpus"] == 1 and all(0 < r["strong_efficiency"] <= 1.2 for r in rows)
    sbn = rec.data["sync_bn"]
    assert sbn["0"]["running mean / 0.1"] == pytest.approx(sbn["0"]["global batch mean"], abs=2e-3)
    assert sbn["0"]["running mean / 0.1"] == sbn["1"]["running mean / 0.1"]


def cell_with(nb: dict, start: str) -> str:
    """The source of the one code cell that starts with `start`."""
    found = [s for c in nb["cells"] if c["cell_type"] == "code" and (s := "".join(c["source"])).startswith(start)]
    assert len(found) == 1, (start, len(found))
    return found[0]


def test_ddp_options_show_what_the_prose_says(notebook):
    """Sections on Join's divisor, hooks under autocast, static_graph and DDP's buckets, run as their cells (on
    two gloo ranks here): their printed lines say what the prose around them explains."""
    setup = [cell_with(notebook, s) for s in ("import torch\n", "import contextlib", "import json",
                                              "pool = launch.Pool(NPROC)")]
    setup.append("from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n"
                 "from torch.distributed.algorithms.join import Join\n")
    cells = [cell_with(notebook, s) for s in ("def join_scaling", "from torch.distributed.algorithms.ddp_comm_hooks "
                                              "import powerSGD_hook", "class WithUnusedHead", "def ddp_buckets",
                                              "pool.close()")]
    text, error = run_here(setup + ["\n\n".join(cells)])
    assert error is None, text
    print(text)
    assert "divide_by_initial_world_size=True: the gradient in each step, {0: [1.0], 1: [1.0, 0.5]}" in text
    assert "divide_by_initial_world_size=False: the gradient in each step, {0: [1.0], 1: [1.0, 1.0]}" in text
    kb = {name: float(v) for name, v in re.findall(r"^\s*([\w -]+?): \{'kB per step': ([\d.]+)", text, re.M)}
    assert kb["autocast bf16"] == kb["fp32 all-reduce"] > 1.9 * kb["16-bit"], kb  # autocast sends fp32 gradients
    dtypes = dict(re.findall(r"^\s*([\w -]+?): \{.*'output dtype': '(\w+)'\}", text, re.M))
    assert dtypes["autocast bf16"] == "bfloat16" and dtypes["fp32 all-reduce"] == "float32", dtypes  # it ran bf16
    assert re.search(r"find_unused_parameters=False, static_graph=True:\n\s+three steps, no error", text), text
    assert re.search(r"find_unused_parameters=False, static_graph=False:\n\s+Expected to have finished", text), text
    rows = {m[0]: (ast.literal_eval(m[1]), int(m[2])) for m in re.findall(
        r"DDP\(model, (.*?)\):\s+\{'MiB per all-reduce, steps 1, 2, 3': (\[.*?\]\]), 'storages of the 24 gradients': "
        r"(\d+)\}", text)}
    one, two = [12.02], [1.0, 11.02]  # all twelve 1 MiB layers; a first bucket closed at 1 MiB, then the rest
    assert rows["defaults"] == ([one, two, two], 24), rows
    assert rows["bucket_cap_mb=25"] == ([one, one, one], 24), rows
    assert rows["gradient_as_bucket_view=True"] == ([one, two, two], 2), rows  # the gradients live in the buckets
    assert rows["static_graph=True"] == ([one, one, two], 24), rows


@pytest.mark.parametrize("codes, says", [
    ([1, None], "one exited with an error, the other waited"),
    ([None, 1], "one exited with an error, the other waited"),
    ([None, None], "neither exited"),
    ([1, 1], "exit codes [1, 1]"),
])
def test_the_same_node_rank_verdict_reads_what_the_agents_did(notebook, codes, says):
    tree = ast.parse(cell_with(notebook, "show_env = Path("))
    ns: dict = {}
    exec(ast.unparse(next(n for n in tree.body if getattr(n, "name", "") == "same_node_rank_verdict")), ns)
    assert ns["same_node_rank_verdict"](codes).startswith(says)


def test_the_scaling_table_says_what_the_baselines_do(notebook, tmp_path, capsys):
    """With one GPU's strong batch cheaper per sample than its weak batch, strong scaling's efficiency falls by that
    much more with no communication to blame: the line under the table says how much. A machine with fewer GPUs than
    the recording shows the recording's table after its own."""
    import matplotlib

    matplotlib.use("Agg")
    rows = [{"gpus": 1, "strong_batch": 4096, "strong_ms": 67.2, "strong_speedup": 1.0, "strong_efficiency": 1.0,
             "weak_batch": 1024, "weak_ms": 19.0, "weak_efficiency": 1.0},
            {"gpus": 4, "strong_batch": 1024, "strong_ms": 20.7, "strong_speedup": 3.25, "strong_efficiency": 0.81,
             "weak_batch": 1024, "weak_ms": 20.7, "weak_efficiency": 0.92}]
    four = {"rows": rows, "params": 134e6, "gpu": "NVIDIA H200", "global_batch": 4096, "batch": 1024}
    cell = cell_with(notebook, "import matplotlib.pyplot as plt\n\n\ndef show_scaling")
    ns = {"scaling": four, "rec": reference.Recorder(STEM, live=True, directory=tmp_path)}
    exec(cell, ns)
    out = capsys.readouterr().out
    assert "at 4 GPUs strong and weak scaling are one run" in out, out
    assert "strong's baseline is 12% cheaper per sample" in out, out
    assert "more GPUs than this machine has" not in out  # no recording in tmp_path
    reference.save(STEM, {"scaling": four}, directory=tmp_path)
    two = {**four, "rows": [rows[0], {**rows[1], "gpus": 2}]}
    exec(cell, {"scaling": two, "rec": reference.Recorder(STEM, live=True, directory=tmp_path)})
    out = capsys.readouterr().out
    assert out.count("MLP of 134M parameters") == 2 and "and on more GPUs than this machine has, recorded on" in out
    exec(cell, {"scaling": four, "rec": reference.Recorder(STEM, live=True, directory=tmp_path)})
    assert capsys.readouterr().out.count("MLP of 134M parameters") == 1  # this machine had as many: its own only
    ns["plt"].close("all")
