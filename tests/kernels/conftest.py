import pytest


@pytest.fixture(autouse=True)
def _slow_is_opt_in(request):
    """`slow` tests run only when selected with `-m slow` (the marker is documented as opt-in)."""
    if request.node.get_closest_marker("slow") and "slow" not in (
        request.config.getoption("markexpr") or ""
    ):
        pytest.skip("slow test: select it with -m slow")
