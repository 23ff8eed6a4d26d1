"""Faithful recovery: a loop goes on in place only where that computes what Ray Train's re-run would.

sites.py reads a loop's source (which reads of its place it holds); reads.py records them as the loop
runs; combines.py finds the collectives a loop makes after its steps (per-rank values combined across
them); supervisor/policy.py `unfaithful` compares all that with the next generation's places; check.py
lists the reads for a script before it runs (`elastic-train check`).
"""
