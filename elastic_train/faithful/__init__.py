"""Faithful recovery: a loop goes on in place only where that computes what Ray Train's re-run would.

sites.py reads a loop's source (which reads of its place it holds); reads.py records them as the loop
runs; supervisor/policy.py `unfaithful` compares them with the next generation's places; check.py lists
them for a script before it runs (`elastic-train check`).
"""
