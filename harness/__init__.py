"""What the tests and the benchmarks both start: databases, stacks, nodes and real engines.

Neither `tests` nor `benchmarks` imports the other; both import this package.
"""
