"""Tests of opacus_rc.hf."""
