"""The utility study's summary: means and sample std over seeds, never across schedules,
and gaps to exact DP-SGD in points."""

import pathlib
import statistics
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import utility_study as study  # noqa: E402


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


def test_recipe_tail_per_dataset_and_override():
    """Short texts fully fine-tune the top layer; the 512-token speeches train LoRA factors
    (docs/utility.md: with the full layer the body's per-sample norm takes ~92% of the
    clipping budget); --tail overrides either."""
    args = study.parse_args([])
    assert study.recipe("sms", args)["tail"] == "full"
    assert study.recipe("speeches", args)["tail"] == "lora"
    assert study.recipe("speeches", study.parse_args(["--tail", "full"]))["tail"] == "full"
    with pytest.raises(SystemExit):
        study.parse_args(["--tail", "adapter"])


def test_lora_tail_trains_only_factors_and_head_and_starts_as_the_pretrained_layer():
    import torch

    from examples.models import minilm

    _, encoder = minilm.load_encoder()
    full = minilm.build_tail(encoder, 1, mode="full", seed=0).eval()
    lora = minilm.build_tail(encoder, 1, mode="lora", rank=8, seed=0).eval()
    trainable = {n: p.numel() for n, p in lora.named_parameters() if p.requires_grad}
    assert all("lora_" in n or n.startswith("head.") for n in trainable)
    # query and value: A (8 x 384) and B (384 x 8) each, plus the 384 x 2 head and its bias
    assert sum(trainable.values()) == 2 * (8 * 384 + 384 * 8) + 384 * 2 + 2
    g = torch.Generator().manual_seed(0)
    h, m = torch.randn(2, 16, 384, generator=g), torch.ones(2, 16)
    with torch.no_grad():
        full.head.weight.normal_(generator=g)
        lora.head.weight.copy_(full.head.weight)
        torch.testing.assert_close(lora(h, m), full(h, m))  # LoRA's B starts at zero


def test_probe_grid_learns_and_charges_the_loader_rate():
    """The proxy grid's DP linear probe (Opacus, make_private_with_epsilon) learns a separable
    task (majority ~0.5; a clean linear rule at eps=8 with 300 examples reaches > 0.9) and its
    noise multiplier is Opacus's calibration for q = 1/len(loader) and the epochs run."""
    import torch
    from opacus.accountants.utils import get_noise_multiplier

    import probe_grid as pg
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 8, generator=g)
    y = (x[:, 0] > 0).long()
    rows = pg.grid((x[:300], y[:300]), (x[300:], y[300:]), [8.0], [(50, 5)], [0.1], [1.0], [0, 1], 1e-5,
                   progress=False)
    assert rows[0]["mean"] > 0.9
    sigma = get_noise_multiplier(target_epsilon=8.0, target_delta=1e-5, sample_rate=1 / 6, epochs=5,
                                 accountant="prv")
    assert rows[0]["noise_multiplier"] == pytest.approx(sigma)
    assert "**" in pg.table(rows, 0.5).splitlines()[2]  # the best point of its epsilon is marked


def test_probe_grid_steps_through_empty_poisson_batches_and_rejects_bad_eps():
    """Batch 1 of 100 examples: each step's Poisson batch is empty with probability
    (1 - 1/100)^100 ~ 0.37, so an epoch has ~37 empty steps; they must be taken (Opacus
    charges them) rather than crash the optimizer."""
    import torch

    import probe_grid as pg
    x = torch.randn(100, 4, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    rows = pg.grid((x, y), (x, y), [8.0], [(1, 1)], [0.1], [1.0], [0], 1e-5, progress=False)
    assert 0.0 <= rows[0]["mean"] <= 1.0 and rows[0]["noise_multiplier"] > 0
    with pytest.raises(SystemExit):
        pg.parse_args(["--eps", "1,-3"])
