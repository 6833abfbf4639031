"""Imported by the ingest processes' fork server alone (app/ingest/processes.py): the
tokenizer, loaded once there, is shared by every process forked from it instead of
each loading its own (~0.3 s and ~60 MB apiece)."""

from app.tokens import encoding

encoding()
