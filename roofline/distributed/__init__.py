"""Parallel state and communication. Size 1 today; tensor/pipeline parallel workers plug in here."""
