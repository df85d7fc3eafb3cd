"""Names of everything Lifeline keeps in Redis, under one namespace.

No Django here: the gateway uses the same names without loading settings.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    namespace: str

    def _k(self, *parts: str) -> str:
        return ":".join((self.namespace, *parts))

    def node(self, name: str) -> str:
        return self._k("node", name)

    @property
    def heartbeats(self) -> str:
        return self._k("heartbeats")

    @property
    def routing(self) -> str:
        return self._k("routing")

    @property
    def routing_changed(self) -> str:
        """Pub/sub channel: the routing table or the gateway keys changed."""
        return self._k("routing", "changed")

    @property
    def gateway_keys(self) -> str:
        return self._k("gateway", "keys")
