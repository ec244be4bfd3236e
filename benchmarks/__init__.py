"""asyncload's benchmarks: not installed with the package; run from a source checkout (see README.md here).

A package so that a suite imports its parts by one name (``benchmarks.peers.harness``,
``benchmarks.testbeds.netem``) wherever it is started from, instead of putting folders on ``sys.path``.
"""
