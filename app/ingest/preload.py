"""Imported by the ingest processes' fork server alone (app/ingest/processes.py): the
tokenizer, loaded once there, is shared by every process forked from it instead of
each loading its own (its load time and its memory, apiece).

Imported first, so that the fork server ignores SIGINT and SIGTERM from the start of
its imports (they are blocked until then), as its processes do: systemd, Docker and a
terminal signal the whole process group, and a fork server killed then (a traceback
mid-import) was started again by the next process start (an interpreter importing the
hub) while the serving process stopped. It ends when the serving process does
(multiprocessing closes its pipe), kill -9 included."""

import signal

_STOPS = (signal.SIGINT, signal.SIGTERM)
for _signal in _STOPS:
    signal.signal(_signal, signal.SIG_IGN)
# Started with them blocked (processes._start_fork_server): ignored now, so one that
# waited is discarded.
signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)

from app.tokens import encoding  # noqa: E402 (after the signals, on purpose)

encoding()
