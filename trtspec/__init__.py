"""trtspec: measure whether speculative decoding pays off — exactly — and then serve it."""

__version__ = "0.1.0"
