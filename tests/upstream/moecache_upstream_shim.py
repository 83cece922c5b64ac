"""A pytest plugin for llama.cpp's own server tests (tools/server/tests of the pinned tree, run from the
applied vendor/llama.cpp) against the series' llama-server: the models those tests download are replaced
by local ones, and the tests that assert one particular model's text are skipped with that reason.

    MOECACHE_UPSTREAM_MODELS='{"ggml-org/test-model-stories260K": "/path/gemma.gguf", ...}'
    LLAMA_SERVER_BIN_PATH=/path/llama-server
    python -m pytest -p moecache_upstream_shim vendor/llama.cpp/tools/server/tests/unit/test_basic.py

A preset whose model has no local stand-in (embeddings, rerankers, vision, infill) makes its tests skip.
"""

from __future__ import annotations

import json
import os

import pytest

# test -> why it cannot pass with another model than the one it downloads (upstream asserts that model's text)
SKIPS: dict[str, str] = {}


def _local_models() -> dict[str, str]:
    return json.loads(os.environ.get("MOECACHE_UPSTREAM_MODELS", "{}"))


def pytest_collection_modifyitems(config, items):
    import utils  # upstream's, imported by its conftest

    models = _local_models()
    utils.ServerPreset.load_all = staticmethod(lambda: None)  # nothing to download
    start = utils.ServerProcess.start

    def start_with_local_model(self, *args, **kwargs):
        repo = self.model_hf_repo
        if repo is not None:
            key = repo if self.model_hf_file is None else f"{repo}/{self.model_hf_file}"
            local = models.get(key) or models.get(repo)
            if local is None:
                pytest.skip(f"no local stand-in for the model {key} (it would be downloaded)")
            self.model_file, self.model_hf_repo, self.model_hf_file = local, None, None
            self.offline = False
        if self.model_url is not None:
            pytest.skip(f"downloads {self.model_url}")
        return start(self, *args, **kwargs)

    utils.ServerProcess.start = start_with_local_model
    for item in items:
        for pattern, why in SKIPS.items():
            if pattern in item.nodeid:
                item.add_marker(pytest.mark.skip(reason=why))
