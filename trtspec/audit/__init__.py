"""Is the sampler exact? A chi-square audit of speculative output against the target's exact
distribution, in process (``inprocess``: the built models, through the serving scheduler, with
``sampling`` drawing and binning) or against a running endpoint (``endpoint``: first tokens of
the speculating server against the plain one). Both keep their result in one ``audit.json``
beside the eval's records (``file``), which ``decide`` gates on."""
