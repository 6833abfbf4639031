"""Something the hub depends on failing while it runs (the database, the summary model,
the training service, the ingest processes), said as a person wants to read it.

One `Outage` per subject and hub: every writer, stage and route that meets the failure
reports to the same one, so that an outage is one ERROR line per kind of failure (a
lost connection, a full disk, a lock) and one line when it works again, not a pair per
stage, request or retry. `works()` is for what proved the subject works (a write
committed, a call answered), not for what merely did not need it. /readyz lists the
subjects failing (`Outages.failing`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from app.errors import ServiceError

# What a failure is, for a subject: (its kind, what was said, in one line), or None when
# the exception is not this subject failing (a bug, for the caller to log with its
# traceback).
Classify = Callable[[BaseException], "tuple[str, str] | None"]


def _any_failure(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc) or type(exc).__name__


class Outage:
    def __init__(
        self,
        subject: str,
        consequence: str,
        *,
        classify: Classify = _any_failure,
        logger: str = "atropos",
        again: str = "works again",
        plural: bool = False,
        level: int = logging.ERROR,
    ) -> None:
        """`subject`: what fails, as a sentence's subject ("the database");
        `consequence`: what the hub does meanwhile, for the first line;
        `classify`: which exceptions are this subject failing; `again`: what the
        recovery line says of it; `level`: the failing line's (the recovery's is one
        below)."""
        self.subject = subject
        self._consequence = consequence
        self._again = again
        self._is = "are" if plural else "is"
        self._level = level
        self._classify = classify
        self._log = logging.getLogger(logger)
        self._since: float | None = None
        self._kinds: Counter[str] = Counter()
        self._last: str | None = None
        self._kind: str | None = None

    @property
    def failing(self) -> str | None:
        """What the last failure said, while the subject is failing; else None."""
        return self._last if self._since is not None else None

    def failed(self, exc: BaseException | str, doing: str) -> bool:
        """Note a failure while `doing` something (the first of its kind is logged):
        an exception, or what was said of it. False when `exc` is not this subject
        failing: a bug, for the caller to log with its traceback."""
        if isinstance(exc, str):  # of the kind said last: the same failure, told again
            classified: tuple[str, str] | None = (self._kind or "error", exc)
        else:
            classified = self._classify(exc)
        if classified is None:
            return False
        kind, said = classified
        self._kind = kind
        if self._since is None:
            self._since = time.monotonic()
        self._kinds[kind] += 1
        self._last = said
        if self._kinds[kind] == 1:
            self._log.log(
                self._level, "%s %s failing (%s, while %s): %s; %s. Said once per kind of "
                "failure until %s %s", self.subject, self._is, kind, doing, said,
                self._consequence, "they" if self._is == "are" else "it", self._again)
        return True

    def works(self) -> None:
        """The subject answered: if it was failing, say that it works again."""
        if self._since is None:
            return
        kinds = ", ".join(f"{n} {kind}" for kind, n in self._kinds.most_common())
        self._log.log(self._level - 10, "%s %s after %.1f s (%d failures: %s)",
                      self.subject, self._again, time.monotonic() - self._since,
                      sum(self._kinds.values()), kinds)
        self._since = None
        self._kinds.clear()
        self._last = None
        self._kind = None


@dataclass(frozen=True)
class Outages:
    """The hub's outage reporters, one per subject (built by the lifespan)."""

    database: Outage
    ingest: Outage
    model: Outage
    training: Outage
    # `atropos serve` builds its stages once it answers (app/hub.py): a build that
    # fails leaves traces stored and not moved on, which /readyz says.
    stages: Outage = field(default_factory=lambda: Outage(
        "the background stages", "traces are stored but not compressed, batched or "
        "delivered until the hub is restarted", again="are built", plural=True))

    def __iter__(self) -> Iterator[Outage]:
        return iter((self.database, self.ingest, self.model, self.training, self.stages))

    def failing(self) -> dict[str, str]:
        """subject -> what its last failure said, for each subject failing now."""
        return {o.subject: reason for o in self if (reason := o.failing) is not None}


def training_outage() -> Outage:
    """The reporter of the training service (the target's) failing."""
    return Outage(
        "the training service",
        "batches are retried (distributor.retry), each attempt said at INFO",
        classify=lambda exc: (
            (type(exc).__name__, str(exc) or type(exc).__name__)
            if isinstance(exc, ServiceError) else None
        ),
        logger="atropos.delivery",
    )
