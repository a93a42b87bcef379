"""Scheduling: the continuous-batching scheduler, its output types and the per-request bookkeeping."""
