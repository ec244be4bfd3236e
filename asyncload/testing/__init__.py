"""Test and benchmark harness helpers (network emulation, local servers); not used by the loader itself."""
