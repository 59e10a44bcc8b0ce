"""Test infrastructure shipped with the product: what tests/ and bench/ share, one module per
concept (the tiny models' specs, greedy workloads, the in-process and the Ray cluster, the fault
matrix's scenarios, the sampler's reference). Both import it as `splitserve.testing.<module>`,
never through sys.path; helpers that only tests use stay in tests/factories.py."""
