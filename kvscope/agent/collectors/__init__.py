"""Collectors: read the node (host memory, GPUs) at scrape time."""
