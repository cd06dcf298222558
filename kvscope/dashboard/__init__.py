"""The kvscope Dash dashboard: pure figure builders, an agent backend and the pages."""
