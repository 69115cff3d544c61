"""Optional integrations, each registered only when its plugin is active (pytest-randomly style)."""
