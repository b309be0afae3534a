"""Research scripts outside the runtime package, run from the repository root.

* ``python -m tools.verify_envelope``: the single-chi-square envelope against the exact
  weighted-chi-square CDFs (:mod:`tools.weighted_chi2`), writes docs/envelope_verification.md;
* ``python -m tools.sigma_table``: noise multipliers of randomized vs deterministic clipping,
  writes docs/sigma_table.md;
* ``python -m tools.code_size COMMIT ...``: lines and code lines commits add to opacus_rc/;
  ``python -m tools.code_size --tree [REV]``: lines, code lines and guard lines of opacus_rc/.
"""
