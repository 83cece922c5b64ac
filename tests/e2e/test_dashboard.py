"""The dashboard in a real headless browser (Debian's chromium), against the real llama-server.

The server runs the tiny model with the hot-expert cache (on the CPU test device) and serves the page
from the package (--path, as moecache-server does). After one request the page, given a few seconds of
virtual time, must show non-empty expert heat, say it is live, and log nothing to the console (an
exception or a failed fetch would). A screenshot is written beside the test's files. Skipped where no
chromium is installed, except in CI (.ci/run installs it and sets MOECACHE_REQUIRE_CHROMIUM=1).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from moe_cache_checks import PROMPTS, complete
from moecache.server import ServerProcess, dashboard_dir

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and os.environ.get("MOECACHE_REQUIRE_CHROMIUM") == "1":
    raise RuntimeError("MOECACHE_REQUIRE_CHROMIUM=1 but no chromium on PATH (apt-get install chromium)")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium)")


def browse(url, *extra, budget_ms=5000):
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--virtual-time-budget={budget_ms}", "--enable-logging=stderr", "--v=0", *extra, url]
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)


@pytest.fixture
def dashboard_server(tiny_model, monkeypatch):
    monkeypatch.setenv("LLAMA_MOE_CACHE_HOST_DEVICE", "1")
    args = ["-t", "2", "-c", "1024", "--moe-cache-slots", "4", "--metrics", "--path", str(dashboard_dir())]
    with ServerProcess(tiny_model, args=args, timeout=180) as srv:
        yield srv


def test_the_page_shows_heat_after_a_request_without_console_errors(dashboard_server, tmp_path):
    complete(dashboard_server, PROMPTS[0], n_predict=16)
    r = browse(dashboard_server.url + "/", "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    cells = re.search(r'data-heat-cells="(\d+)"', r.stdout)
    assert cells and int(cells.group(1)) > 0, r.stdout[:3000]
    assert "live, " in r.stdout and "layers x" in r.stdout
    console = [line for line in r.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console
    shot = tmp_path / "dashboard.png"
    s = browse(dashboard_server.url + "/", f"--screenshot={shot}", "--window-size=1280,900")
    assert s.returncode == 0 and shot.stat().st_size > 10_000


def test_a_page_error_would_be_seen(tmp_path):
    """The check above can fail: a page that throws logs to the console, and the browser reports it."""
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>undefinedFunction();</script></body></html>")
    r = browse(bad.as_uri(), "--dump-dom", budget_ms=1000)
    assert any(":CONSOLE" in line for line in r.stderr.splitlines()), r.stderr[-2000:]


@pytest.mark.parametrize("miss,says", [([], "the CPU"),
                                       (["--moe-cache-miss", "split", "--moe-cache-miss-split-pct", "30"],
                                        "both: 30% of each layer's misses (its most-routed) on the GPU"),
                                       (["--moe-cache-miss", "auto", "--moe-cache-miss-auto-pct", "40"],
                                        "layers (while at most 40% of a layer's experts miss), else the CPU")])
def test_the_page_says_where_the_misses_run(tiny_model, monkeypatch, miss, says):
    monkeypatch.setenv("LLAMA_MOE_CACHE_HOST_DEVICE", "1")
    args = ["-t", "2", "-c", "1024", "--moe-cache-slots", "4", "--path", str(dashboard_dir()), *miss]
    with ServerProcess(tiny_model, args=args, timeout=180) as srv:
        complete(srv, PROMPTS[0], n_predict=4)
        r = browse(srv.url + "/", "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    assert says in r.stdout.replace("&nbsp;", " "), r.stdout[:3000]


def test_the_page_says_each_layers_slots_where_the_profile_sized_them(tiny_model, monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMA_MOE_CACHE_HOST_DEVICE", "1")
    profile = tmp_path / "experts.profile"
    args = ["-t", "2", "-c", "1024", "--moe-cache-slots", "4", "--path", str(dashboard_dir()),
            "--moe-cache-profile", str(profile)]
    with ServerProcess(tiny_model, args=args, timeout=180) as srv:
        complete(srv, PROMPTS[0], n_predict=4)
        srv.stop()
    head = profile.read_text().splitlines()[:2]
    narrow, wide = " ".join(["50", "50"] + ["0"] * 14), " ".join(["10"] * 16)
    profile.write_text("\n".join(head + [f"layer {il} {narrow if il % 2 == 0 else wide}" for il in range(4)] + ["end", ""]))
    with ServerProcess(tiny_model, args=[*args, "--moe-cache-slots-by-layer"], timeout=180) as srv:
        complete(srv, PROMPTS[0], n_predict=4)
        r = browse(srv.url + "/", "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2-6 slots a layer by the expert profile (4 on average) x 4 layers" in r.stdout, r.stdout[:3000]
