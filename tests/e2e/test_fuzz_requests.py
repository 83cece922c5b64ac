"""Random request bodies against the real llama-server on loopback (property-based, bounded): every one is
answered with 2xx or 4xx, never 5xx; the server stays healthy; and a slot the request does not name keeps
its cached prompt.

Slot 0 holds a cached prompt and no request may name it: a completion's "id_slot" that would pick slot 0
(absent, -1 or 0) is set to 1, and 0 in a slot action's path or in a copy's "to" becomes 1. Every other value,
the slot ids out of range among them, goes as drawn. The draws are derandomized, so CI sees the same
bodies every run; MOECACHE_FUZZ_EXAMPLES raises the count for a longer local run.
"""

from __future__ import annotations

import json
import os
from urllib.parse import quote

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from moe_cache_checks import complete  # noqa: E402
from moecache.server import ServerProcess  # noqa: E402

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
N_EXAMPLES = int(os.environ.get("MOECACHE_FUZZ_EXAMPLES", "120"))

FIELDS = ["prompt", "n_predict", "max_tokens", "id_slot", "temperature", "top_k", "top_p", "min_p", "n_probs", "seed",
          "cache_prompt", "stop", "n_keep", "n_cmpl", "logit_bias", "grammar", "json_schema", "samplers",
          "return_tokens", "messages", "content", "tokens", "to", "filename", "repeat_penalty", "dry_multiplier",
          "t_max_predict_ms", "response_fields", "min_keep", "typical_p", "n_indent", "ignore_eos"]

integers = st.one_of(st.integers(-3, 40), st.sampled_from([2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**40, 2**63 - 1,
                                                           2**64 + 7, -2**31, -2**63]))
scalars = st.one_of(st.none(), st.booleans(), integers, st.floats(-1e6, 1e6, allow_nan=False),
                    st.text(max_size=24))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.sampled_from(FIELDS + ["role", "x"]), inner,
                                                                       max_size=4)),
                      max_leaves=12)
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                           "content": st.one_of(st.text(max_size=30), values)}), max_size=3)

ENDPOINTS = ["/completion", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/apply-template",
             "/slots/{slot}?action=erase", "/slots/{slot}?action=save", "/slots/{slot}?action=restore",
             "/slots/{slot}?action=copy"]
SLOTS = st.one_of(st.sampled_from(["0", "1", "2", "-1", "99", "1abc", "4294967297", ""]), st.text(max_size=6))


def spare_slot_0(path: str, body: dict) -> tuple[str, dict]:
    """The request with every way it could name slot 0 moved to slot 1 (see the module's docstring)."""
    if path.startswith("/slots/0?"):
        path = "/slots/1?" + path.split("?", 1)[1]
    if path.startswith("/slots/") and isinstance(body.get("to"), list):
        body["to"] = [1 if (isinstance(t, int) and not isinstance(t, bool) and t == 0) else t for t in body["to"]]
    if not path.startswith("/slots/"):
        slot = body.get("id_slot")
        if slot is None or (isinstance(slot, (int, float)) and not isinstance(slot, bool) and slot in (-1, 0)):
            body["id_slot"] = 1
        body.pop("stream", None)
    return path, body


@pytest.fixture(scope="module")
def srv(tiny_model, llama_server_bin, tmp_path_factory):
    saves = tmp_path_factory.mktemp("fuzz-saves")
    args = ["-t", "2", "-c", "1024", "-np", "2", "-no-kvu", "--slot-save-path", str(saves), "--no-webui",
            "-n", "24"]
    with ServerProcess(tiny_model, args=args, timeout=120) as s:
        complete(s, PROMPT, n_predict=1, cache_prompt=True, id_slot=0)
        yield s


@settings(max_examples=N_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(endpoint=st.sampled_from(ENDPOINTS), slot=SLOTS, body=bodies, chat=messages)
def test_random_bodies_get_2xx_or_4xx_and_spare_other_slots(srv, endpoint, slot, body, chat):
    path = endpoint.format(slot=quote(slot, safe="")) if "{slot}" in endpoint else endpoint
    if endpoint == "/v1/chat/completions" and "messages" not in body:
        body["messages"] = chat
    path, body = spare_slot_0(path, body)
    status, answer = srv.post(path, body, timeout=120)
    assert status < 500, (path, json.dumps(body)[:500], status, str(answer)[:500])
    health, _ = srv.get("/health", timeout=30)
    assert health == 200, (path, body)
    assert srv.proc.poll() is None
    out = complete(srv, PROMPT, n_predict=1, cache_prompt=True, id_slot=0)
    assert out["timings"]["cache_n"] > 0, (path, body)  # slot 0 kept its prompt
