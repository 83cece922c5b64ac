"""moecache-server serves its dashboard at the server's URL: the page ships in the
package, and the wrapper points llama-server's static path at it unless the user turns it off or serves
their own files."""

from __future__ import annotations

from moecache import server


def test_the_page_ships_in_the_package():
    page = server.dashboard_dir() / "index.html"
    text = page.read_text()
    # plain HTML and JS that reads the server's own endpoints, nothing from elsewhere
    for endpoint in ("/moe-cache", "/metrics", "/slots", "/completion"):
        assert endpoint in text
    assert "http://" not in text and "https://" not in text


def test_on_by_default_and_off_by_flag_variable_or_own_path():
    on = ["--path", str(server.dashboard_dir())]
    assert server.dashboard_args(None, ["-m", "x.gguf"], {}) == on
    assert server.dashboard_args(True, [], {"LLAMA_ARG_DASHBOARD": "0"}) == on  # the flag beats the variable
    assert server.dashboard_args(False, [], {}) == []
    assert server.dashboard_args(None, [], {"LLAMA_ARG_DASHBOARD": "off"}) == []
    assert server.dashboard_args(None, ["--path", "/srv/www"], {}) == []
    assert server.dashboard_args(None, [], {"LLAMA_ARG_STATIC_PATH": "/srv/www"}) == []


def test_the_wrapper_passes_it_to_llama_server(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 60)
    monkeypatch.setattr(server, "_server_binary", lambda: "llama-server")
    monkeypatch.delenv("LLAMA_ARG_DASHBOARD", raising=False)
    monkeypatch.delenv("LLAMA_ARG_STATIC_PATH", raising=False)
    runs = []
    monkeypatch.setattr(server, "run_forwarding", lambda cmd, env=None, ready_url=None: runs.append(cmd) or 0)
    assert server.main(["-m", str(model)]) == 0
    assert server.main(["--no-dashboard", "-m", str(model)]) == 0
    assert runs[0][runs[0].index("--path") + 1] == str(server.dashboard_dir())
    assert "--path" not in runs[1]
