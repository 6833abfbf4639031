"""OTLP/HTTP traces: the receiver (spans in, committed before the answer) and the store
of spans waiting for the assembly stage (app/stages/assembly.py)."""
