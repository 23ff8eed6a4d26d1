"""Storage as Ray Train users address it, opened with fsspec.

Ray's storage is pyarrow's: a `pyarrow.fs.FileSystem` object (`RunConfig(storage_filesystem=...)`,
`Checkpoint(path, filesystem)`, `Result.from_path(path, storage_filesystem)`), or a URI whose query
holds the filesystem's options, `s3://bucket/prefix?region=us-west-2&endpoint_override=http://...`.
elastic_train's storage is fsspec's (any fsspec URL, `storage_options`): a pyarrow filesystem is
wrapped (`as_fsspec`), and the options of a pyarrow URI's query become the fsspec backend's
(`split_query`); `open_filesystem` opens either form. Paths and filesystems it hands back are
fsspec's (README, "Coming from Ray Train").
"""

from __future__ import annotations

from typing import Any, Mapping
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import fsspec
from fsspec.core import url_to_fs

from elastic_train.errors import ConfigError

_TRUE = ("1", "true", "yes")


def _s3_options(query: dict[str, str]) -> dict[str, Any]:
    """s3fs's options for pyarrow's S3 URI options."""
    options: dict[str, Any] = {}
    scheme = query.pop("scheme", None)
    if "region" in query:
        options.setdefault("client_kwargs", {})["region_name"] = query.pop("region")
    if "endpoint_override" in query:
        endpoint = query.pop("endpoint_override")
        options["endpoint_url"] = endpoint if "://" in endpoint else f"{scheme or 'https'}://{endpoint}"
    elif scheme == "http":
        options["use_ssl"] = False
    for theirs, ours in (("access_key", "key"), ("secret_key", "secret"), ("session_token", "token")):
        if theirs in query:
            options[ours] = query.pop(theirs)
    if "anonymous" in query:
        options["anon"] = query.pop("anonymous").lower() in _TRUE
    for ignored in ("allow_bucket_creation", "allow_bucket_deletion"):  # s3fs creates and deletes when asked
        query.pop(ignored, None)
    return options


_QUERY_OPTIONS = {"s3": _s3_options, "s3a": _s3_options}
# Other schemes whose options pyarrow reads from the query: fsspec would take the query for part of the
# path, so one there is refused. Any other URL (http's, say) is the fsspec backend's, query and all.
_PYARROW_QUERY_SCHEMES = ("gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")


def split_query(url: str, storage_options: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """`url` without a pyarrow-style query, and the fsspec options it held (under those given)."""
    parts = urlsplit(url)
    if not parts.query or "://" not in url:
        return url, dict(storage_options or {})
    convert = _QUERY_OPTIONS.get(parts.scheme)
    if convert is None and parts.scheme not in _PYARROW_QUERY_SCHEMES:
        return url, dict(storage_options or {})
    if convert is None:
        raise ConfigError(f"storage_path {url!r}: options in the URL's query are understood for s3:// only; pass "
                          "them as RunConfig(storage_options={...}), the fsspec backend's options.")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    options = convert(query)
    if query:
        raise ConfigError(f"storage_path {url!r}: {', '.join(sorted(query))} in the URL's query is not understood "
                          "here; pass it as RunConfig(storage_options={...}), s3fs's options.")
    return urlunsplit(parts._replace(query="")), {**options, **dict(storage_options or {})}


def as_fsspec(filesystem: Any) -> fsspec.AbstractFileSystem:
    """An fsspec filesystem for `filesystem`: itself, or a pyarrow one unwrapped or wrapped."""
    if isinstance(filesystem, fsspec.AbstractFileSystem):
        return filesystem
    import pyarrow.fs

    if isinstance(filesystem, pyarrow.fs.PyFileSystem) and isinstance(filesystem.handler, pyarrow.fs.FSSpecHandler):
        return filesystem.handler.fs
    if isinstance(filesystem, pyarrow.fs.LocalFileSystem):
        return fsspec.filesystem("file")
    if isinstance(filesystem, pyarrow.fs.FileSystem):
        from fsspec.implementations.arrow import ArrowFSWrapper

        return ArrowFSWrapper(filesystem)
    raise ConfigError(f"a storage filesystem must be a pyarrow.fs.FileSystem or an fsspec filesystem, got "
                      f"{type(filesystem).__name__}.")


def open_filesystem(url: str, storage_options: Mapping[str, Any] | None = None,
                    filesystem: Any = None) -> tuple[Any, str]:
    """The fsspec filesystem and the path on it of `url`: a path on `filesystem` when one is given
    (fsspec or pyarrow), else any fsspec URL (a pyarrow-style query holding its options), with a
    clear error when the protocol's fsspec backend is not installed."""
    if filesystem is not None:
        return as_fsspec(filesystem), url
    url, options = split_query(url, storage_options)
    try:
        return url_to_fs(url, **options)
    except ImportError as exc:
        raise ConfigError(f"storage_path {url!r} needs a filesystem that is not installed: {exc}") from exc
