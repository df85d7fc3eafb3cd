"""The Celery broker's transport: kombu's Redis transport, with one of its failure paths made recoverable.

When Redis goes away, the worker's consumer closes its broker connection and makes a new one. A channel of the
closed connection can still be used after that: a task that finishes late acknowledges its message on the channel
it came from, and closing a channel gives its unacknowledged messages back. kombu 5.7 then builds a Redis client
from a connection whose `client` it has already cleared, and raises AttributeError ('NoneType' object has no
attribute 'hostname', in `Channel._connparams`). Celery takes that for a bug, not a lost connection, and the worker
exits ("Unrecoverable error"), leaving the control plane without its worker until its supervisor starts it again.

Here such a channel raises Redis's ConnectionError instead, which kombu and Celery handle as the outage it is: a
channel being closed ignores it, and a late acknowledgement is logged as not made (with `acks_late` the message is
delivered again; every task is idempotent).
"""

from kombu.transport import redis as kombu_redis
from redis.exceptions import ConnectionError as RedisConnectionError


class Channel(kombu_redis.Channel):
    def _connparams(self, asynchronous=False):
        if self.connection.client is None:
            raise RedisConnectionError(
                "this channel's broker connection was closed after Redis was lost; the worker uses a new one"
            )
        return super()._connparams(asynchronous=asynchronous)


class Transport(kombu_redis.Transport):
    Channel = Channel
