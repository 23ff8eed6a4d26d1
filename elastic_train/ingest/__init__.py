"""Data ingest that survives resizes: an epoch's position held alike on every rank (cursor.py), and
Ray Data datasets served from one coordinator per dataset (coordinator.py) as each rank's share of
every global batch (shard.py, `get_dataset_shard`)."""
