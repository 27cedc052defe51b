"""The nemesis: pgwork's promises as properties, checked against generated schedules.

A schedule (``schedule.py``) is data made from a seed: the daemons' configuration, the apps'
writes (shapes of sources, reminders, due times, series of every rule kind, floods inserted or
moved by UPDATE), edits of every column an app may write at a chosen point of a send's life,
and faults (SIGKILL, SIGSTOP past the lease, a database's immediate stop, a migrate killed at a
step, a pid reused, an app holding locks). ``world.py`` runs one against real daemon processes,
a real HTTP receiver and a real PostgreSQL; ``oracle.py`` judges what happened: the queue's
invariant, every wanted occurrence delivered under one idempotency key, nothing sent that an
edit had closed before its claim, every other app's reminder within the isolation bound.

``test_nemesis.py`` runs a fixed set of seeds in the suite; ``python -m bench.torture`` runs
random ones for as long as it is told and writes a report. A failure prints its seed and a
shrunk schedule, written as Python so that it can become a regular test."""
