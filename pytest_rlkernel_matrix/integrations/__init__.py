"""Optional integrations, each registered only when its plugin is active (pytest-randomly style);
`pytest_core`: pytest's own plugins (junitxml, cacheprovider, the terminal's summary, the
informational commands) as a pytest user expects them to work with cells."""
