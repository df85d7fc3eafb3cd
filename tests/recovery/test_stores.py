"""recovery.stores.away tells a store that is away (wait it out) from a query that is wrong (a bug), on both
databases Lifeline runs on. SQLite uses one error class for both, so its errors are read by what they say; these
are real SQLite databases, made to fail the way they do."""

import sqlite3

import pytest
from django.db import OperationalError
from django.db.utils import ConnectionHandler
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError as RedisDataError
from redis.exceptions import TimeoutError as RedisTimeoutError

from recovery.stores import away, store_of


@pytest.fixture(autouse=True)
def own_databases(django_db_blocker):
    """These tests open their own SQLite files, never the test database: pytest-django's guard is lifted for them."""
    with django_db_blocker.unblock():
        yield


def sqlite_connection(path):
    handler = ConnectionHandler({"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(path)}})
    return handler["default"]


def error_of(connection, sql: str) -> BaseException:
    with pytest.raises(Exception) as raised:
        with connection.cursor() as cursor:
            cursor.execute(sql)
    return raised.value


def test_a_missing_table_on_sqlite_is_a_bug_not_an_outage(tmp_path):
    connection = sqlite_connection(tmp_path / "db.sqlite3")
    exc = error_of(connection, "SELECT no_such_column FROM no_such_table")
    assert isinstance(exc, OperationalError) and isinstance(exc.__cause__, sqlite3.OperationalError)
    assert not away(exc)
    connection.close()


def test_a_sqlite_file_that_cannot_be_opened_is_an_outage(tmp_path):
    connection = sqlite_connection(tmp_path / "gone" / "db.sqlite3")
    exc = error_of(connection, "SELECT 1")
    assert isinstance(exc, OperationalError) and "unable to open" in str(exc)
    assert away(exc) and store_of(exc) == "database"


def test_a_sqlite_database_held_by_another_writer_is_an_outage(tmp_path):
    path = tmp_path / "db.sqlite3"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    connection = sqlite_connection(path)
    connection.settings_dict["OPTIONS"] = {"timeout": 0.05}
    exc = error_of(connection, "SELECT * FROM t")
    assert "database is locked" in str(exc)
    assert away(exc)
    holder.execute("ROLLBACK")
    holder.close()
    connection.close()


def test_a_server_database_operational_error_and_redis_connection_errors_are_outages():
    assert away(OperationalError("server closed the connection unexpectedly"))
    assert away(RedisConnectionError("Connection refused")) and store_of(RedisConnectionError()) == "Redis"
    assert away(RedisTimeoutError("Timeout reading from socket"))


def test_other_errors_are_bugs():
    assert not away(RedisDataError("Invalid input of type: 'dict'"))
    assert not away(ValueError("no"))
