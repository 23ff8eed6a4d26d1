"""Supervisor side: one Ray actor that owns membership, generations and the run's state machine."""
