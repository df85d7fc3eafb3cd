"""What counts as a store being away: the database or Redis cut off or restarting, not a query that is wrong.

Every process waits such an outage out (the web process answers 503, a Celery task skips its tick or retries, the
stream consumer leaves its entries pending); a ProgrammingError or a redis DataError stays a bug.
"""

from django.db import InterfaceError, OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

DATABASE_AWAY = (OperationalError, InterfaceError)
STORE_ERRORS = (*DATABASE_AWAY, RedisConnectionError, RedisTimeoutError)


def store_of(exc: BaseException) -> str:
    """Which store an outage error is about, in words for a log line or a 503."""
    return "database" if isinstance(exc, DATABASE_AWAY) else "Redis"
