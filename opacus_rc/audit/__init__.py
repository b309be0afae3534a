"""Empirical privacy audit of randomized clipping (``python -m opacus_rc.audit``).

Runs the plugin's real DP step many times on neighbouring batches (without / with a
canary whose rank-1 gradient maximises the estimator's error), tests the released
gradient with a threshold on its projection onto the canary's gradient, and turns the
error rates into a Clopper-Pearson lower bound on epsilon, to be compared with the
``rc_prv`` accountant's epsilon for the same step. Broken variants (an estimator biased
low, a data-dependent sketch; private to the audit, in ``opacus_rc.audit._broken``) show
that the audit can fail. The normaliser audit (:mod:`opacus_rc.audit.normaliser`) checks that the averaged update does not reveal the
dataset's size. The side-path audit (:mod:`opacus_rc.audit.paths`) checks gradient
accumulation (a canary in several micro-batches of one step), hand-built objects and the
per-example form (one example per backward pass; its control clips two examples together).
See ``docs/audit.md``.
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
