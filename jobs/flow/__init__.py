"""Flow control per key of work (issue 46): controls beside the core, each its own module."""
