"""Tests of opacus_rc.accounting."""
