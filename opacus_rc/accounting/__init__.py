"""Privacy accounting for randomized clipping (``rc_prv``)."""
