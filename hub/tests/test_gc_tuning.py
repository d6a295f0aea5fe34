"""Serving processes collect garbage rarely and never walk their start-up heap."""

import subprocess
import sys


def test_the_control_plane_app_tunes_the_collector_when_it_is_loaded():
    probe = (
        "import gc, os; os.environ['DJANGO_SETTINGS_MODULE'] = 'llmgw_site.settings'; "
        "before = gc.get_threshold(); import llmgw_site.asgi; "
        "print(before, gc.get_threshold(), gc.get_freeze_count() > 0)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split("\n")[0] == "(700, 10, 10) (100000, 50, 1000) True"
