"""Careless and hostile requests: every integer is read as the integer it is, a slot action acts on the
slot it names or on none, and a missing field is the client's error, all with a 400 that names the
problem, while the other slots' cached prompts stay as they were.

Before the fix (tried on the CPU build): POST /slots/2?action=erase on a 2-slot server erased slot 0,
/slots/99?action=save answered 200, /slots/-1?action=erase answered success, "id_slot": 99 ran on a slot,
{"to": [4294967297]} copied into slot 1, "n_predict": 99999999999999 ran as 276447231, and a slot save
with {} was a 500 with the JSON library's message.
"""

from __future__ import annotations

import pytest

from moe_cache_checks import complete
from moecache.server import ServerProcess

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
OTHER = "The committee met on Tuesday to discuss the budget for the coming year, and"


@pytest.fixture(scope="module")
def srv(tiny_model, llama_server_bin, tmp_path_factory):
    saves = tmp_path_factory.mktemp("slot-saves")
    args = ["-t", "2", "-c", "1024", "-np", "2", "-no-kvu", "--slot-save-path", str(saves), "--no-webui"]
    with ServerProcess(tiny_model, args=args, timeout=120) as s:
        yield s


def cached(srv, slot, prompt):
    """The tokens a request for `prompt` on `slot` finds cached there (and caches it again)."""
    return complete(srv, prompt, n_predict=1, cache_prompt=True, id_slot=slot)["timings"]["cache_n"]


def fill(srv):
    complete(srv, PROMPT, n_predict=1, cache_prompt=True, id_slot=0)
    complete(srv, OTHER, n_predict=1, cache_prompt=True, id_slot=1)


def error_of(status, body):
    assert status == 400, (status, body)
    return body["error"]["message"] if isinstance(body, dict) else str(body)


@pytest.mark.parametrize("path,body", [
    ("/slots/2?action=erase", None),
    ("/slots/-1?action=erase", None),
    ("/slots/1abc?action=erase", None),
    ("/slots/4294967296?action=erase", None),
    ("/slots/99?action=save", {"filename": "x.bin"}),
    ("/slots/2?action=restore", {"filename": "x.bin"}),
    ("/slots/2?action=copy", {"to": [0]}),
])
def test_a_slot_id_out_of_range_names_no_slot(srv, path, body):
    fill(srv)
    msg = error_of(*srv.post(path, body if body is not None else {}))
    assert "out of range: this server has 2 slot(s)" in msg, msg
    assert cached(srv, 0, PROMPT) > 0 and cached(srv, 1, OTHER) > 0  # nothing erased


@pytest.mark.parametrize("to", [[4294967297], [2], [-1], ["1"], 1])
def test_a_copy_target_out_of_range_is_refused(srv, to):
    fill(srv)
    msg = error_of(*srv.post("/slots/0?action=copy", {"to": to}))
    assert '"to"' in msg, msg
    assert cached(srv, 1, OTHER) > 0  # slot 1 kept its own prompt


@pytest.mark.parametrize("id_slot", [2, 99, -2, 4294967297])
def test_a_completion_on_a_slot_out_of_range_is_refused(srv, id_slot):
    msg = error_of(*srv.post("/completion", {"prompt": PROMPT, "n_predict": 2, "id_slot": id_slot}))
    assert f"id_slot {id_slot} is out of range" in msg, msg


def test_a_named_slot_is_the_one_used(srv):
    out = complete(srv, PROMPT, n_predict=2, id_slot=1)
    assert out["id_slot"] == 1


@pytest.mark.parametrize("field,value", [("n_predict", 99999999999999), ("n_predict", 4294967296),
                                         ("n_predict", 2147483648), ("top_k", 2**40), ("n_probs", 2**33),
                                         ("seed", -5)])
def test_an_integer_that_does_not_fit_is_refused(srv, field, value):
    msg = error_of(*srv.post("/completion", {"prompt": PROMPT, field: value}))
    assert field in msg and str(value) in msg, msg


def test_a_missing_or_malformed_field_is_the_client_s_error(srv):
    assert "missing" in error_of(*srv.post("/slots/0?action=save", {}))
    assert "missing" in error_of(*srv.post("/slots/0?action=restore", {}))
    error_of(*srv.post("/slots/0?action=save", []))
    error_of(*srv.post("/completion", {"n_predict": 2}))  # no prompt


def test_documented_meanings_of_edge_values(srv):
    """What upstream does with edge values, kept and documented (docs/troubleshooting.md): a negative
    temperature is greedy (clamped to 0); an empty prompt string is answered with an empty completion,
    nothing evaluated or generated; an empty token list is refused; an empty `messages` list renders the
    chat template's generation prompt alone and generates from it."""
    greedy = complete(srv, PROMPT, n_predict=6, temperature=0)
    negative = complete(srv, PROMPT, n_predict=6, temperature=-1)
    assert negative["tokens"] == greedy["tokens"]
    empty = complete(srv, "", n_predict=4)
    assert (empty["content"], empty["tokens_evaluated"], empty["tokens_predicted"]) == ("", 0, 0)
    assert "must not be empty" in error_of(*srv.post("/completion", {"prompt": [], "n_predict": 4}))
    status, body = srv.post("/v1/chat/completions", {"messages": [], "max_tokens": 3, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "length"
