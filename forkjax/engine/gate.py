"""The workflow gate of one admission pass (admission.py): the admitted sessions' reservations
(sessions.py, `Sessions.reservation`) summed once, and whether another session fits beside them,
taking the reservations of sessions idle for longer than any recent tool call if it must."""

from __future__ import annotations

from forkjax.engine.sessions import POOLS, Session, Sessions


class Gate:
    """One admission pass's view of the reservations: the admitted sessions'
    (`Sessions.reservation`), summed once, grown as the pass admits more."""

    def __init__(self, sessions: Sessions):
        self.sessions = sessions
        self.admitted = [x for x in sessions.by_id.values() if x.admitted]
        self.total = [0.0] * len(POOLS)  # device pages per pool
        self.host = 0.0  # host bytes
        for x in self.admitted:
            self._add(x, 1)
        self.refused: set[Session] = set()  # sessions that did not fit in this pass

    def _add(self, s: Session, sign: int) -> None:
        device, host = self.sessions.reservation(s)
        for i, pages in enumerate(device):
            self.total[i] += sign * pages
        self.host += sign * host

    def _over(self, want) -> bool:
        device, host = want
        return (any(device[i] and self.total[i] + device[i] > cap
                    for i, cap in enumerate(self.sessions.capacity))
                or host and self.host + host > self.sessions.host_capacity)

    def fits(self, s: Session) -> bool:
        """Whether session `s`'s projection fits in each pool beside the admitted sessions'.
        To fit, it may take the reservations of sessions idle for longer than the longest
        recent wait between two requests of one session (longest idle first), which are then
        suspended."""
        if not self.admitted:
            return True  # alone, it runs however large: nothing else is reserved
        if s in self.refused:
            return False
        want = self.sessions.reservation(s)
        if not self._over(want):
            return True
        takeable = []
        for x in self.sessions.stale():
            if x.admitted:
                takeable.append(x)
                self._add(x, -1)
                if not self._over(want) or len(takeable) == len(self.admitted):
                    for taken in takeable:
                        self.sessions.suspend(taken)
                        self.admitted.remove(taken)
                    return True
        for taken in takeable:
            self._add(taken, 1)
        self.refused.add(s)
        return False

    def admit(self, s: Session) -> None:
        s.admitted = True
        self.admitted.append(s)
        self._add(s, 1)
