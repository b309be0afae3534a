"""Smoke test of ``python -m benchmarks`` at a tiny size, plus the closed-form checks
of its per-layer counts (performance itself is measured, never asserted)."""

from __future__ import annotations

import collections
import json
import pathlib
import subprocess
import sys

import pytest
import torch

from benchmarks.layers import LayerCase, linear_fit, loglog_slope, measure_layer

ROOT = pathlib.Path(__file__).resolve().parents[1]  # python -m benchmarks runs from the repository root
CONFIGS = {"nonprivate", "hooks", "ghost", "randomized", "randomized_bk", "randomized_bk_ghost"}


def test_entry_point_writes_valid_json(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, "-m", "benchmarks",
        "--layer-shapes", "64x128", "--layer-seq-lens", "64,128,256",
        "--layer-time-shapes", "", "--layer-time-seq-lens", "",
        "--step-shapes", "48:32:2,llama:48:64:2", "--reps", "1", "--threads", "1",
        "--no-rss", "--no-progress", "--json", str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert "Per step" in proc.stdout and "Targets" in proc.stdout
    assert {r["method"] for r in record["layers"]} == {"ghost", "fgc", "hutchinson", "hutchpp"}
    assert len(record["layers"]) == 4 * 3
    assert {r["config"] for r in record["steps"]} == CONFIGS
    assert {r["shape"] for r in record["steps"]} == {"T=48,d=32,b=2", "llama T=48,d=64,b=2"}
    for r in record["steps"]:
        assert r["time_s"] > 0 and r["peak_bytes"] > 0
        if r["config"] in ("ghost", "randomized"):
            # both passes and the norm computation were timed inside the step
            assert {"backward1", "backward2", "norms"} <= set(r["phases_s"])
    base = [r for r in record["step_ratios"] if r["config"] == "nonprivate"]
    assert base and base[0]["time_ratio"] == pytest.approx(1.0)
    # ghost's O(T^2) memory has slope 2 in T; Hutchinson's is at most linear
    slopes = {f["method"]: f["slope_loglog"] for f in record["layer_fits"]}
    assert slopes["ghost"] == pytest.approx(2.0, abs=0.05)
    assert slopes["hutchinson"] <= 1.05


@pytest.mark.parametrize("d,p", [(64, 256), (256, 64)])
def test_layer_flops_match_closed_forms(d, p):
    """FlopCounterMode on the meta device against the operation counts of the formulas:
    ghost 2 B T^2 (d + p) plus 2 B T^2 for <A A^T, G G^T> (an einsum, counted as a batched
    product), FGC 2 B T d p, Hutchinson 2 B T k (d + p)."""
    b, t, k = 2, 96, 8
    flops = {
        m: measure_layer(LayerCase(m, d, p, t, b, k)).flops
        for m in ("ghost", "fgc", "hutchinson")
    }
    assert flops["ghost"] == 2 * b * t * t * (d + p) + 2 * b * t * t
    assert flops["fgc"] == 2 * b * t * d * p
    assert flops["hutchinson"] == 2 * b * t * k * (d + p)


def test_layer_memory_matches_closed_forms():
    """Peak extra bytes (float32): ghost holds both T x T Gram matrices; Hutchinson holds
    G P (B T k), the (B min(d,p) k) product and the sketch (max(d,p) k) at most."""
    b, t, d, p, k = 2, 128, 64, 256, 8
    ghost = measure_layer(LayerCase("ghost", d, p, t, b, k)).peak_bytes
    hutch = measure_layer(LayerCase("hutchinson", d, p, t, b, k)).peak_bytes
    assert ghost >= 2 * b * t * t * 4
    assert hutch <= 4 * (b * t * k + b * min(d, p) * k + max(d, p) * k) + 4 * b * 4


def test_fits():
    xs = [1.0, 2.0, 4.0, 8.0]
    assert loglog_slope(xs, [3 * x**2 for x in xs]) == pytest.approx(2.0)
    a, b, worst = linear_fit(xs, [5 + 2 * x for x in xs])
    assert (a, b) == (pytest.approx(5.0), pytest.approx(2.0)) and worst < 1e-12
    with pytest.raises(ValueError, match="distinct"):
        loglog_slope([2.0, 2.0], [1.0, 2.0])


def test_bad_arguments_are_refused():
    from benchmarks.__main__ import parse_args
    from benchmarks.steps import StepShape

    with pytest.raises(ValueError, match="T:d:batch"):
        StepShape.parse("2048x512")
    with pytest.raises(ValueError, match="unknown model 'gpt'"):
        StepShape.parse("gpt:2048:512:1")
    assert StepShape.parse("llama:2048:512:1") == StepShape(2048, 512, 1, arch="llama")
    assert StepShape.parse(StepShape(64, 32, 2, arch="llama").spec).arch == "llama"
    with pytest.raises(SystemExit):
        parse_args(["--configs", "ghost,randomized"])  # non-private baseline required
    with pytest.raises(ValueError, match="method"):
        measure_layer(LayerCase("exact", 8, 8, 8))


def test_user_level_cost_smoke():
    """benchmarks.user_level_cost at a tiny size: one row per configuration and form, and
    the per-example form's user-level memory exceeds example level's by at most one
    gradient-sized buffer (peak live bytes are counted, not timed)."""
    from benchmarks import user_level_cost

    threads = torch.get_num_threads()
    try:
        record = user_level_cost.main(["--rows", "1,3", "--tokens", "8", "--reps", "1", "--threads", "1", "--no-progress"])
    finally:
        torch.set_num_threads(threads)
    assert {(r["form"], r["rows"]) for r in record["ratios"]} == {(f, m) for f in ("per_example", "bookkeeping") for m in (1, 3)}
    for r in record["ratios"]:
        assert r["time_ratio"] > 0 and r["peak_example"] > 0
        if r["form"] == "per_example":
            assert r["extra_buffers"] <= 1.0 + 1e-3


def _user_level_data(movies: int = 12, seed: int = 0):
    from benchmarks.user_level import Data

    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 7, (movies,), generator=g).tolist()
    owner = [m for m, n in enumerate(counts) for _ in range(n)]
    x = torch.nn.functional.normalize(torch.randn(len(owner), 8, generator=g), dim=1)
    y = (x[:, 0] > 0).long()
    test = [r for r, m in enumerate(owner) if m >= movies - 3]
    train = [r for r, m in enumerate(owner) if m < movies - 3]
    return Data(x[train], y[train], [owner[r] for r in train], x[test], y[test], [owner[r] for r in test])


def test_user_level_arms_meet_the_same_per_person_epsilon():
    """benchmarks.user_level's private arms on random features (no MiniLM): each engine
    reports at most the target per person (user level: get_epsilon; example level: the
    group report for K_max or k rows), and the cut arm keeps at most k rows per movie."""
    import argparse

    from benchmarks.user_level import cut_rows, run_arm

    data = _user_level_data()
    args = argparse.Namespace(users_per_step=3, k=2, user_epochs=2.0, lr=0.05, clip=0.5, delta=1e-5, progress=False)
    for arm in ("user", "example_kmax", "example_k", "nonprivate"):
        r = run_arm(arm, 8.0, 0, data, args)
        assert 0.0 <= r.accuracy <= 1.0 and r.steps == int(2.0 / (3 / 9))
        if arm != "nonprivate":
            assert r.epsilon <= 8.0 + 1e-6 and r.sigma > 0
    assert r.group_size is None
    kept = cut_rows(data.movie_train, 2)
    assert max(collections.Counter(data.movie_train[i] for i in kept).values()) <= 2


def test_user_level_split_is_by_movie():
    from benchmarks.user_level import movie_split

    movies = [f"m{i % 10}" for i in range(57)]
    train, test, index = movie_split(movies, None)
    assert not {movies[r] for r in train} & {movies[r] for r in test}
    assert sorted(train + test) == list(range(57)) and len({movies[r] for r in test}) == 2
    assert len({index[r] for r in train}) == 8


def test_revisions_entry_point_runs_two_revisions_side_by_side(tmp_path):
    """``python -m benchmarks.revisions`` at a tiny size: HEAD against the work tree, each
    worker under its own copy of opacus_rc."""
    out = tmp_path / "revisions.json"
    cmd = [
        sys.executable, "-m", "benchmarks.revisions", "--old", "HEAD", "--shape", "48:32:2",
        "--rounds", "2", "--warmup", "0", "--no-progress", "--json", str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert "new / old (cpu)" in proc.stdout
    for name in ("old", "new"):
        assert len(record[name]["rounds"]) == 2 and record[name]["cpu"]["ratio"] > 0 and record[name]["wall"]["ratio"] > 0
        assert f"/{name}/opacus_rc/" in record[name]["opacus_rc"]
    assert record["new"]["label"].startswith("WORKTREE")


def test_identity_paths_reports_the_fixed_figures(tmp_path):
    """``benchmarks/identity_paths.py`` on this checkout: no other user moves when one is added in
    front, the sorting collate equals brute force, no kept vector in a default checkpoint, and
    the GPU-style loops train (issue 52's figures, docs/results/identity_paths_after.json)."""
    out = tmp_path / "identity.json"
    proc = subprocess.run([sys.executable, "benchmarks/identity_paths.py", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["added_user_max_move_in_C"] == 0.0 and figures["added_row"]["mu"] < 0.25
    assert figures["sorting_collate_max_error_in_C"] < 1e-4 and figures["kept_vectors_in_default_checkpoint"] == 0
    assert all(figures[k] == "trained" for k in figures if k.startswith(("device_copy", "batch_encoding", "transform")))
