"""Empirical privacy audit of randomized clipping (``python -m opacus_rc.audit``).

Runs the plugin's real DP step many times on neighbouring batches, without and with a
canary, and turns a threshold test's error rates into a Clopper-Pearson lower bound on
epsilon, to be compared with the ``rc_prv`` accountant's epsilon; deliberately broken
variants show that the audit can fail. Sketch variants: :mod:`.experiment`; the dataset-size
normaliser: :mod:`.normaliser`; side paths: :mod:`.paths`. See docs/audit.md.
"""

from ._broken import VARIANTS
from .experiment import AuditConfig, AuditResult, InnerProductLoss, accounted_epsilon, run_audit
from .normaliser import NORMALISER_VARIANTS, NormaliserAuditConfig, NormaliserAuditResult, run_normaliser_audit
from .paths import PATH_VARIANTS, PathAuditConfig, PathAuditResult, run_path_audit
from .reference import normaliser_exact_epsilon
from .stats import ThresholdAudit, clopper_pearson_upper, epsilon_from_rates, threshold_audit

__all__ = [
    "AuditConfig",
    "AuditResult",
    "InnerProductLoss",
    "NORMALISER_VARIANTS",
    "NormaliserAuditConfig",
    "NormaliserAuditResult",
    "PATH_VARIANTS",
    "PathAuditConfig",
    "PathAuditResult",
    "ThresholdAudit",
    "VARIANTS",
    "accounted_epsilon",
    "clopper_pearson_upper",
    "epsilon_from_rates",
    "normaliser_exact_epsilon",
    "run_audit",
    "run_normaliser_audit",
    "run_path_audit",
    "threshold_audit",
]
