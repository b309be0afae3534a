"""The README's first Python block runs as pasted, in a fresh interpreter, and really learns."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def first_python_block() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"```python\n(.*?)```", text, flags=re.S)
    assert match, "README.md has no ```python block"
    return match.group(1)


def test_readme_quickstart_runs_as_pasted(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(first_python_block())
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    match = re.search(r"accuracy (\d+\.\d+) \(chance: 0.5\), epsilon (\d+\.\d+)", out.stdout)
    assert match, out.stdout
    accuracy, epsilon = map(float, match.groups())
    # the classes differ in half their tokens: 48 noisy steps reach 1.00 (measured 3 of 3 runs);
    # 0.9 is far above chance (0.5 +- 0.016 on 1,024 rows)
    assert accuracy > 0.9, accuracy
    assert 0.5 < epsilon < 20, epsilon
