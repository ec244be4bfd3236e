"""The runnable benchmarks: each combines a testbed with readers and writes ``benchmarks/results/<suite>/``."""
