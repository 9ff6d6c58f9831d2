"""The evaluation stores: memory up to a budget, a file beyond it, the same batches either way (issue 18)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from qdebug.data.store import ArrayStore


def _batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {
            "y": rng.normal(size=(2, 3, 5)).astype(np.float32),
            "ids": rng.integers(0, 9, size=(2,)),
            "text": np.array(["a", "bc"], dtype=object),
            "empty": np.zeros((0, 4), np.float32),
        }
        for _ in range(n)
    ]


@pytest.mark.parametrize("budget", [0, 300, 10**9])
def test_store_gives_back_what_was_kept_in_memory_or_spilled(budget):
    batches = _batches(7)
    store = ArrayStore(budget)
    for b in batches:
        store.append(b)
    assert len(store) == 7
    assert store.held_bytes <= budget
    if budget == 0:
        assert store.spilled_bytes == sum(b["y"].nbytes + b["ids"].nbytes for b in batches)
    for got, want in zip(store, batches, strict=True):
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
            np.testing.assert_array_equal(got[k], want[k])
    view = store[2:5]
    assert len(view) == 3 and np.array_equal(view[0]["y"], batches[2]["y"])
    assert np.array_equal(view[1:][1]["ids"], batches[4]["ids"])


def test_spilled_store_pickles_by_path_and_its_file_goes_with_it():
    store = ArrayStore(0)
    for b in _batches(3):
        store.append(b)
    folder = store._file.folder
    assert folder.is_dir()
    copy = pickle.loads(pickle.dumps(store))
    np.testing.assert_array_equal(copy[2]["y"], store[2]["y"])
    assert len(pickle.dumps(store)) < 2_000  # the arrays stay in the file
    store.close()
    assert not folder.exists()


def test_stores_share_the_process_budget(monkeypatch):
    from qdebug.data import store

    monkeypatch.setattr(store, "_SHARED", {"held": 0})  # what other tests' stores still hold is not counted
    monkeypatch.setenv("QDEBUG_SPILL_MB", str(1000 / 2**20))  # 1,000 bytes for every store together
    a, b = ArrayStore(), ArrayStore()
    big = {"y": np.zeros(100, np.float32)}  # 400 bytes
    a.append(big)
    a.append(big)
    b.append(big)  # the third 400 bytes no longer fit
    assert (a.held_bytes, b.held_bytes, b.spilled_bytes) == (800, 0, 400)
    a.close()
    b.append(big)
    assert b.held_bytes == 400


def test_spill_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("QDEBUG_SPILL_DIR", str(tmp_path))
    store = ArrayStore(0)
    store.append({"y": np.ones(3, np.float32)})
    assert [p.parent for p in tmp_path.glob("qdebug-spill-*/batches.bin")] == [store._file.folder]
    del store
    assert not list(tmp_path.iterdir())  # removed with the store that wrote it


def _demo_evaluation(tmp_path, monkeypatch, spill_mb: str, metric: str | None = None):
    """The demo's FP32 references and its static model's score, with the stores' budget at ``spill_mb``."""
    from qdebug.cli.demo import demo_files
    from qdebug.data import open_data
    from qdebug.evaluation.evaluate import Evaluator
    from qdebug.prepare import AnalyzeOptions, prepare
    from qdebug.quant.quantize import QuantSpec, quantize_static_model
    from qdebug.runtime.capture import SessionConfig

    monkeypatch.setenv("QDEBUG_SPILL_MB", spill_mb)
    monkeypatch.setenv("QDEBUG_SPILL_DIR", str(tmp_path))
    model, calib, evaluation = demo_files()
    prep = prepare(model, calib, tmp_path / f"files_{spill_mb}", AnalyzeOptions())
    data = open_data(evaluation, prep.calib.specs, batch_size=64, what="evaluation data")
    evaluator = Evaluator(prep.normalized, data, SessionConfig(), metric)
    static = quantize_static_model(prep.normalized, prep.ranges, QuantSpec())
    return evaluator, evaluator.score(static), static


def test_an_evaluator_on_disk_scores_as_one_in_memory(tmp_path, monkeypatch):
    """Every input and reference spilled (budget 0) gives the same value, per-sample results, outputs' errors
    and interval as all in memory; a pickled copy (a worker's) reads the same files."""
    memory, mem_result, _ = _demo_evaluation(tmp_path, monkeypatch, "1000")
    disk, disk_result, _ = _demo_evaluation(tmp_path, monkeypatch, "0")
    assert memory.reference.spilled_bytes == 0 and disk.reference.held_bytes == 0
    assert disk.reference.spilled_bytes > 0 and disk.batches.feeds.spilled_bytes > 0
    assert disk_result.value == mem_result.value and disk.fp32_value == memory.fp32_value
    assert disk_result.outputs == mem_result.outputs
    np.testing.assert_array_equal(disk.sample_results(disk_result).values, memory.sample_results(mem_result).values)
    assert disk.drop_interval(disk_result) == memory.drop_interval(mem_result)
    worker = pickle.loads(pickle.dumps(disk))
    assert len(pickle.dumps(disk)) < 100_000  # the arrays stay in the files
    assert worker.batches[3].origin == disk.batches[3].origin
    np.testing.assert_array_equal(
        worker.batches[3].feeds["input"]
        if "input" in worker.batches[3].feeds
        else next(iter(worker.batches[3].feeds.values())),
        next(iter(disk.batches[3].feeds.values())),
    )


def test_a_candidates_result_keeps_no_outputs(tmp_path, monkeypatch):
    """What propose keeps per candidate is a few numbers per sample, whatever the size of the model's outputs."""
    evaluator, result, _ = _demo_evaluation(tmp_path, monkeypatch, "1000")
    kept = len(pickle.dumps(result))
    # per sample: a hit, a class, the signal and noise energies of the one float output (8 bytes each)
    assert kept < 4 * 8 * evaluator.samples + 10_000, kept
    assert result.kept is None and result.values is not None and result.values.units == evaluator.samples


@pytest.mark.parametrize("metric", ["top1", "output_sqnr_db"])
def test_a_candidate_scored_on_shards_merges_into_the_whole_result(tmp_path, monkeypatch, metric):
    """What Ray's workers do with a large evaluation set: each scores a shard (from a pickled copy, as a
    worker gets it), the merge equals the score on the whole set -- value, outputs' errors, per-sample
    results and interval."""
    evaluator, whole, static = _demo_evaluation(tmp_path, monkeypatch, "0", metric)
    shards = evaluator.shards(3)
    assert len(shards) == 3 and sum(s.samples for s in shards) == evaluator.samples
    assert [b.origin for s in shards for b in s.batches] == [b.origin for b in evaluator.batches]
    merged = evaluator.merge([pickle.loads(pickle.dumps(s)).score(static) for s in shards])
    assert merged.value == pytest.approx(whole.value, rel=1e-12)
    for a, b in zip(merged.outputs, whole.outputs, strict=True):
        assert a.error.sqnr_db == pytest.approx(b.error.sqnr_db, rel=1e-9)
    np.testing.assert_allclose(evaluator.sample_results(merged).values, evaluator.sample_results(whole).values)
    np.testing.assert_allclose(evaluator.drop_interval(merged), evaluator.drop_interval(whole), rtol=1e-9)
    np.testing.assert_allclose(evaluator.sqnr_values(merged).noise, evaluator.sqnr_values(whole).noise, rtol=1e-12)
