"""The worker's broker transport (console.broker): a channel of a connection closed after Redis was lost raises a
connection error, which kombu and Celery handle, instead of the AttributeError that made the worker exit.

The chaos soak's Redis restart found it twice in CI: "Unrecoverable error: AttributeError('NoneType' object has no
attribute 'hostname')" from kombu's `Channel._connparams`, and the Celery worker was gone.
"""

import logging

import pytest
from celery import Celery
from kombu import Connection
from kombu.message import Message

from console import broker
from console.celery import app
from console.stack import free_port
from tests.recovery.test_reactions_broker import start_redis

OPENED: list = []


@pytest.fixture
def redis_port():
    port = free_port()
    server = start_redis(port)
    yield port
    for channel in OPENED:  # not given back again when the interpreter exits (kombu's atexit restore)
        channel.qos.restore_at_shutdown = False
    OPENED.clear()
    server.terminate()
    server.wait()


def closed_channel(port: int, transport):
    """A channel with a message delivered and not acknowledged, whose connection is then closed, as the consumer
    closes its connection when Redis goes away; the channel is still held by the late task's message."""
    connection = Connection(f"redis://127.0.0.1:{port}/0", transport=transport)
    channel = connection.channel()
    OPENED.append(channel)
    queue = channel.queue_declare("q")
    producer = connection.Producer(channel)
    producer.publish({"n": 1}, routing_key=queue.queue)
    message = channel.basic_get(queue.queue, no_ack=False)
    assert message is not None
    channel._pool = None  # the pool went with the connection to the lost Redis
    connection._do_close_transport()
    return channel, message


def test_kombus_own_transport_raises_attribute_error_here(redis_port):
    """The defect, shown on kombu's transport: this is what stopped the worker."""
    from kombu.transport.redis import Transport

    channel, message = closed_channel(redis_port, Transport)
    with pytest.raises(AttributeError):
        message.ack()


def test_a_late_ack_on_a_closed_connection_is_a_connection_error_the_worker_logs(redis_port, caplog):
    channel, message = closed_channel(redis_port, broker.Transport)
    errors = broker.Transport.connection_errors + broker.Transport.channel_errors
    assert isinstance(message, Message)
    with caplog.at_level(logging.CRITICAL):
        message.ack_log_error(logging.getLogger("celery.worker.request"), errors)  # what Celery calls: no raise
    assert "Couldn't ack" in caplog.text and "closed after Redis was lost" in caplog.text


def test_closing_a_channel_of_a_closed_connection_gives_no_error(redis_port):
    channel, message = closed_channel(redis_port, broker.Transport)
    connection = Connection(f"redis://127.0.0.1:{redis_port}/0", transport=broker.Transport)
    connection.maybe_close_channel(channel)  # its unacked message given back: ignored as a connection error


def test_celery_uses_this_transport():
    assert app.conf.broker_transport == "console.broker:Transport"
    with app.connection_for_write() as connection:
        assert connection.transport_cls == "console.broker:Transport"
        assert isinstance(connection.transport, broker.Transport)


def test_a_new_app_with_the_setting_publishes_through_it(redis_port):
    other = Celery("t", broker=f"redis://127.0.0.1:{redis_port}/0", set_as_current=False)
    other.conf.broker_transport = "console.broker:Transport"
    with other.connection_for_write() as connection:
        connection.default_channel.client.ping()
        assert isinstance(connection.transport, broker.Transport)
