"""The utility study's summary: means and sample std over seeds, never across schedules,
and gaps to exact DP-SGD in points."""

import pathlib
import statistics
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
study = pytest.importorskip("utility_study")


def run(method, eps, seed, acc, steps=100):
    return study.Run("sms", method, eps, seed, 1e-5, noise_multiplier=1.0, steps=steps, accuracy=acc)


def test_summary_groups_seeds_not_schedules():
    runs = [run("exact", 3.0, s, a) for s, a in enumerate((0.90, 0.92, 0.94))]
    runs += [run("hutch", 3.0, s, a) for s, a in enumerate((0.89, 0.91, 0.93))]
    runs += [run("exact", 3.0, 0, 0.50, steps=10), run("nonprivate", None, 0, 0.99)]
    rows = study.summarize(runs)
    exact = [r for r in rows if r["method"] == "exact" and r["steps"] == 100][0]
    assert exact["seeds"] == 3 and exact["mean"] == pytest.approx(0.92)
    assert exact["std"] == pytest.approx(statistics.stdev([0.90, 0.92, 0.94]))
    assert [r["mean"] for r in rows if r["steps"] == 10] == [0.50]  # the short run stays apart
    table = study.comparison_table(rows, {"sms": 0.874})
    line = [l for l in table.splitlines() if l.startswith("| sms | 100 | 3 |")][0]
    assert "| -1.00 |" in line and "0.9900 (1)" in line and line.endswith("0.8740 |")


@pytest.mark.parametrize("n,batch", [(3869, 256), (398, 32), (398, 128), (64, 16)])
def test_noise_is_calibrated_for_the_rate_opacus_samples_at(n, batch):
    """The study's calibration rate equals the sample rate Opacus's Poisson loader uses
    (an independent computation: DPDataLoader built from the same loader), so the spent
    epsilon equals the target instead of falling below it."""
    import torch
    from opacus.data_loader import DPDataLoader

    data = torch.utils.data.TensorDataset(torch.zeros(n, 1))
    loader = DPDataLoader.from_data_loader(torch.utils.data.DataLoader(data, batch_size=batch))
    q, steps = study.planned_steps(n, dict(batch=batch, epochs=10), None)
    assert q == pytest.approx(loader.sample_rate, rel=1e-12)
    assert steps == round(10 / loader.sample_rate)
