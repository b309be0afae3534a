"""Tests of opacus_rc.forms."""
