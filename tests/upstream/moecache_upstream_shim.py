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
NO_UI = "moecache builds llama-server without the web UI (LLAMA_USE_PREBUILT_UI=OFF; moecache-server serves its dashboard)"
STORIES_TEXT = "asserts the text and token counts of stories260K, which is downloaded"
SKIPS: dict[str, str] = {
    "test_basic.py::test_no_ui": NO_UI,
    "test_security.py::test_access_static_assets_without_api_key": NO_UI,
    "test_tokenize.py::test_tokenize_with_bos": "asserts stories260K's BOS token id (1)",
    "test_slot_save.py::test_slot_save_restore": STORIES_TEXT,
    "test_slot_save.py::test_slot_restore_legacy_token_list": STORIES_TEXT,
    "test_slot_save.py::test_slot_erase": STORIES_TEXT,
    "test_completion.py::test_completion": STORIES_TEXT,
    "test_completion.py::test_completion_stream": STORIES_TEXT,
    "test_completion.py::test_completion_with_openai_library": STORIES_TEXT,
    "test_completion.py::test_completion_stream_with_openai_library": STORIES_TEXT,
    "test_completion.py::test_completion_response_fields[I believe the meaning of life is-32-response_fields1]":
        STORIES_TEXT,
    "test_completion.py::test_completion_prompt_cache": STORIES_TEXT,
    "test_completion.py::test_nocache_long_input_prompt":
        "expects the prompt to overflow the context in stories260K's tokens; Gemma's tokenizer makes it fit",
    "test_completion.py::test_n_probs_post_backend_sampling":
        "expects 20 tokens from stories260K; Gemma ends the text sooner",
    "test_chat_completion.py::test_chat_completion": STORIES_TEXT,
    "test_chat_completion.py::test_chat_completion_stream": STORIES_TEXT,
    "test_chat_completion.py::test_chat_completion_cached_tokens": STORIES_TEXT,
    "test_chat_completion.py::test_chat_completion_with_openai_library": STORIES_TEXT,
    "test_chat_completion.py::test_chat_template": "asserts the prompt stories260K's chat template renders",
    "test_chat_completion.py::test_return_progress": STORIES_TEXT,
    "test_speculative.py::test_multi_requests_parallel": "asserts the text of stories15M MoE, which is downloaded",
}


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

    download = utils.download_file

    def download_local(url, output_file_path=None):
        local = models.get(url)
        if local is None:
            pytest.skip(f"downloads {url}")
        return local

    utils.download_file = download_local
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and getattr(module, "download_file", None) is download:
            module.download_file = download_local  # bound by `from utils import *`
        name = item.nodeid.split("/")[-1]
        why = SKIPS.get(name) or SKIPS.get(name.split("[")[0])
        if why:
            item.add_marker(pytest.mark.skip(reason=why))
