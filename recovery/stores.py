"""What counts as a store being away: the database or Redis cut off or restarting, not a query that is wrong.

Every process waits such an outage out (the web process answers 503, a Celery task skips its tick or retries, the
stream consumer leaves its entries pending); a query that is wrong stays a bug. Catch STORE_ERRORS, then ask
`away(exc)`: SQLite reports a missing table with the same OperationalError as a file it cannot open, so the class
alone does not tell an outage on the embedded default from a bug.
"""

import sqlite3

from django.db import InterfaceError, OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

DATABASE_AWAY = (OperationalError, InterfaceError)
STORE_ERRORS = (*DATABASE_AWAY, RedisConnectionError, RedisTimeoutError)

# SQLite's messages for a database it cannot reach (its file gone, unreadable, its disk failing, held by a writer);
# every other sqlite3.OperationalError ("no such table", "no such column", a syntax error) is the query's fault.
SQLITE_AWAY = ("unable to open database", "disk i/o error", "database is locked", "database disk image is malformed")


def away(exc: BaseException) -> bool:
    """Whether `exc` means a store is away (wait it out) rather than a bug (trace it)."""
    if not isinstance(exc, STORE_ERRORS):
        return False
    cause = exc.__cause__  # Django raises its own error from the driver's
    if isinstance(exc, OperationalError) and isinstance(cause, sqlite3.Error):
        return any(words in str(cause).lower() for words in SQLITE_AWAY)
    return True


def store_of(exc: BaseException) -> str:
    """Which store an outage error is about, in words for a log line or a 503."""
    return "database" if isinstance(exc, DATABASE_AWAY) else "Redis"
