"""Lifeline's policies as pure functions and small classes.

Nothing here imports Django: the gateway, the Celery tasks and the benchmarks
all call the same code, and the tests can check it exhaustively.
"""
