"""PRV accounting of Poisson-subsampled Gaussian mechanisms with a random sensitivity.

One DP-SGD step with randomized clipping adds ``N(0, sigma^2 C^2)`` to a sum in which the
differing example (present with probability ``q``) contributes a vector of norm at most
``C * Z``. With the envelope ``Z*`` of ``opacus_rc.accounting.envelope`` the step is
dominated (in units of ``C``, projected on the example's direction) by

* revealed Z (shared sketch):  ``(Z, (1-q) N(0, s^2) + q N(Z, s^2))`` vs ``(Z, N(0, s^2))``;
  its privacy loss random variable (PRV) is the mixture over Z of the PRVs of Poisson
  subsampled Gaussians with noise ``sigma / Z``;
* hidden Z (independent sketch per example):
  ``(1-q) N(0, s^2) + q E_Z N(Z, s^2)`` vs ``N(0, s^2)``; the PRV of one mixture.

``Z*`` is discretised into bins, each rounded **up** to its right edge; the top mass (above
``z_max``) is given infinite sensitivity, which puts ``q * p_inf`` at infinite privacy loss
(into delta) and, when Z is revealed, ``(1-q) p_inf`` at ``log(1-q)``.

The composition over (heterogeneous) steps follows Gopi, Lee, Wutschitz (2021),
"Numerical composition of differential privacy" (the method of ``prv_accountant`` and of
Opacus's ``prv`` accountant), with these conservative changes:

* both directions of the add/remove relation are composed and the larger epsilon wins
  (Opacus's ``prv`` composes only ``P||Q`` with ``P`` the subsampled mixture);
* single-step mass above the domain and composed mass that leaves the domain are counted
  as infinite loss (added to delta) instead of being dropped and renormalised;
* the domain bound uses Chernoff bounds with the exact log-moment generating functions of
  the mixture (both tails, both directions), not the RDP of a plain subsampled Gaussian;
* the FFT runs on a padded fast length; the domain size is capped (the mesh then grows and
  the reported epsilon error grows with it), so large epsilons and 100k steps do not fail.
"""

from .compose import compose_epsilon
from .mixtures import DEFAULT_BIN_RATIO, DETERMINISTIC, SensitivityMixture, envelope_mixture
from .prvs import MU_INFINITE, StepPRV

__all__ = [
    "DEFAULT_BIN_RATIO",
    "DETERMINISTIC",
    "MU_INFINITE",
    "SensitivityMixture",
    "StepPRV",
    "compose_epsilon",
    "envelope_mixture",
]
