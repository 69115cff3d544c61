"""judge.localise: placeholder docstring (the layer reorganisation supplies this package's own)."""
