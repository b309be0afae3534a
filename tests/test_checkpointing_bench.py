"""benchmarks/checkpointing.py: the meta-device count of a checkpointed step is the CPU
count, checkpointing lowers the peak, the analysis helpers (slopes, crossover) do what
they say. Tiny shapes: seconds."""

import math

import pytest

from benchmarks import checkpointing as C

TINY = dict(d_model=64, n_layers=2, vocab=128)


def tiny(seq_len):
    return C.default_shape(seq_len, **TINY)


@pytest.mark.parametrize("config", ["nonprivate_ckpt", "ghost_ckpt", "randomized_ckpt", "randomized_bk_ckpt"])
def test_meta_count_equals_cpu_count(config):
    """The meta patches (flash attention kernel, packed-sequence check, finite decision)
    change no allocation: the counted peak of a real CPU step is the meta one."""
    shape = tiny(96)
    meta = C.measure_peak(config, shape, "meta", freeze_embedding=True)
    cpu = C.measure_peak(config, shape, "cpu", freeze_embedding=True)
    assert meta["peak_bytes"] == cpu["peak_bytes"] > 0
    assert meta["norm_peak_bytes"] == cpu["norm_peak_bytes"]


def test_meta_patches_are_undone():
    import torch.nn.functional as F
    import transformers.masking_utils as masking

    import opacus_rc.optimizer as O

    before = (F.scaled_dot_product_attention, masking.find_packed_sequence_indices,
              O.RandomizedClippingMixin._decide_finite)
    with C.meta_patches():
        assert F.scaled_dot_product_attention is not before[0]
    assert (F.scaled_dot_product_attention, masking.find_packed_sequence_indices,
            O.RandomizedClippingMixin._decide_finite) == before


def test_checkpointing_lowers_the_step_and_norm_terms_scale_as_stated():
    rows = C.sweep([256, 512], ["nonprivate", "nonprivate_ckpt", "ghost_ckpt", "randomized_ckpt"],
                   progress=False, **TINY)
    peak = {(r["config"], r["seq_len"]): r for r in rows}
    for t in (256, 512):
        assert peak[("nonprivate_ckpt", t)]["peak_bytes"] < peak[("nonprivate", t)]["peak_bytes"]
        # randomized's norm term is far below ghost's T x T matrices
        assert peak[("randomized_ckpt", t)]["norm_peak_bytes"] * 4 < peak[("ghost_ckpt", t)]["norm_peak_bytes"]
    ghost = peak[("ghost_ckpt", 512)]["norm_peak_bytes"] / peak[("ghost_ckpt", 256)]["norm_peak_bytes"]
    sketch = peak[("randomized_ckpt", 512)]["norm_peak_bytes"] / peak[("randomized_ckpt", 256)]["norm_peak_bytes"]
    assert ghost == pytest.approx(4.0, rel=0.05)  # T²
    assert sketch <= 2.0  # at most linear
    assert peak[("nonprivate", 512)]["norm_peak_bytes"] is None


def test_slopes_and_crossover_on_known_curves():
    a, b, c = 1e6, 300.0, 0.1
    rows = []
    for t in (1024, 2048, 4096, 8192, 16384):
        rows.append({"config": "nonprivate_ckpt", "seq_len": t, "peak_bytes": a + b * t, "norm_peak_bytes": None})
        rows.append({"config": "ghost_ckpt", "seq_len": t, "peak_bytes": a + b * t + c * t * t,
                     "norm_peak_bytes": c * t * t})
    x = C.crossover(rows)
    t_star = (b + math.sqrt(b * b + 4 * c * a)) / (2 * c)
    assert x["t_fit"] == pytest.approx(t_star, rel=1e-9)
    assert c * x["t_fit"] ** 2 == pytest.approx(a + b * x["t_fit"], rel=1e-9)
    assert x["first_measured_t"] == min(t for t in (1024, 2048, 4096, 8192, 16384) if c * t * t > a + b * t)
    fits = C.slopes(rows)
    assert fits["ghost_ckpt"]["loglog_slope_last"] > fits["nonprivate_ckpt"]["loglog_slope_last"]
    assert 1.5 < fits["ghost_ckpt"]["loglog_slope_last"] <= 2.0
    assert fits["nonprivate_ckpt"]["bytes_per_token"] == pytest.approx(b)
    ratio = {(r["config"], r["seq_len"]): r["ratio"] for r in C.ratios(rows)}
    assert ratio[("nonprivate_ckpt", 1024)] == 1.0 and ratio[("ghost_ckpt", 16384)] > 1.0


def test_cli_writes_json_and_plot(tmp_path):
    import json

    out, png = tmp_path / "c.json", tmp_path / "c.png"
    C.main(["--seq-lens", "128,256", "--d-model", "64", "--layers", "2", "--vocab", "128",
            "--configs", "nonprivate_ckpt,ghost_ckpt,randomized_ckpt", "--no-progress",
            "--json", str(out), "--plot", str(png)])
    record = json.loads(out.read_text())
    assert {r["config"] for r in record["rows"]} == {"nonprivate_ckpt", "ghost_ckpt", "randomized_ckpt"}
    assert record["model"]["checkpointing"].endswith("reentrant")
    assert png.stat().st_size > 1000
    with pytest.raises(SystemExit):
        C.main(["--configs", "nonsense"])


def test_interleaved_times_rotate_and_ratio():
    x = C.interleaved_times(64, ["nonprivate_ckpt", "randomized_ckpt"], reps=2, **TINY)
    assert all(len(v) == 2 and min(v) > 0 for v in x["times_s"].values())
    assert x["ratio_to_nonprivate_ckpt"]["nonprivate_ckpt"] == 1.0
