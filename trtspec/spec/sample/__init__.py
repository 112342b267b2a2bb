"""Where probabilities are made (``probs.logits_to_probs``, for draft and target alike) and the
exact rejection sampler that keeps the target's distribution (``verify``)."""
