"""Distilling Medusa / EAGLE-3 draft heads from a target on its own continuations."""
