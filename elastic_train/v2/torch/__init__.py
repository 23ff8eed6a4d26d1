"""`ray.train.v2.torch`: Ray V2's torch module paths, for code that imports from them."""
