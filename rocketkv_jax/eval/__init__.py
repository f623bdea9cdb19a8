"""Long-context evaluation harness (NIAH, RULER-style tasks, LongBench-format data)."""
