"""Sources: turn what an engine offers into kvscope events for the pipeline."""
