"""Operator tools that work from the outside: ``bench`` (load generator for any OpenAI-compatible
server) and ``plan`` (KV capacity arithmetic). Neither imports the engine or the scheduler."""
