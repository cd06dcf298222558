"""Offline analysis of block-access traces: reuse, miss-ratio curves, sizing advice.

One module, one job:

- :mod:`~kvscope.analysis.trace`: :class:`~kvscope.analysis.trace.AccessTrace`, the flat stream
  of block accesses every analysis reads;
- :mod:`~kvscope.analysis.inputs`: trace files -> an access trace (with
  :mod:`~kvscope.analysis.capture_reader`, the only modules here that do I/O);
- :mod:`~kvscope.analysis.stackdist`: exact LRU stack distances (Mattson et al. 1970);
- :mod:`~kvscope.analysis.mrc`: miss-ratio curves from stack distances;
- :mod:`~kvscope.analysis.shards`: SHARDS sampling (Waldspurger et al., FAST'15);
- :mod:`~kvscope.analysis.arc`: ARC (Megiddo & Modha, FAST'03) by scaled-down simulation;
- :mod:`~kvscope.analysis.reuse`: reuse statistics and the most shared prefixes;
- :mod:`~kvscope.analysis.sizing`: CPU tier sizing advice for a model preset;
- :mod:`~kvscope.analysis.report`: the whole analysis as plain data, JSON and text;
- :mod:`~kvscope.analysis.synthetic`: large seeded synthetic access streams (tests, benchmarks);
- :mod:`~kvscope.analysis.command`: the ``kvscope analyze`` subcommand.
"""
