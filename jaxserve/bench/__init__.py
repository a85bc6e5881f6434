"""Benchmarks: bucket policies (buckets), OpenAI-server load generator (serving), batching modes (batching)."""
