"""`ray.train.v2.api`: see elastic_train/v2/__init__.py."""
