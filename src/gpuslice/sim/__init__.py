"""The trace simulator: replays cluster traces against the core's placement policies."""
