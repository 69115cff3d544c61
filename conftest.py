"""Root conftest: the place to override the matrix fixtures for this checkout.

The plugin itself is loaded through its `pytest11` entry point. For example, to force strict mode
for one site without the command-line option::

    @pytest.fixture
    def rlk_mode() -> str:
        return "strict"
"""
