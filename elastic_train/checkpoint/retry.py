"""Which storage errors to retry, and how.

Why: object stores fail in two ways. Throttling (503 SlowDown), 5xx, dropped connections and
timeouts pass: retrying with exponential backoff and jitter (tenacity) rides them out. Denied
access, a missing bucket or bad credentials do not: retrying them only hides the problem, so they
fail at once with a message that names the fix. s3fs turns S3 error codes into OSError subclasses
(`s3fs.errors`); the classification below reads those, and botocore/aiohttp errors by name, so it
needs neither installed.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from dataclasses import dataclass
from typing import Iterator

import tenacity

from elastic_train.config import ElasticConfig
from elastic_train.errors import StorageError

logger = logging.getLogger(__name__)

_TRANSIENT_ERRNOS = {
    errno.EBUSY,  # s3fs: SlowDown, ServiceUnavailable, 503, 409
    getattr(errno, "EREMOTEIO", errno.EIO),  # s3fs: InternalError, 500
    errno.EAGAIN,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ECONNREFUSED,
    errno.EPIPE,
}
_TRANSIENT_CLASS_NAMES = {
    # botocore
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
    "ResponseStreamingError", "IncompleteReadError",
    # aiohttp
    "ClientConnectionError", "ClientOSError", "ServerDisconnectedError", "ClientPayloadError",
    "ServerTimeoutError",
}
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                    "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequestsException"}
_PERMANENT = (PermissionError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def is_transient(exc: BaseException) -> bool:
    """Is `exc` a storage error that may pass if retried?"""
    for err in _chain(exc):
        if isinstance(err, StorageError) or isinstance(err, _PERMANENT):
            return False
        if isinstance(err, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
            return True
        if isinstance(err, OSError) and err.errno in _TRANSIENT_ERRNOS:
            return True
        if any(cls.__name__ in _TRANSIENT_CLASS_NAMES for cls in type(err).__mro__):
            return True
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if code in _TRANSIENT_CODES or status >= 500 or status == 429:
                return True
    return False


_HINTS = (
    (PermissionError, "check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or "
                      "RunConfig.storage_options) and that they may write to this location"),
    (FileNotFoundError, "check that the bucket or folder of RunConfig.storage_path exists"),
)


def permanent_error(what: str, exc: BaseException) -> StorageError:
    """A `StorageError` for a failure that retrying will not fix, naming the fix."""
    hint = next((h for cls, h in _HINTS if any(isinstance(e, cls) for e in _chain(exc))),
                "check RunConfig.storage_path and RunConfig.storage_options")
    return StorageError(f"{what} failed: {type(exc).__name__}: {exc}. This is not a transient fault: {hint}.")


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff for transient storage errors: exponential from `initial_s`, capped at `max_s`,
    with full jitter, for at most `deadline_s` per operation."""

    initial_s: float = 0.2
    max_s: float = 10.0
    deadline_s: float = 120.0

    @classmethod
    def of(cls, elastic: ElasticConfig) -> "RetryPolicy":
        """The policy `ElasticConfig.storage_retry_*` set."""
        return cls(elastic.storage_retry_initial_s, elastic.storage_retry_max_s, elastic.storage_retry_deadline_s)

    def call(self, what: str, fn, *args, **kwargs):  # noqa: ANN001, ANN201 - a thin typed-by-use wrapper
        """`fn(*args, **kwargs)`, retried on transient errors; a permanent one raises `StorageError`."""

        def log_retry(state: tenacity.RetryCallState) -> None:
            logger.warning("storage: %s failed (%s); retry %d in %.1fs", what, state.outcome.exception(),
                           state.attempt_number, state.upcoming_sleep)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_transient),
            wait=tenacity.wait_random_exponential(multiplier=self.initial_s, max=self.max_s),
            stop=tenacity.stop_after_delay(self.deadline_s),
            before_sleep=log_retry,
            reraise=True,
        )
        try:
            return retrying(fn, *args, **kwargs)
        except StorageError:
            raise
        except Exception as exc:
            if is_transient(exc):
                raise TransientStorageError(
                    f"{what} still failing after {self.deadline_s}s of retries: {type(exc).__name__}: {exc}"
                ) from exc
            raise permanent_error(what, exc) from exc


class TransientStorageError(StorageError):
    """Storage kept failing with transient errors for a whole retry deadline."""
