"""Speculative decoding itself: the exact sampler (``sample``), proposers (``propose``), the
executor that runs draft → verify rounds, its counters and the draft-length chooser."""
