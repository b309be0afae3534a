"""scripts/gpu_bench.sh: its CPU form runs every mode (CI), and without CUDA the GPU form
says so in one line and exits non-zero."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_bench.sh"


def test_tiny_cpu_form_runs_every_mode(tmp_path):
    """Every mode, the checkpointed ones (reentrant) included, and the chunked LM head's
    (several blocks at T = 128): its loss is the whole head's, and it adds no operation that
    makes the host wait."""
    out = tmp_path / "gpu_bench.json"
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--device", "cpu", "--tiny", "--steps", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    from benchmarks import gpu

    bf16 = [r for r in record["results"] if r["params"] == "bfloat16"]
    results = [r for r in record["results"] if r["params"] == "float32"]
    assert {r["mode"] for r in results} == {
        "nonprivate", "opacus_hooks", "opacus_ghost", "randomized", "randomized_bk",
        "nonprivate_ckpt", "opacus_ghost_ckpt", "randomized_ckpt",
        "nonprivate_ckpt_chunked", "randomized_ckpt_chunked", "per_example_ckpt_chunked", "per_example_ckpt",
    }
    assert {r["seq_len"] for r in results} == {64, 128}
    assert all(r["status"] == "ok" and r["median_step_s"] > 0 for r in results)
    ckpt = [r for r in results if r["checkpointing"] is not None]
    assert {r["mode"] for r in ckpt} == set(gpu.CKPT_MODES)
    assert len(ckpt) == 7 and all(r["checkpointing"] == "reentrant" and r["seq_len"] == 128 for r in ckpt)
    by_mode = {r["mode"]: r["syncing_ops_per_step"] for r in ckpt}
    assert by_mode["randomized_ckpt"] == by_mode["nonprivate_ckpt"], by_mode
    assert by_mode["randomized_ckpt_chunked"] == by_mode["nonprivate_ckpt_chunked"] == by_mode["nonprivate_ckpt"]
    # the per-example form: its clip is one norm over p.grad, decided on the device
    assert by_mode["per_example_ckpt"] == by_mode["per_example_ckpt_chunked"] == by_mode["nonprivate_ckpt"]
    rec = {r["mode"]: r for r in ckpt}
    assert record["chunked_head"]["block_size"] == 32
    for mode in gpu.CHUNKED_MODES:
        assert rec[mode]["head"] == "chunked" and rec[mode]["block_size"] == 32
        # the same model and tokens: the chunked head's loss is the whole head's (bf16 rounding)
        assert rec[mode]["warmup_loss"] == pytest.approx(rec["nonprivate_ckpt"]["warmup_loss"], rel=1e-2)
    assert all(rec[m]["head"] == "whole" for m in ("nonprivate_ckpt", "randomized_ckpt", "per_example_ckpt", "opacus_ghost_ckpt"))
    # the bf16 case (issue 48): the same modes on the model converted to bf16 run, their loss
    # the float32 model's (bf16 rounding of the weights: a few 2^-8)
    assert record["bf16_params"] == list(gpu.BF16_PARAM_MODES)
    assert {r["mode"] for r in bf16} == set(gpu.BF16_PARAM_MODES) and all(r["status"] == "ok" for r in bf16)
    for r in bf16:
        assert r["warmup_loss"] == pytest.approx(rec[r["mode"]]["warmup_loss"], rel=2e-2)
    # randomized clipping adds no operation that makes the host wait: its modes see
    # exactly the syncing operations of non-private training (the model's own)
    for t in (64, 128):
        by_mode = {r["mode"]: r["syncing_ops_per_step"] for r in results if r["seq_len"] == t}
        assert by_mode["randomized"] == by_mode["randomized_bk"] == by_mode["nonprivate"], by_mode


def test_schedule_and_time_prediction():
    from benchmarks import gpu

    order = gpu.schedule(gpu.MODES, [4096, 16384, 65536], [16384, 65536, 131072])
    assert [t for t, _ in order] == sorted(t for t, _ in order)
    assert {m for t, m in order if t == 131072} == set(gpu.CKPT_MODES)
    # at the longest T the chunked head runs first, Opacus ghost (out of memory there) last
    at_longest = [m for t, m in order if t == 131072]
    assert at_longest[:3] == list(gpu.CHUNKED_MODES) and at_longest[-1] == "opacus_ghost_ckpt"
    assert {m for t, m in order if t == 4096} == set(gpu.PLAIN_MODES)
    assert len(order) == 3 * len(gpu.PLAIN_MODES) + 3 * len(gpu.CKPT_MODES)
    assert gpu.predicted_seconds(None, 131072, 3) == 0.0
    assert gpu.predicted_seconds((65536, 2.0), 131072, 3) == pytest.approx(3 * 2.0 * 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_one_line_and_non_zero_exit(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0
    assert len(proc.stdout.strip().splitlines()) == 1 and "CUDA" in proc.stdout
    assert not (tmp_path / "x.json").exists()


def test_deferred_linear_under_bf16_autocast_matches_nn_linear():
    """The linear layers whose weight gradient randomized clipping defers run under bf16
    autocast (the GPU benchmark's setting) and give nn.Linear's gradients."""
    from torch import nn

    from opacus_rc.grad_sample import linear_forward_deferring_weight_grad

    torch.manual_seed(0)
    layer, reference = nn.Linear(8, 4), nn.Linear(8, 4)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(2, 5, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear_forward_deferring_weight_grad(layer, x, wanted=lambda: True)
        y_ref = reference(x_ref)
    y.float().pow(2).sum().backward()
    y_ref.float().pow(2).sum().backward()
    assert y.dtype == y_ref.dtype == torch.bfloat16
    for got, want in ((layer.weight.grad, reference.weight.grad), (layer.bias.grad, reference.bias.grad),
                      (x.grad, x_ref.grad)):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want)


def test_host_sync_counter_sees_value_reads_and_data_dependent_shapes():
    """The counter behind the sync tests: each operation that makes a CUDA host wait is
    counted once, device-side arithmetic is not (so an empty count means something)."""
    from benchmarks.host_sync import HostSyncCounter

    t = torch.tensor([0.5, -1.0, 2.0])
    waits = [
        lambda: t.sum().item(), lambda: bool((t > 0).all()), lambda: t.nonzero(),
        lambda: torch.unique(t), lambda: t[t > 0], lambda: t.masked_select(t > 0),
    ]
    for fn in waits:
        with HostSyncCounter() as syncs:
            fn()
        assert syncs.count == 1, (fn, syncs.where)
        assert "test_gpu_bench.py" in syncs.where[0]
    with HostSyncCounter() as syncs:
        (t * 2).clamp(min=0).isfinite().all()
        t.sort()
        torch.where(t > 0, t, 0.0).cumsum(0)
    assert syncs.where == []
