"""Ray Train V2's module paths (`ray.train.v2.api.*`), for code that imports from them: the import
rule maps `ray.train.v2.api.config` to `elastic_train.v2.api.config`, and each module here holds the
public names of Ray's."""
