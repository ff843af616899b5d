"""serve/schemas.py: a sample request whose prompt leaves no room in the model's context names the prompt and the
length it may have; one that asks for too many tokens names the range that fits; what each kind of `stop` stops at."""

import pytest

from shardfit.errors import ShardfitError
from shardfit.serve.schemas import SampleBody, sample_args


def _ask(prompt_len: int, max_tokens: int, max_len: int = 8) -> str:
    body = SampleBody(prompt={"chunks": [{"type": "encoded_text", "tokens": [1] * prompt_len}]},
                      sampling_params={"max_tokens": max_tokens})
    with pytest.raises(ShardfitError) as e:
        sample_args(body, vocab=16, max_len=max_len, eos_ids={2}, has_tokenizer=False)
    return str(e.value)


@pytest.mark.parametrize("prompt_len", [8, 9, 30])
def test_a_prompt_that_fills_the_context_names_the_prompt(prompt_len):
    assert _ask(prompt_len, 1) == (f"/asample prompt: the prompt has {prompt_len} tokens and the model's context is "
                                   "max_seq_len=8: no room for a new token; fix: send a prompt of at most 7 tokens")


def test_too_many_tokens_names_the_range_that_fits():
    assert _ask(5, 4).endswith("sampling_params.max_tokens: prompt (5 tokens) + max_tokens=4 exceeds the model's "
                               "max_seq_len=8; fix: ask for 1 to 3 tokens")
    assert _ask(7, 0).endswith("max_tokens=0 is not a positive integer; fix: ask for 1 or more tokens")


@pytest.mark.parametrize("stop, tokens, strings", [
    (None, [2], []),  # EOS
    ([], [], []),  # nothing: max_tokens
    ([5, 7], [5, 7], []),  # those ids
    # strings and EOS, as Tinker's sampler (tinker-cookbook's RoleColonRenderer.parse_response reads a base model's
    # sample that ended at EOS without its "\n\nUser:"): without EOS a sample ran on past it to max_tokens
    (["\n\nUser:"], [2], ["\n\nUser:"]),
    ("User:", [2], ["User:"]),
])
def test_what_each_stop_stops_at(stop, tokens, strings):
    body = SampleBody(prompt={"chunks": [{"type": "encoded_text", "tokens": [1]}]},
                      sampling_params={"max_tokens": 2, "stop": stop})
    p = sample_args(body, vocab=16, max_len=8, eos_ids={2}, has_tokenizer=True)["params"]
    assert (p["stop_tokens"], p["stop_strings"]) == (tokens, strings)


@pytest.mark.parametrize("stop, needle", [
    (["x"] * 65, "65 stop strings, the longest 1 characters"),
    (["a" * 1025], "1 stop strings, the longest 1025 characters"),
])
def test_stop_strings_are_bounded(stop, needle):
    """Each sampled token of each row searches a decoded tail for every stop string, on the command loop: thousands
    of them, or one of megabytes, would hold every other request for seconds to minutes."""
    body = SampleBody(prompt={"chunks": [{"type": "encoded_text", "tokens": [1]}]},
                      sampling_params={"max_tokens": 2, "stop": stop})
    with pytest.raises(ShardfitError) as e:
        sample_args(body, vocab=16, max_len=8, eos_ids={2}, has_tokenizer=True)
    assert str(e.value) == (f"/asample sampling_params.stop: {needle}; fix: send at most 64 strings of at most 1024 "
                            "characters each")
    ok = SampleBody(prompt=body.prompt, sampling_params={"max_tokens": 2, "stop": ["x" * 1024] * 64})
    assert len(sample_args(ok, vocab=16, max_len=8, eos_ids={2}, has_tokenizer=True)["params"]["stop_strings"]) == 64
