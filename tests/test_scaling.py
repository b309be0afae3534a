"""Half-precision sketch arithmetic promoted chunk by chunk (not whole), and the Llama-3-8B
per-GPU memory model of docs/scaling.md (python -m benchmarks.scaling)."""

import pytest
import torch

import opacus_rc.estimators as E
from benchmarks import scaling


@pytest.mark.parametrize("estimator", ["hutchinson", "hutchpp"])
@pytest.mark.parametrize("side", ["auto", "input", "output"])
@pytest.mark.parametrize("per_example", [False, True])
def test_chunked_promotion_equals_whole_promotion(monkeypatch, estimator, side, per_example):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 50, 24, generator=gen).bfloat16()
    g = torch.randn(3, 50, 40, generator=gen).bfloat16()
    rows = 40 if E.sketch_side(24, 40, side) == "output" else 24
    shape = (3, rows, 8) if per_example else (rows, 8)
    tail = torch.randn(shape, generator=gen) / 8**0.5
    head = torch.randn(shape, generator=gen)

    def estimate(x, y):
        if estimator == "hutchinson":
            return E.hutchinson_sq_norms(x, y, tail, side)
        return E.hutchpp_sq_norms(x, y, head, tail, side)

    whole = estimate(a.float(), g.float())  # float32 inputs: the unchunked path
    monkeypatch.setattr(E, "PROMOTION_CHUNK_ELEMENTS", 7 * 64)  # 7 positions per chunk
    chunked = estimate(a, g)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=0)


def test_float32_path_is_the_formula():
    gen = torch.Generator().manual_seed(1)
    a, g = torch.randn(2, 30, 16, generator=gen), torch.randn(2, 30, 48, generator=gen)
    p = torch.randn(48, 8, generator=gen)
    expected = (a.transpose(1, 2) @ (g @ p)).pow(2).sum(dim=(1, 2))
    assert torch.equal(E.hutchinson_sq_norms(a, g, p, "output"), expected)


def test_lm_head_norm_memory_stays_small():
    """Counted on the meta device at the Llama-3 LM head (4096 -> 128256), T = 32768, bf16:
    the sketch never holds the (T x vocab) gradient in float32 (16.8 GB); ghost holds a
    (T x T) float32 matrix (4.3 GB)."""
    t = 32768
    randomized = scaling.norm_peak_bytes("hutchinson", 4096, 128256, t)
    ghost = scaling.norm_peak_bytes("ghost", 4096, 128256, t)
    assert randomized < 0.2e9
    assert ghost >= t * t * 4


def test_memory_model_arithmetic():
    shape = scaling.LLAMA3_8B
    assert shape.params() == pytest.approx(8.03e9, rel=1e-3)
    model = scaling.memory_model(shape, 1000, 8)
    assert model["state"] == 16 * shape.params() // 8
    per_token = 32 * 2 * (6 * 4096 + 2 * 1024 + 4 * 14336) + 4 * 128256
    assert model["activations"] == 1000 * per_token
    r = scaling.row("ghost", shape, 1024, 8)
    assert r.step_bytes == r.norm_bytes + r.state_bytes + r.buffer_bytes + r.activation_bytes
