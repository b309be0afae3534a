"""Tests of opacus_rc.audit."""
