"""A ``tx.progress`` display that keeps what it is told (imported by the
progress tests)."""


class Recorder:
    """``events``: ``("start", name, total)``, ``("update", name, n)``,
    ``("close", name, n)`` in the order the host was told them."""

    def __init__(self):
        self.events: list = []

    def start(self, loop):
        self.events.append(("start", loop.name, loop.total))

    def update(self, loop, n):
        self.events.append(("update", loop.name, n))

    def close(self, loop, n):
        self.events.append(("close", loop.name, n))
