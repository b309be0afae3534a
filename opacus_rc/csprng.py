"""A vectorised cryptographically secure random source for secure mode.

Every secret random draw of a secure run (noise, sketches, Poisson batch masks) comes from
one :class:`CSPRNG`: the keystream of AES-256 in counter mode (or ChaCha20) from the
``cryptography`` package (OpenSSL), under a 256-bit key read from ``os.urandom``. Each
call starts a fresh counter block (``IV = call index || 0``, or a fresh ChaCha20 nonce),
so no keystream byte is ever used twice; the key is drawn again in a forked child, so a
child never replays its parent's stream. No pseudo-random generator of torch or numpy is
involved, and ``torchcsprng`` is not needed.

The keystream's 64-bit words give 53-bit uniforms, Bernoulli masks (``k < ceil(p 2^53)``)
and Box-Muller normals in float64, vectorised in torch; secure noise keeps Opacus's guard
against floating-point attacks, the halved sum of four independent normals (four 53-bit
uniforms per output). Derivations: docs/maths.md ("Secure mode's random numbers").

The generator refuses to be pickled, copied or put in a state_dict, and its repr shows no
key: a copy would replay the noise, and a stored key would let anyone regenerate it.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import threading
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from opacus.data_loader import DPDataLoader, dtype_safe, shape_safe, wrap_collate_with_empty
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data._utils.collate import default_collate

logger = logging.getLogger(__name__)

CIPHERS = ("aes-256-ctr", "chacha20")
_MASK53 = (1 << 53) - 1
_TWO_PI = 2.0 * math.pi
_SUBCHUNK_BYTES = 1 << 16  # keystream written per cipher call (the zero input is this long)
_MAX_BYTES_PER_NONCE = 1 << 30  # fresh nonce at least every GiB (ChaCha20: 32-bit counter)
_CPU_CHUNK = 1 << 15  # outputs per chunk on the CPU: the float64 work stays in L2 cache
_CUDA_CHUNK = 1 << 22  # outputs per chunk on a GPU: the keystream is shipped in large pieces
_ZEROS = bytes(_SUBCHUNK_BYTES)

ShapeLike = Union[int, Sequence[int], torch.Size]


class SecretStateError(TypeError):
    """Raised on any attempt to serialise or copy a :class:`CSPRNG`."""


def _shape(shape: ShapeLike) -> Tuple[int, ...]:
    if isinstance(shape, int):
        return (shape,)
    return tuple(int(s) for s in shape)


class CSPRNG:
    """Cryptographically secure generator: a cipher keystream under a key from ``os.urandom``.

    Args:
        cipher: ``"aes-256-ctr"`` (default; hardware AES on x86-64 and ARMv8) or
            ``"chacha20"``.

    The key never leaves the object: pickling, copying, ``state_dict()`` and
    ``load_state_dict()`` raise :class:`SecretStateError` (a ``TypeError``), and the repr
    shows the cipher only. Thread-safe: each call reserves its own nonce under a lock.
    """

    def __init__(self, cipher: str = "aes-256-ctr") -> None:
        if cipher not in CIPHERS:
            raise ValueError(
                f"cipher={cipher!r} is invalid; accepted values: "
                f"{', '.join(repr(c) for c in CIPHERS)}"
            )
        self._cipher = cipher
        self._lock = threading.Lock()
        self._rekey()

    def _rekey(self) -> None:
        self.__key = os.urandom(32)
        self._calls = 0
        self._pid = os.getpid()

    def _next_cipher(self):
        """A fresh encryptor: a nonce (call index) never used before with this key."""
        with self._lock:
            if os.getpid() != self._pid:  # forked child: never replay the parent's stream
                self._rekey()
            self._calls += 1
            index = self._calls
        if self._cipher == "aes-256-ctr":
            # 128-bit big-endian counter block: call index in the high 64 bits, the low 64
            # bits count the blocks of this call (< 2^64), so calls never overlap.
            mode = modes.CTR(index.to_bytes(8, "big") + bytes(8))
            return Cipher(algorithms.AES(self.__key), mode).encryptor()
        # RFC 7539 layout: 32-bit little-endian block counter, then a 96-bit nonce.
        nonce = bytes(4) + index.to_bytes(12, "little")
        return Cipher(algorithms.ChaCha20(self.__key, nonce), None).encryptor()

    def stream(self) -> "KeyStream":
        """A fresh keystream (new nonce) to read in pieces with :meth:`KeyStream.fill_`."""
        return KeyStream(self)

    def fill_(self, buffer: Union[bytearray, memoryview]) -> None:
        """Overwrite a writable buffer with fresh keystream bytes (encrypting zeros)."""
        self.stream().fill_(buffer)

    def random_bytes(self, n: int) -> bytes:
        """``n`` fresh keystream bytes."""
        buf = bytearray(n)
        self.fill_(buf)
        return bytes(buf)

    def words(self, n: int) -> torch.Tensor:
        """``n`` fresh uniformly random 64-bit words as an int64 CPU tensor."""
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        buf = bytearray(8 * n)
        self.fill_(buf)
        return torch.frombuffer(buf, dtype=torch.int64)

    def bits53(self, n: int) -> torch.Tensor:
        """``n`` independent uniform integers in [0, 2^53) (int64, CPU)."""
        return self.words(n).bitwise_and_(_MASK53)

    # ----------------------------------------------------------------- distributions

    def uniform(self, shape: ShapeLike, device="cpu", dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """U[0, 1) entries ``k / 2^53`` (53 random bits each; float64, then cast)."""
        shape = _shape(shape)
        u = self.bits53(math.prod(shape)).to(torch.float64).mul_(2.0**-53)
        return u.reshape(shape).to(device=device, dtype=dtype)

    def bernoulli(self, p: float, shape: ShapeLike, device="cpu") -> torch.Tensor:
        """Bool entries, True with probability ``ceil(p 2^53) / 2^53`` (``p`` up to 2^-53)."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p={p!r} is invalid; accepted values: a float in [0, 1]")
        shape = _shape(shape)
        threshold = math.ceil(p * 2.0**53)  # exact: scaling by a power of two
        mask = self.bits53(math.prod(shape)) < threshold
        return mask.reshape(shape).to(device)

    def standard_normal(self, shape: ShapeLike, device="cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """i.i.d. N(0, 1) entries: Box-Muller in float64, both outputs of each pair used
        (``r cos theta`` and ``r sin theta``), then cast to ``dtype`` on ``device``."""
        shape = _shape(shape)
        n = math.prod(shape)
        chunks = _Chunks(self, 2, (n + 1) // 2, torch.device(device))
        out = torch.empty(n, dtype=dtype, device=chunks.device)
        cos_buf = torch.empty(chunks.chunk, dtype=torch.float64, device=chunks.device)
        for start, m, u in chunks:  # u = [u | 2 pi v]: m pairs -> outputs 2 start ...
            r = _radius_(u[:m])
            theta = u[m:]
            cos = torch.cos(theta, out=cos_buf[:m]).mul_(r)
            sin = theta.sin_().mul_(r)
            lo = 2 * start
            mid, hi = min(n, lo + m), min(n, lo + 2 * m)
            out[lo:mid].copy_(cos[: mid - lo])
            out[mid:hi].copy_(sin[: hi - mid])
        return out.reshape(shape).to(device)

    def noise(self, std: float, reference: torch.Tensor) -> torch.Tensor:
        """N(0, std^2) entries shaped like ``reference`` (its dtype and device), as the
        halved sum of four independent normals in float64 (Opacus's floating-point-attack
        guard; see the module docstring): ``std (r1 sin 2 pi v1 + r2 sin 2 pi v2) / sqrt 2``."""
        if std == 0:
            return torch.zeros_like(reference)
        if not math.isfinite(std) or std < 0:
            raise ValueError(f"std={std!r} is invalid; accepted values: a finite float >= 0")
        n = reference.numel()
        chunks = _Chunks(self, 4, n, reference.device)
        out = torch.empty(n, dtype=reference.dtype, device=chunks.device)
        scale = std / math.sqrt(2.0)
        # scale^2 folded into y = -2 scale^2 ln u (r = scale sqrt(-2 ln u)) when safe
        folded = 1e-100 < scale < 1e100
        for start, m, u in chunks:  # u = [u1 | u2 | 2 pi v1 | 2 pi v2]
            r = _radius_(u[: 2 * m], scale**2 if folded else 1.0)
            s = u[2 * m :].sin_()
            s1 = s[:m].mul_(r[:m])  # r1 sin 2 pi v1
            dest = out[start : start + m]
            torch.addcmul(s1, s[m:], r[m:], out=dest)  # + r2 sin 2 pi v2, cast once
            if not folded:
                dest.mul_(scale)
        return out.reshape(reference.shape).to(reference.device)

    # ------------------------------------------------------------ no secret leaves

    def __repr__(self) -> str:
        return f"CSPRNG(cipher={self._cipher!r}, key=<secret>)"

    def _refuse(self, what: str):
        raise SecretStateError(
            f"{what} a CSPRNG is refused: its key is secret (a copy would replay the noise "
            f"and sketches; a stored key lets anyone regenerate them). Create a new CSPRNG "
            f"instead; a resumed secure run draws fresh randomness"
        )

    def __reduce_ex__(self, *_):
        self._refuse("Pickling")

    __reduce__ = __getstate__ = __reduce_ex__

    def __copy__(self, *_):
        self._refuse("Copying")

    __deepcopy__ = __copy__

    def state_dict(self):
        self._refuse("Saving the state of")

    def load_state_dict(self, state) -> None:
        self._refuse("Loading a state into")


class KeyStream:
    """One call's keystream: consecutive :meth:`fill_` calls continue it (one nonce per
    GiB; the encryptor holds the key, never exposed)."""

    def __init__(self, rng: CSPRNG) -> None:
        self._rng = rng
        self._encryptor = None
        self._left = 0

    def fill_(self, buffer: Union[bytearray, memoryview]) -> None:
        """Overwrite a writable buffer with the next keystream bytes."""
        view = memoryview(buffer).cast("B")
        total, offset = len(view), 0
        while offset < total:
            if self._left == 0:
                self._encryptor = self._rng._next_cipher()
                self._left = _MAX_BYTES_PER_NONCE
            n = min(_SUBCHUNK_BYTES, total - offset, self._left)
            zeros = _ZEROS[:n]  # a full slice is _ZEROS itself, no copy
            if total - offset >= n + 31:  # room for any cryptography version's check
                self._encryptor.update_into(zeros, view[offset:])
            else:
                view[offset : offset + n] = self._encryptor.update(zeros)
            offset += n
            self._left -= n

    def __reduce_ex__(self, protocol):
        raise SecretStateError("Pickling a KeyStream is refused: it holds the CSPRNG key")


def _radius_(u: torch.Tensor, scale_sq: float = 1.0) -> torch.Tensor:
    """In place: ``u -> sqrt(-2 scale_sq ln u)`` for ``u`` in (0, 1], computed as
    ``1 / rsqrt(y)`` with ``y = -2 scale_sq ln u`` (faster than ``sqrt`` in torch's CPU
    kernels, and exact at ``u = 1``: ``1 / rsqrt(0) = 1 / inf = 0``)."""
    return u.log_().mul_(-2.0 * scale_sq).rsqrt_().reciprocal_()


class _Chunks:
    """Iterate over ``(start, m, u)``: ``n`` outputs in chunks of ``m``, each with
    ``per_output * m`` float64 uniforms ``u`` from fresh keystream: the first half
    ``(k + 1) / 2^53`` in (0, 1] (for radii), the second half ``2 pi k / 2^53`` (angles),
    ``k`` 53 random bits. Buffers are allocated once per call and reused (the CPU work stays
    in cache); the float64 work runs on ``device`` (the output's) if it is a GPU, else on the
    CPU (MPS has no float64)."""

    def __init__(self, rng: "CSPRNG", per_output: int, n: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.per_output, self.n = per_output, n
        self.device = device if cuda else torch.device("cpu")
        self.chunk = max(1, min(_CUDA_CHUNK if cuda else _CPU_CHUNK, n))
        words = per_output * self.chunk
        self._buf = bytearray(8 * words)
        self._view = memoryview(self._buf)
        self._words = torch.frombuffer(self._buf, dtype=torch.int64)
        self._u = torch.empty(words, dtype=torch.float64, device=self.device)
        self._eps = torch.tensor(2.0**-53, dtype=torch.float64, device=self.device)
        self._stream = rng.stream()

    def __iter__(self) -> Iterator[Tuple[int, int, torch.Tensor]]:
        for start in range(0, self.n, self.chunk):
            m = min(self.chunk, self.n - start)
            words = self.per_output * m
            self._stream.fill_(self._view[: 8 * words])
            k = self._words[:words].bitwise_and_(_MASK53)
            u = self._u[:words].copy_(k)  # exact: k < 2^53
            half = words // 2
            torch.add(self._eps, u[:half], alpha=2.0**-53, out=u[:half])  # (k + 1) / 2^53
            u[half:].mul_(_TWO_PI * 2.0**-53)  # 2 pi k / 2^53
            yield start, m, u


# ---------------------------------------------------------------- module-level API

_default: Optional[CSPRNG] = None
_default_lock = threading.Lock()


def default_generator() -> CSPRNG:
    """The process's shared :class:`CSPRNG` (created on first use, re-keyed after fork)."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = CSPRNG()
    return _default


def secure_standard_normal(shape: ShapeLike, device="cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """i.i.d. N(0, 1) entries from the CSPRNG (53-bit uniforms, Box-Muller in float64)."""
    return default_generator().standard_normal(shape, device=device, dtype=dtype)


def secure_noise(std: float, reference: torch.Tensor) -> torch.Tensor:
    """N(0, std^2) noise like ``reference`` from the CSPRNG, as the halved sum of four
    normals in float64 (Opacus's secure-mode floating-point-attack mitigation)."""
    return default_generator().noise(std, reference)


def secure_bernoulli(p: float, shape: ShapeLike, device="cpu") -> torch.Tensor:
    """Bool entries, True with probability ``p`` (up to 2^-53), from the CSPRNG."""
    return default_generator().bernoulli(p, shape, device=device)


# ------------------------------------------------------------ Poisson batch sampler


class SecurePoissonSampler(UniformWithReplacementSampler):
    """Opacus's Poisson sampler (:class:`~opacus.utils.uniform_sampler.UniformWithReplacementSampler`)
    with its Bernoulli masks drawn from the CSPRNG: every example joins each batch
    independently with probability ``sample_rate``; ``steps`` batches per epoch
    (default ``int(1 / sample_rate)``, as Opacus).

    Distributed (``world_size > 1``): rank ``r`` owns the fixed, data-independent share
    ``r, r + world_size, ...`` of the indices and samples it at the same rate; the shares
    partition the dataset, so the union over ranks is one Poisson sample at rate
    ``sample_rate`` (no shuffling is needed for that). ``num_samples`` is the share's size
    (what Opacus's distributed sampler reports too).

    Args:
        num_samples: dataset size (all ranks together).
        sample_rate: inclusion probability q in (0, 1].
        steps: batches per epoch.
        rank, world_size: this process's share.
        generator: a :class:`CSPRNG` (default: the process's shared one).
    """

    def __init__(
        self,
        *,
        num_samples: int,
        sample_rate: float,
        steps: Optional[int] = None,
        rank: int = 0,
        world_size: int = 1,
        generator: Optional[CSPRNG] = None,
    ) -> None:
        if (
            isinstance(sample_rate, bool)
            or not isinstance(sample_rate, numbers.Real)
            or not 0.0 < sample_rate <= 1.0
        ):
            raise ValueError(f"sample_rate={sample_rate!r} is invalid; accepted values: (0, 1]")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"rank={rank!r}, world_size={world_size!r} are invalid; accepted values: "
                f"world_size >= 1 and 0 <= rank < world_size"
            )
        self.total_size = num_samples
        self.rank = rank
        self.world_size = world_size
        share = len(range(rank, num_samples, world_size)) if num_samples > 0 else num_samples
        super().__init__(num_samples=share, sample_rate=float(sample_rate), steps=steps)
        self._rng = generator

    @property
    def rng(self) -> CSPRNG:
        return self._rng if self._rng is not None else default_generator()

    def __iter__(self) -> Iterator[List[int]]:
        for _ in range(self.steps):
            mask = self.rng.bernoulli(self.sample_rate, self.num_samples)
            yield (mask.nonzero().reshape(-1) * self.world_size + self.rank).tolist()

    def __repr__(self) -> str:
        return (
            f"SecurePoissonSampler(num_samples={self.num_samples}, "
            f"sample_rate={self.sample_rate}, steps={self.steps}, rank={self.rank}, "
            f"world_size={self.world_size})"
        )


def rank_share(distributed: bool) -> Dict[str, int]:
    """This process's ``rank`` and ``world_size`` when ``distributed`` (else none: one share)."""
    dist = torch.distributed
    return dict(rank=dist.get_rank(), world_size=dist.get_world_size()) if distributed else {}


def loader_settings(data_loader: Any) -> Dict[str, Any]:
    """The worker and batching settings of ``data_loader`` that a Poisson loader replacing
    it keeps (as Opacus's ``DPDataLoader.from_data_loader`` does)."""
    return {
        name: getattr(data_loader, name)
        for name in (
            "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
            "multiprocessing_context", "prefetch_factor", "persistent_workers",
        )
    }


def init_poisson_loader(
    loader: DataLoader, dataset: Dataset, batch_sampler: Any, *, collate_fn=None, drop_last: bool = False,
    batch_first: bool = True, rand_on_empty: bool = False, **kwargs: Any,
) -> None:
    """``DataLoader.__init__`` of ``loader`` as Opacus's ``DPDataLoader`` builds it, over the
    Poisson ``batch_sampler`` given: the collate function wrapped for empty batches."""
    if drop_last:
        logger.warning("Ignoring drop_last as it is not compatible with DPDataLoader.")
    DataLoader.__init__(
        loader,
        dataset=dataset,
        batch_sampler=batch_sampler,
        collate_fn=wrap_collate_with_empty(
            collate_fn=collate_fn if collate_fn is not None else default_collate,
            batch_first=batch_first,
            rand_on_empty=rand_on_empty,
            sample_empty_shapes=[(0, *shape_safe(x)) for x in dataset[0]],
            dtypes=[dtype_safe(x) for x in dataset[0]],
        ),
        **kwargs,
    )


class SecureDPDataLoader(DPDataLoader):
    """Opacus's :class:`~opacus.data_loader.DPDataLoader` (Poisson sampling, collate
    function wrapped for empty batches) with a :class:`SecurePoissonSampler` as its batch
    sampler: the batch masks come from the CSPRNG, no torchcsprng generator is needed.

    Args:
        dataset: map-style dataset.
        sample_rate: inclusion probability q of every example in every batch.
        collate_fn: collate function (default ``default_collate``).
        distributed: sample this rank's share (see :class:`SecurePoissonSampler`).
        batch_first, rand_on_empty: as in ``DPDataLoader``.
        generator: the :class:`CSPRNG` of the masks (default: the process's shared one).
        **kwargs: other ``DataLoader`` arguments (workers, pinning, ...).
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        sample_rate: float,
        collate_fn=None,
        drop_last: bool = False,
        distributed: bool = False,
        batch_first: bool = True,
        rand_on_empty: bool = False,
        generator: Optional[CSPRNG] = None,
        **kwargs,
    ) -> None:
        self.sample_rate = sample_rate
        self.distributed = distributed
        batch_sampler = SecurePoissonSampler(
            num_samples=len(dataset),  # type: ignore[arg-type]
            sample_rate=sample_rate,
            generator=generator,
            **rank_share(distributed),
        )
        init_poisson_loader(
            self, dataset, batch_sampler, collate_fn=collate_fn, drop_last=drop_last,
            batch_first=batch_first, rand_on_empty=rand_on_empty, **kwargs,
        )

    @classmethod
    def from_data_loader(
        cls,
        data_loader: DataLoader,
        *,
        sample_rate: Optional[float] = None,
        distributed: bool = False,
        generator: Optional[CSPRNG] = None,
        batch_first: bool = True,
        rand_on_empty: bool = False,
    ) -> "SecureDPDataLoader":
        """Like ``DPDataLoader.from_data_loader``: same dataset, collate function and
        worker settings; ``sample_rate`` defaults to ``1 / len(data_loader)``."""
        if isinstance(data_loader.dataset, IterableDataset):
            raise ValueError("Uniform sampling is not supported for IterableDataset")
        return cls(
            dataset=data_loader.dataset,
            sample_rate=1 / len(data_loader) if sample_rate is None else float(sample_rate),
            **loader_settings(data_loader),
            distributed=distributed,
            generator=generator,
            batch_first=batch_first,
            rand_on_empty=rand_on_empty,
        )
