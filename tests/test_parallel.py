"""Candidate evaluations side by side (issue 18 part 3): ``--workers N`` and ``--ray`` give the answer, the trace
and the budget of the one-process run; worker errors come back as the same one-line error; the missing Ray
extra is one line; SIGTERM stops every worker and leaves no output."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qdebug.cli.main import main
from qdebug.errors import ExitCode, QDebugError
from qdebug.output.report_io import dumps
from qdebug.prepare import RuntimeSettings
from qdebug.propose import ProposeOptions, propose
from qdebug.propose.minimize import minimal_subset
from qdebug.runtime.parallel import RAY_MISSING, Pool, check_request, usable_cores, worker_threads
from tests.conftest import ROOT
from tests.conftest import planted as _planted


def _report(tmp_path: Path, kind: str = "outlier_residual"):
    """A planted model, analyzed (``outlier_residual``: 3 culprits, so its search bisects, minimizes, prunes
    pairs, tries fixes and units alone)."""
    rec = _planted().make(kind, tmp_path / kind, "small")
    report = tmp_path / f"{kind}.json"
    args = ["analyze", rec.model, "--calib", rec.calib, "--eval", rec.eval, "--metric", rec.metric]
    assert main([*args, "-o", str(report), "-q"]) == 0
    return rec, report


def _trace(result) -> list[tuple]:
    return [(t.step, t.nodes, t.overrides, t.per_channel, t.fixes, t.value, t.met) for t in result.trials]


def test_the_answer_trace_and_budget_are_the_same_for_any_number_of_workers(tmp_path):
    rec, report = _report(tmp_path)
    options = ProposeOptions(target_drop=rec.target_drop, time_runs=0)
    one = propose(report, output=None, options=dataclasses.replace(options, runtime=RuntimeSettings(workers=1)))
    out = tmp_path / "p2.json"
    args = ["propose", str(report), "--target-drop", str(rec.target_drop), "--time-runs", "0", "-o", str(out), "-q"]
    assert main([*args, "--workers", "2"]) == 0
    two, ref = json.loads(out.read_text()), json.loads(dumps(one.proposal))
    assert len(one.trials) >= 10  # a real search: candidates, bisection, minimization, pairs, fixes, units alone
    assert two["nodes_to_exclude"] == ref["nodes_to_exclude"] == rec.culprits
    for key in ("tensor_overrides", "per_channel", "evaluations", "static_metric", "expected_metric", "reasons"):
        assert two[key] == ref[key], key
    # the whole trace, step by step and score by score
    again = propose(report, output=None, options=ProposeOptions(target_drop=rec.target_drop, workers=2, time_runs=0))
    assert _trace(again) == _trace(one) and again.max_evaluations == one.max_evaluations


def test_a_screened_search_and_its_frontier_score_alike_on_two_workers(tmp_path):
    """The rounds on every sample (static, the answer, the neighbours, dynamic) go to the workers at once."""
    rec, report = _report(tmp_path, "two_culprits")
    # recipes=(): the per-node answer both times (with recipes, a timed comparison may take quantize_dynamic
    # in one run and not the other: timing differs between runs, the answer must not here)
    common = dict(target_drop=rec.target_drop, screen_samples=64, time_runs=2, recipes=())
    one = propose(report, output=None, options=ProposeOptions(workers=1, **common))
    two = propose(report, output=None, options=ProposeOptions(workers=2, **common))
    assert _trace(two) == _trace(one)
    assert two.proposal.nodes_to_exclude == one.proposal.nodes_to_exclude
    assert (two.proposal.static_metric, two.proposal.expected_metric) == (
        one.proposal.static_metric,
        one.proposal.expected_metric,
    )
    points = lambda r: [(p.label, p.changed, p.metric, p.met) for p in r.proposal.frontier]  # noqa: E731
    assert points(two) == points(one) and "dynamic" in [p.label for p in one.proposal.frontier]


def test_on_a_local_ray_instance_the_answer_is_the_same(tmp_path, capsys):
    """``--ray auto`` without a cluster starts a local 2-CPU instance (and shuts it down): the same answer."""
    ray = pytest.importorskip("ray")
    rec, report = _report(tmp_path)
    one = propose(report, output=None, options=ProposeOptions(target_drop=rec.target_drop, workers=1, time_runs=0))
    out = tmp_path / "ray.json"
    args = ["propose", str(report), "--target-drop", str(rec.target_drop), "--time-runs", "0", "-o", str(out), "-q"]
    assert main([*args, "--ray", "auto", "--workers", "2"]) == 0
    p = json.loads(out.read_text())
    assert p["nodes_to_exclude"] == list(one.proposal.nodes_to_exclude)
    assert p["evaluations"] == one.proposal.evaluations and p["expected_metric"] == one.proposal.expected_metric
    assert [r["node"] for r in p["reasons"]] == [r.node for r in one.proposal.reasons]
    if "started a local Ray instance with 2 CPU(s)" in capsys.readouterr().err:  # no cluster around (CI)
        assert not ray.is_initialized()  # the instance qdebug started is shut down again


def test_ray_without_the_extra_is_one_line_naming_the_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError, as without the extra
    rec, report = _report(tmp_path, "decomposed_layernorm")
    capsys.readouterr()
    out = tmp_path / "p.json"
    code = main(["propose", str(report), "--ray", "auto", "-o", str(out), "-q"])
    err = capsys.readouterr().err.strip()
    assert code == ExitCode.USAGE and len(err.splitlines()) == 1
    assert err.startswith(f"qdebug: error: {RAY_MISSING}") and 'pip install "qdebug[ray]"' in err
    assert not out.exists()
    for runtime in (ProposeOptions(ray="auto").runtime, ProposeOptions(workers=0).runtime):  # verify, bench alike
        with pytest.raises(QDebugError) as e:
            check_request(runtime)
        assert e.value.code == ExitCode.USAGE


METRIC = """
import numpy as np, time

def score(reference, candidate, labels):
    same = all(np.array_equal(r[k], c[k]) for r, c in zip(reference, candidate) for k in r)
    if not same:  # FP32 itself (scored in the main process) passes; every candidate fails, in a worker
        if {sleep}:
            time.sleep({sleep})
        raise ValueError("candidates are not supported by this metric")
    return 1.0
"""


def test_a_worker_s_error_is_the_one_line_error_of_the_one_process_run(tmp_path, capsys):
    metric = tmp_path / "failing_metric.py"
    metric.write_text(METRIC.format(sleep=0))
    rec, report = _report(tmp_path, "decomposed_layernorm")
    lines = {}
    for workers in ("1", "2"):
        capsys.readouterr()
        out = tmp_path / f"p{workers}.json"
        args = ["propose", str(report), "--metric", f"{metric}:score", "-o", str(out), "-q", "--time-runs", "0"]
        code = main([*args, "--workers", workers])
        err = capsys.readouterr().err.strip().splitlines()
        lines[workers] = (code, err[-1])
        assert not out.exists()
    assert lines["1"] == lines["2"]
    code, line = lines["2"]
    assert code == ExitCode.INPUT and "candidates are not supported by this metric" in line
    assert line.startswith("qdebug: error: metric ") and "Traceback" not in line


def test_the_pool_keeps_order_errors_and_never_runs_a_hint_inline(tmp_path):
    from qdebug.data import model_input_specs, open_data
    from qdebug.evaluation.evaluate import Evaluator
    from qdebug.runtime.capture import SessionConfig
    from tests.models import small_cnn, small_data

    model = onnx.load(str(small_cnn(tmp_path / "m.onnx")))
    ev = Evaluator(model, open_data(small_data(tmp_path / "d.npz", n=32), model_input_specs(model)), SessionConfig())
    bad = onnx.ModelProto()
    bad.CopyFrom(model)
    bad.graph.node[0].op_type = "NoSuchOp"
    results = {}
    for workers in (1, 2):
        with Pool([ev], workers=workers) as pool:
            out = pool.outcomes(ev, [model, bad, model])
            with pytest.raises(QDebugError) as e:
                pool.map(ev, [model, bad])
            assert e.value.code == ExitCode.MODEL
            if workers == 1:
                hint = pool.submit(ev, model, speculative=True)
                assert pool.scored == 3 + 2 and hint.state == "queued"  # a hint never runs in this process
                assert pool.outcome(hint).value == out[0].value and pool.scored == 6  # ...unless asked for
            else:
                assert pool.scored == 2  # equal requests share one evaluation (by model hash)
        results[workers] = [o.one_line() if isinstance(o, QDebugError) else o.value for o in out]
    assert results[1] == results[2] and "cannot load" in results[2][1]
    err = pickle.loads(pickle.dumps(QDebugError("m", "h", ExitCode.DATA)))  # from a worker: whole
    assert (err.message, err.hint, err.code) == ("m", "h", ExitCode.DATA)
    assert worker_threads(2) == max(1, usable_cores() // 2) and worker_threads(4, threads=3) == 3


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 30).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1), min_size=1))),
    st.integers(2, 4),
)
def test_quickxplain_s_hints_name_its_next_tests_and_change_nothing(case, depth):
    n, needed = case
    items = [f"n{i}" for i in range(n)]
    tests, hints = [], []

    def meets(subset):
        tests.append(subset)
        return {items[i] for i in needed} <= set(subset)

    found, done = minimal_subset(items, meets, lookahead=hints.append, depth=depth)
    assert (found, done) == minimal_subset(items, lambda s: {items[i] for i in needed} <= set(s))
    assert [h[0] for h in hints] == tests and all(len(h) < 2**depth for h in hints)
    for i, hint in enumerate(hints):  # the next depth - 1 tests, whatever the answers, are among the hints
        assert all(later in hint[1:] for later in tests[i + 1 : i + depth])


def test_sigterm_stops_every_worker_and_leaves_no_output(tmp_path):
    """SIGTERM to the main process only (``timeout``, a CI job cancelled) while two workers score: exit 143,
    no proposal, no process of the run left."""
    metric = tmp_path / "slow_metric.py"
    metric.write_text(METRIC.format(sleep=60))
    rec, report = _report(tmp_path, "decomposed_layernorm")
    out = tmp_path / "p.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "qdebug", "propose", str(report), "--metric", f"{metric}:score", "-o", str(out)]
    cmd += ["-q", "--workers", "2"]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(_group(proc.pid)) < 5:  # main, fork server, tracker, 2 workers
            time.sleep(0.2)
        assert len(_group(proc.pid)) >= 5, _group(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)
        err = proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == ExitCode.TERMINATED, err
    assert "terminated (SIGTERM); no partial output was written" in err
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _group(proc.pid):
        time.sleep(0.2)
    assert not _group(proc.pid)
    assert not out.exists() and not (tmp_path / "p_files").exists()


def _group(pgid: int) -> list[str]:
    """Live processes (zombies left out) of a process group."""
    ps = subprocess.run(["ps", "-o", "stat=,args=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if line.strip() and not line.strip().startswith("Z")]


def _sharded_case(tmp_path, monkeypatch):
    """A small CNN's evaluator over 48 samples in batches of 8, every input and reference spilled to disk,
    and a static QDQ candidate of it."""
    from qdebug.data import model_input_specs, open_data
    from qdebug.evaluation.evaluate import Evaluator
    from qdebug.prepare import AnalyzeOptions, prepare
    from qdebug.quant.quantize import QuantSpec, quantize_static_model
    from qdebug.runtime.capture import SessionConfig
    from tests.models import small_cnn, small_data

    monkeypatch.setenv("QDEBUG_SPILL_MB", "0")
    path = small_cnn(tmp_path / "m.onnx")
    data = small_data(tmp_path / "d.npz", n=48)
    prep = prepare(path, data, tmp_path / "w", AnalyzeOptions(use_cache=False))
    candidate = quantize_static_model(prep.normalized, prep.ranges, QuantSpec())
    specs = model_input_specs(prep.normalized)
    ev = Evaluator(prep.normalized, open_data(data, specs, batch_size=8), SessionConfig())
    assert ev.reference.spilled_bytes > 0
    return ev, candidate, prep.normalized


def _same_result(a, b) -> None:
    assert a.samples == b.samples and a.value == pytest.approx(b.value, rel=1e-12)
    for x, y in zip(a.outputs, b.outputs, strict=True):
        assert x.error.sqnr_db == pytest.approx(y.error.sqnr_db, rel=1e-9)


def test_a_large_set_is_scored_in_shards_side_by_side_and_merged(tmp_path, monkeypatch):
    """With more samples than ``2 * shard_samples`` each candidate is cut over the workers (one task per
    shard) and merged; the result is the whole set's, the numbers-only one too; small sets go whole."""
    ev, candidate, fp32 = _sharded_case(tmp_path, monkeypatch)
    whole = ev.score(candidate)
    with Pool([ev], workers=2, shard_samples=16) as pool:
        merged = pool.score(ev, candidate)
        assert pool.scored == 2  # two shards of 24 samples, each a task
        _same_result(merged, whole)
        np.testing.assert_array_equal(ev.sample_results(merged).values, ev.sample_results(whole).values)
        numbers = pool.score(ev, fp32, numbers_only=True)
        assert pool.scored == 4 and numbers.values is None
        assert numbers.value == pytest.approx(ev.score(fp32).value, rel=1e-12)
    with Pool([ev], workers=2, shard_samples=32) as pool:  # 48 // 32 < 2 shards: scored whole
        _same_result(pool.score(ev, candidate), whole)
        assert pool.scored == 1


def test_a_portable_shard_scores_without_this_machines_files(tmp_path, monkeypatch):
    """What a Ray actor on another machine gets: a shard with its data inside -- it scores the same after the
    spill files it came from are gone."""
    ev, candidate, _ = _sharded_case(tmp_path, monkeypatch)
    parts = ev.shards(2)
    expected = [p.score(candidate) for p in parts]
    payloads = [pickle.dumps(p.portable()) for p in parts]
    assert all(len(d) > 24 * 64 * 4 for d in payloads)  # 24 samples of 1x8x8 float inputs inside, at least
    ev.reference.close()  # type: ignore[attr-defined]
    ev.batches.feeds.close()  # type: ignore[attr-defined]
    for data, want in zip(payloads, expected, strict=True):
        _same_result(pickle.loads(data).score(candidate), want)


def test_on_ray_a_sharded_candidate_is_the_whole_sets_result(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    ev, candidate, _ = _sharded_case(tmp_path, monkeypatch)
    whole = ev.score(candidate)
    with Pool([ev], ray="auto", workers=2, shard_samples=16) as pool:
        merged = pool.score(ev, candidate)
        assert pool.scored == 2
    _same_result(merged, whole)
    np.testing.assert_array_equal(ev.sample_results(merged).values, ev.sample_results(whole).values)


def _first_shard_fails_case(tmp_path, monkeypatch):
    """An evaluator over 48 one-number samples in batches of 8 and a candidate that fails on two of them
    (a Gather whose index is the sample), one in each half of the set, with different messages."""
    from onnx import TensorProto, helper, numpy_helper

    from qdebug.data import model_input_specs, open_data
    from qdebug.evaluation.evaluate import Evaluator
    from qdebug.runtime.capture import SessionConfig

    monkeypatch.setenv("QDEBUG_SPILL_MB", "0")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])
    one = numpy_helper.from_array(np.ones(1, np.float32), "one")
    fp32 = helper.make_model(
        helper.make_graph([helper.make_node("Mul", ["x", "one"], ["y"])], "g", [x], [y], [one]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    table = numpy_helper.from_array(np.arange(16, dtype=np.float32), "table")
    nodes = [
        helper.make_node("Cast", ["x"], ["i"], to=TensorProto.INT64),
        helper.make_node("Gather", ["table", "i"], ["g"], axis=0),  # [N, 1] indices -> [N, 1]
        helper.make_node("Identity", ["g"], ["y"]),
    ]
    candidate = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y], [table]), opset_imports=[helper.make_opsetid("", 17)]
    )
    values = (np.arange(48) % 16).astype(np.float32).reshape(48, 1)
    values[3], values[42] = 100, 200  # out of the table's bounds: batch 0 (first half), batch 5 (second half)
    np.savez(tmp_path / "d.npz", x=values)
    ev = Evaluator(fp32, open_data(tmp_path / "d.npz", model_input_specs(fp32), batch_size=8), SessionConfig())
    return ev, candidate


def test_a_sharded_evaluation_fails_with_the_first_error_of_the_whole_set(tmp_path, monkeypatch):
    """Shards failing differently: the error is the first one in sample order -- the one-process run's, for
    any number of workers."""
    ev, candidate = _first_shard_fails_case(tmp_path, monkeypatch)
    with pytest.raises(QDebugError) as whole:
        ev.score(candidate)
    assert "100" in whole.value.one_line()
    with Pool([ev], workers=2, shard_samples=16) as pool:
        out = pool.outcome(pool.submit(ev, candidate))
        assert pool.scored == 2  # two shards, each failing
    assert isinstance(out, QDebugError) and out.one_line() == whole.value.one_line()


def test_a_sharded_hint_asked_for_is_the_same_evaluation(tmp_path, monkeypatch):
    """A speculative sharded evaluation requested for real while its shards run: the same ticket, each
    shard scored once, the whole set's result."""
    ev, candidate, _ = _sharded_case(tmp_path, monkeypatch)
    whole = ev.score(candidate)
    with Pool([ev], workers=2, shard_samples=16) as pool:
        hint = pool.submit(ev, candidate, speculative=True)
        asked = pool.submit(ev, candidate)
        assert asked is hint
        _same_result(pool.result(asked), whole)
        assert pool.scored == 2


class _Ref:
    def __init__(self, value):
        self.value = value


class _FakeRay:
    """Ray's API as the pool uses it, all in this process: ``put`` keeps the bytes it is given (what an
    actor on another machine gets), an actor is an object, a task runs when it is waited for."""

    class exceptions:  # noqa: N801
        class RayActorError(Exception):
            pass

    def is_initialized(self):
        return True

    def cluster_resources(self):
        return {"CPU": 2}

    def put(self, value):
        return _Ref(value)

    def get(self, ref):
        return ref.value

    def remote(self, **_options):
        def actor_class(cls):
            def start(*args):
                actor = cls(*args)

                def call(*a):  # Ray resolves a task's top-level references, not those inside a list
                    return _Ref(actor.score(*[x.value if isinstance(x, _Ref) else x for x in a]))

                return types.SimpleNamespace(score=types.SimpleNamespace(remote=call))

            return types.SimpleNamespace(remote=start)

        return actor_class

    def wait(self, handles, num_returns, timeout):
        return handles[:num_returns], handles[num_returns:]

    def kill(self, actor):
        pass


def test_on_ray_every_part_carries_its_data_and_an_actor_loads_the_part_it_is_given(tmp_path, monkeypatch):
    """Two candidates on two actors, each sharded in two: the second candidate's parts reach the actors the
    other way round, after this machine's spill files are gone -- each actor scores the part it is handed,
    from the object store's copy, and both results are the whole set's."""
    monkeypatch.setitem(sys.modules, "ray", _FakeRay())
    ev, candidate, _ = _sharded_case(tmp_path, monkeypatch)
    other = onnx.ModelProto()
    other.CopyFrom(candidate)
    scale = next(i for i in other.graph.initializer if i.name.endswith("_scale"))
    scale.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(scale) * 2, scale.name))
    want = [ev.score(candidate), ev.score(other)]
    assert want[0].value != want[1].value
    with Pool([ev], ray="auto", workers=2, shard_samples=16) as pool:
        first = pool.score(ev, candidate)
        ev.reference.close()  # type: ignore[attr-defined]
        ev.batches.feeds.close()  # type: ignore[attr-defined]
        second = pool.score(ev, other)
        assert pool.scored == 4
    for got, expected in zip((first, second), want, strict=True):
        _same_result(got, expected)
        np.testing.assert_array_equal(ev.sample_results(got).values, ev.sample_results(expected).values)


def test_a_portable_custom_metric_evaluator_bootstraps_without_this_machines_files(tmp_path, monkeypatch):
    """A custom metric's evaluator goes to a Ray actor whole (it is not cut): its portable copy's FP32 view
    (what the bootstrap resamples) is in memory too."""
    from qdebug.data import model_input_specs, open_data
    from qdebug.evaluation.evaluate import Evaluator
    from qdebug.runtime.capture import SessionConfig

    ev, candidate, fp32 = _sharded_case(tmp_path, monkeypatch)
    metric = tmp_path / "mean_error.py"
    metric.write_text(
        "import numpy as np\n\n"
        "def score(reference, candidate, labels):\n"
        "    return -float(np.mean([np.abs(r[k] - c[k]).mean() for r, c in zip(reference, candidate) for k in r]))\n"
    )
    data = open_data(tmp_path / "d.npz", model_input_specs(fp32), batch_size=8)
    custom = Evaluator(fp32, data, SessionConfig(), f"{metric}:score")
    assert custom.shards(2) == [custom]
    result = custom.score(candidate)
    want = custom.drop_interval(result)
    copy = pickle.loads(pickle.dumps(custom.portable()))
    custom.reference.close()  # type: ignore[attr-defined]
    custom.batches.feeds.close()  # type: ignore[attr-defined]
    again = copy.score(candidate)
    assert again.value == result.value
    np.testing.assert_allclose(copy.drop_interval(again), want, rtol=1e-9)


def test_a_workers_shards_are_never_those_of_another_evaluator_under_the_same_id(tmp_path, monkeypatch):
    """A worker cuts shards once per evaluator; CPython reuses a freed object's id, so an entry left from an
    evaluator of an earlier version must not serve a new one that got its id (it had scored a candidate on
    another evaluator's samples)."""
    from qdebug.runtime import parallel

    ev, _, _ = _sharded_case(tmp_path, monkeypatch)
    other = ev.shards(3)[0]  # another evaluator (16 samples), standing for the freed one
    monkeypatch.setattr(parallel, "_SHARDS", {(id(ev), 2): (other, other.shards(2))})
    part = parallel._shard_of(ev, 0, 2)
    assert part.samples == ev.samples // 2 and [b.origin for b in part.batches] == [
        b.origin for b in ev.shards(2)[0].batches
    ]
