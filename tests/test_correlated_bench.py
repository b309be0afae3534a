"""Smoke test of ``python -m benchmarks.correlated_noise`` at its tiny size: the JSON holds
every task, both noises, the chosen b, the cost rows, and finite values (utility itself is
measured, never asserted). The MiniLM features come from a cache of random vectors written
here, so the encoder never runs; the texts come from the offline data packages."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]  # python -m benchmarks.correlated_noise runs from here
TASKS = {"sms", "rt_user", "lm"}


def fake_feature_cache(folder: pathlib.Path) -> None:
    """The pooled-feature caches the benchmark reads (``benchmarks.user_level.pooled_features``'s
    format), random unit-free vectors for more rows than either data set has."""
    rows = 13_000  # SMS spam: 4,837 rows; Rotten Tomatoes: 12,808
    features = torch.randn(rows, 384, generator=torch.Generator().manual_seed(0))
    for name in ("sms", "rt"):
        torch.save({"max_len": 64, "rows": torch.arange(rows), "features": features},
                   folder / f"{name}_minilm_pooled_64.pt")


def test_tiny_run_writes_every_task_both_noises_and_finite_values(tmp_path):
    fake_feature_cache(tmp_path)
    out = tmp_path / "correlated.json"
    cmd = [sys.executable, "-m", "benchmarks.correlated_noise", "--size", "tiny", "--cache-dir", str(tmp_path),
           "--no-rss", "--no-progress", "--threads", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert "| task (test metric) |" in proc.stdout and "| noise | b |" in proc.stdout

    assert set(record["tasks"]) == TASKS
    runs = record["runs"]
    assert {(r["task"], r["noise"], r["bands"]) for r in runs} == {
        (t, n, b) for t in TASKS for n, b in (("independent", 1), ("banded", 2))}
    for r in runs:
        for key in ("sigma", "epsilon", "val", "test", "prefix_noise", "seconds_per_step", "charged_rate"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["task"], key, r[key])
        assert r["epsilon"] <= r["target_epsilon"] * 1.001  # the engine's report meets the calibration
        assert r["steps"] >= r["epoch_draws"] >= r["bands"]
        # b - 1 kept noise vectors of the trainable parameters (float32)
        assert r["buffer_bytes"] == (r["bands"] - 1) * r["param_bytes"]
        if r["noise"] == "banded":  # the accountant charges the rate inside a part: b times the overall rate
            ind = [i for i in runs if (i["task"], i["seed"], i["noise"]) == (r["task"], r["seed"], "independent")][0]
            assert math.isclose(r["charged_rate"], r["bands"] * ind["charged_rate"], rel_tol=1e-9)

    assert {(b["task"], b["bands"]) for b in record["best_bands"]} == {(t, 2) for t in TASKS}
    assert {c["task"] for c in record["comparison"]} == TASKS
    assert all(math.isfinite(c["gain"]) for c in record["comparison"])
    assert {(s["task"], s["bands"]) for s in record["summary"]} == {(t, b) for t in TASKS for b in (1, 2)}

    times = {r["bands"]: r for r in record["cost"]["times"]}
    assert set(times) == {1, 2}
    assert all(r["step_s"] > 0 and r["optimizer_step_s"] > 0 and r["noise_s"] > 0 for r in times.values())
    assert times[1]["buffer_bytes"] == 0
    assert times[2]["buffer_bytes"] == times[2]["expected_buffer_bytes"] == times[2]["param_bytes"] > 0
