"""Reference recordings: saved with provenance, loaded back, and every committed one made on a real GPU."""

from __future__ import annotations

import json

import pytest

from course_utils import reference


def test_save_and_load_round_trip(tmp_path):
    path = reference.save("99_demo", {"sizes": [1, 2], "gbps": [0.5, 1.5]}, directory=tmp_path, note="test")
    rec = reference.load("99_demo", directory=tmp_path)
    assert path.name == "99_demo.json"
    assert rec.data == {"sizes": [1, 2], "gbps": [0.5, 1.5]}
    assert rec.provenance["note"] == "test" and "torch" in rec.provenance and "date" in rec.provenance
    assert rec.label().startswith("recorded on ")


def test_missing_recording_says_how_to_make_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="record_references.py"):
        reference.load("nope", directory=tmp_path)


def real_gpu_problems(provenance: dict) -> list[str]:
    """Why a recording's provenance does not show a real GPU measurement (empty when it does)."""
    problems = []
    if not provenance.get("gpu_count"):
        problems.append("gpu_count is 0")
    if not provenance.get("cuda"):
        problems.append("no CUDA version")
    gpu = str(provenance.get("gpu", ""))
    if not gpu or "FAKE" in gpu.upper() or "CPU" in gpu.upper():
        problems.append(f"gpu is {gpu!r}")
    for key in ("driver", "torch", "date"):
        if not provenance.get(key) or provenance.get(key) == "unknown":
            problems.append(f"{key} missing")
    return problems


@pytest.mark.parametrize("name", reference.available() or ["<none>"])
def test_committed_recordings_come_from_a_gpu(name):
    if name == "<none>":
        pytest.skip("no reference recordings yet")
    record = json.loads((reference.DATA_DIR / f"{name}.json").read_text())
    assert record["name"] == name
    assert real_gpu_problems(record["provenance"]) == [], f"{name} was not recorded on a GPU"


def test_provenance_check_rejects_a_cpu_made_file():
    cpu = reference.provenance()
    if cpu["gpu_count"] == 0:
        assert real_gpu_problems(cpu)
    fake = {"gpu": "FAKE (local dev only)", "gpu_count": 1, "cuda": "13.0", "driver": "1", "torch": "2", "date": "d"}
    assert any("FAKE" in p for p in real_gpu_problems(fake))


def test_verdicts_name_where_their_numbers_come_from(tmp_path):
    """A learner without a GPU reads "in the recording (GPU)", never "on this machine", before a recorded number."""
    assert reference.Recorder("x", live=True, directory=tmp_path).here == "on this machine"
    assert reference.Recorder("x", live=False, directory=tmp_path).here == "in the recording"  # none made yet
    reference.save("x", {"k": 1}, directory=tmp_path)
    data = json.loads((tmp_path / "x.json").read_text())
    data["provenance"]["gpu"] = "NVIDIA H200"
    (tmp_path / "x.json").write_text(json.dumps(data))
    assert reference.Recorder("x", live=False, directory=tmp_path).here == "in the recording (NVIDIA H200)"


def test_plot_titles_say_when_their_data_is_a_recording(tmp_path):
    assert reference.Recorder("x", live=True, directory=tmp_path).titled("t") == "t"
    assert reference.Recorder("x", live=False, directory=tmp_path).titled("t") == "t [recorded]"
    reference.save("x", {"k": 1}, directory=tmp_path)
    data = json.loads((tmp_path / "x.json").read_text())
    data["provenance"]["gpu"] = "NVIDIA H200"
    (tmp_path / "x.json").write_text(json.dumps(data))
    assert reference.Recorder("x", live=False, directory=tmp_path).titled("t") == "t [recorded on NVIDIA H200]"
    data["provenance"]["gpu_count"] = 2  # a learner with one H200 must see that the recording had two
    (tmp_path / "x.json").write_text(json.dumps(data))
    recorder = reference.Recorder("x", live=False, directory=tmp_path)
    assert recorder.titled("t") == "t [recorded on 2x NVIDIA H200]"
    assert recorder.here == "in the recording (2x NVIDIA H200)"
    assert recorder.recording.label().startswith("recorded on 2x NVIDIA H200 (driver ")


def test_a_recording_keeps_the_order_of_its_keys(tmp_path):
    """A recorded table prints its rows in the order the live one above it does, not sorted."""
    reference.save("x", {"k": {"pid": 1, "RANK": 0, "WORLD_SIZE": 2}}, directory=tmp_path)
    assert list(reference.load("x", directory=tmp_path).data["k"]) == ["pid", "RANK", "WORLD_SIZE"]


def test_a_cell_newer_than_its_recording_says_so(tmp_path, capsys):
    reference.save("x", {"old": 1}, directory=tmp_path)
    assert reference.Recorder("x", live=False, directory=tmp_path).take("new", lambda: 2) is None
    said = capsys.readouterr().out
    assert "[new: not shown: the recording (made on " in said and "is older than this cell" in said, said
