"""What a matrix *is*: the vocabulary (`terms`), the `matrix.toml` schema (`matrix`) and
the cells and layouts it expands to (`cells`).

May import: the standard library and pydantic only; nothing else of this package.
"""
