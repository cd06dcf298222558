"""The reference offload engine: tiers of real KV blocks, workloads and replay."""
