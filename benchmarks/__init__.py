"""asyncjobq's benchmark suite: `make bench` / `make bench-quick` (see benchmarks/README.md)."""
