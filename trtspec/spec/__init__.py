"""Speculative decoding itself: the exact sampler (``sample``), proposers (``propose``), the
executor that runs draft → verify rounds, its counters, the draft-length chooser and what a
round costs."""
