"""The test and benchmark harness: a local SeaweedFS server, a TCP delay line, a fault-injecting proxy and a
path checker. It lives beside the package, not in it: the loader never uses it, and a user's install
does not carry it. Tests and benchmarks import it from the repository root."""
