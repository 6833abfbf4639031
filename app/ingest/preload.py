"""Imported by the ingest processes' fork server alone (app/ingest/processes.py): the
tokenizer, loaded once there, is shared by every process forked from it instead of
each loading its own (~0.3 s and ~60 MB apiece).

The fork server also ignores SIGTERM, as its processes do: systemd, Docker and a
terminal signal the whole process group, and a fork server killed then was started
again by the next process start (an interpreter importing the hub) while the serving
process stopped. It ends when the serving process does (multiprocessing closes its
pipe), kill -9 included."""

import signal

from app.ingest.tokens import encoding

signal.signal(signal.SIGTERM, signal.SIG_IGN)
encoding()
