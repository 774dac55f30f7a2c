"""What `ServeConfig`, the server's settings (the door `make_server` and `python -m orca_torch.serve`
share), refuses, before any model is built or socket bound."""
from __future__ import annotations

import json
import re
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from orca_torch.serve.server import ServeConfig  # noqa: E402
from serving import serving, tiny_checkpoint  # noqa: E402

TIMEOUT = 60


@pytest.mark.parametrize("field, value, says", [
    ("model", "", "model must be non-empty text, got ''"),          # (not Path(""), this directory)
    ("model", None, "model must be non-empty text, got None"),
    ("model", 5, "model must be non-empty text, got 5"),
    ("host", "", "host must be non-empty text, got ''"),             # (not every interface)
    ("host", None, "host must be non-empty text, got None"),
    ("served_model_name", "", "served_model_name must be non-empty text (or None), got ''"),
    ("served_model_name", 5, "served_model_name must be non-empty text (or None), got 5"),
    ("log_steps", "no", "log_steps must be True or False, got 'no'"),
    ("body_timeout_s", 0, "body_timeout_s must be a finite number > 0, got 0"),
    ("body_timeout_s", "30", "body_timeout_s must be a finite number > 0, got '30' (str)"),
    ("body_memory_mib", 3, "body_memory_mib must be an integer >= 4, got 3"),     # (the largest body: 4 MiB)
    ("body_memory_mib", 4.5, "body_memory_mib must be an integer >= 4, got 4.5"),
])
def test_text_and_flag_settings_are_refused_saying_what_is_allowed(field, value, says):
    with pytest.raises(ValueError) as e:
        ServeConfig(**{field: value})
    assert says in str(e.value)


def test_settings_that_let_no_request_in_are_refused_at_the_start():
    """A K/V budget too small for a prompt of one token and one to generate: refused saying what
    sets the bound, and the engine thread it had started is stopped."""
    from orca_torch.serve.server import make_server

    def engines() -> set:
        return {t for t in threading.enumerate() if t.name == "orca-engine"}

    before = engines()
    with pytest.raises(ValueError, match=r"^with these settings no request fits \(set by --kv-slots\): give a larger "
                                         "budget$"):
        make_server(ServeConfig(model="tiny", port=0, kv_slots=1))
    assert engines() == before


def test_a_model_path_the_file_system_cannot_look_up_is_refused_as_no_checkpoint(tmp_path, capsys):
    """A name past the file system's limit: the refusal every other non-directory gets, not an OSError."""
    import os

    from orca_torch.serve.__main__ import parse

    long_path = str(tmp_path / ("a" * (os.pathconf(tmp_path, "PC_NAME_MAX") + 1)))
    with pytest.raises(ValueError, match="model must be a preset .* or a local checkpoint directory, got '.*/aaa"):
        ServeConfig(model=long_path)
    with pytest.raises(SystemExit) as exc:
        parse(["--model", long_path])
    assert exc.value.code == 2 and "error: --model must be a preset" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["a..b", "a" * 64])
def test_a_host_that_is_no_host_name_is_refused_as_naming_no_address(host, capsys):
    """Such a name (an empty label, one over 63 characters) escaped from
    socket.getaddrinfo as the idna codec's UnicodeError, printed as its message without the flag."""
    from orca_torch.serve.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--host", host, "--port", "0"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.endswith(f"error: --host {host!r} names no address (not a host name): give an "
                                              "address of this machine, e.g. 127.0.0.1"), err


def test_the_text_settings_it_takes(tmp_path):
    cfg = ServeConfig(model="tiny", served_model_name="ours", host="localhost", log_steps=True)
    assert cfg.name == "ours" and ServeConfig().name == "tiny"
    ckpt = ServeConfig(model=tmp_path)                  # a checkpoint directory as a Path, kept as its text
    assert ckpt.model == str(tmp_path) and ckpt.name == tmp_path.name


def test_a_bad_step_log_query_names_the_parameter_the_rule_and_the_value():
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for query, says in (("since=-1", 'since: Input should be greater than or equal to 0, got "-1"'),
                            ("limit=0", 'limit: Input should be greater than or equal to 1, got "0"'),
                            ("limit=10001", 'limit: Input should be less than or equal to 10000, got "10001"'),
                            ("since=x", 'since: Input should be a valid integer, unable to parse string as an '
                                        'integer, got "x"')):
            r = c.get(f"/orca/steps?{query}")
            err = r.json()["error"]
            assert r.status_code == 400 and err["message"] == says and err["param"] == query.split("=")[0]
        assert c.get("/health").status_code == 200


def test_a_query_parameter_a_route_does_not_take_is_refused_on_every_route():
    """Only `/orca/steps` refused a query parameter it does not take: the POST routes, `/health`,
    `/metrics` and `/v1/models` ignored any, so a body's parameter sent in the query
    (`?stream=true`, `?max_tokens=5`) silently did nothing. Every route now takes the parameters it
    reads only, each once, and says which."""
    body = {"prompt": "ka", "max_tokens": 2}
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for method, path, kw, says in (
                ("POST", "/v1/completions", {"json": body}, "takes no query parameters; send its parameters in the "
                                                            "JSON body"),
                ("POST", "/v1/chat/completions/", {"json": {"messages": [{"role": "user", "content": "ka"}]}},
                 "takes no query parameters; send its parameters in the JSON body"),
                ("GET", "/health", {}, "takes no query parameters"),
                ("HEAD", "/health", {}, None),
                ("GET", "/metrics", {}, "takes no query parameters"),
                ("GET", "/v1/models", {}, "takes no query parameters"),
                ("GET", "/v1/models/tiny", {}, "takes no query parameters"),
                ("GET", "/orca/steps", {}, "takes since and limit, each at most once")):
            for query, param, how in (("stream=true", "stream", "unknown"), ("x", "x", "unknown"),
                                      ("since=0&since=1", "since", "repeated" if path == "/orca/steps" else "unknown")):
                r = c.request(method, f"{path}?{query}", **kw)
                assert r.status_code == 400, (path, query, r.text)
                if says is not None:
                    err = r.json()["error"]
                    route = path.rstrip("/").replace("/tiny", "/{model_id}")
                    assert err["param"] == param and err["message"] == (f"query parameter {param!r} is {how}; "
                                                                        f"{route} {says}"), err
        assert c.post("/v1/completions", json=body).status_code == 200
        assert c.get("/orca/steps?since=0&limit=1").status_code == 200 and c.get("/health").status_code == 200


def test_a_body_with_no_content_type_is_refused_as_not_sent_as_json():
    """A body with no Content-Type was read as JSON, while one of any other type was refused: a web
    page's `fetch` of a typeless `Blob` (no Content-Type, no CORS check) could run a request. A body
    is read only where its Content-Type says JSON, as OpenAI's API has it sent."""
    body = json.dumps({"prompt": "ka", "max_tokens": 1}).encode()
    says = "the body must be JSON, sent with Content-Type: application/json; got "
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = c.post(path, content=body)                 # (httpx sends no Content-Type for raw content)
            err = r.json()["error"]
            assert r.status_code == 415 and err["param"] is None and err["message"] == says + "no Content-Type", r.text
        for media, shown in (("text/plain; charset=utf-8", '"text/plain"'), ("", '""')):
            r = c.post("/v1/completions", content=body, headers={"content-type": media})
            assert r.status_code == 415 and r.json()["error"]["message"] == says + shown, r.text
        for media in ("application/json", "Application/JSON; charset=utf-8", "application/vnd.api+json"):
            assert c.post("/v1/completions", content=body, headers={"content-type": media}).status_code == 200, media


def test_threads_are_at_most_the_machine_s_cores_as_on_the_command_line():
    """`--threads` and `api.run(threads=)` take 1 to the machine's cores; the server's settings the same."""
    import os
    cores = os.cpu_count() or 1
    for bad in (0, cores + 1, 1.0, True):
        with pytest.raises(ValueError, match=rf"threads must be an integer in \[1, {cores}\]"):
            ServeConfig(threads=bad)
    assert ServeConfig(threads=cores).threads == cores


def test_the_tokenizer_rebuild_refuses_an_output_that_is_a_file_naming_itself_as_typed(tmp_path, capsys):
    """Its usage line said `tokenizer.py`, a name no one typed: it is run as `python -m orca_torch.serve.tokenizer`."""
    from orca_torch.serve.tokenizer import main

    f = tmp_path / "f"
    f.write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(f)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m orca_torch.serve.tokenizer ")
    assert "argument --out: " in err and "exists and is not a directory" in err


def test_a_message_whose_content_is_an_empty_list_is_refused_naming_it():
    """OpenAI's API refuses `content: []`; read as empty text, it would be served. An empty string
    is text, and served."""
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for messages, i in (([{"role": "user", "content": []}], 0),
                            ([{"role": "user", "content": "ka"}, {"role": "assistant", "content": []}], 1)):
            r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "messages"
            assert err["message"] == (f"messages[{i}].content: an empty list is not content: give a string, "
                                      "or a list of at least one text part")
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": ""}], "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


def test_a_message_whose_content_is_neither_text_nor_parts_is_refused_naming_it_and_its_value():
    """`content: null` (or an object, a number) in the second message was refused with the shape
    messages take and "messages[1] is not": neither the field at fault nor what it held. The
    message now names both."""
    from orca_torch.serve.bodies import SHAPES

    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for content, shown in ((None, "null"), ({"type": "text", "text": "ka"}, '{"type": "text", "text": "ka"}'),
                               (5, "5")):
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ka"},
                                                                  {"role": "assistant", "content": content}]})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "messages"
            assert err["message"] == f"{SHAPES['messages']}; messages[1].content is {shown}"
        r = c.post("/v1/chat/completions", json={"messages": [["user", "ka"]]})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == f'{SHAPES["messages"]}; messages[0] is ["user", "ka"]'


def test_a_key_that_is_no_valid_text_is_named_as_such():
    """A key holding a lone surrogate (JSON's \\ud800 escape, which UTF-8 cannot carry) is refused
    saying so, where it is: the body's own key was refused as "the body must be a JSON object, got
    a string", and one inside stream_options or a message with that field's general shape; one of
    `metadata`'s keys was named by pydantic's replacement characters (`metadata.\ufffd\ufffd\ufffd`).
    The message says it is a key, and of which object."""
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for path, body, where, param in (
                ("/v1/completions", {"\ud800": 1, "prompt": "ka"}, "the body", None),
                ("/v1/completions", {"prompt": "ka", "stream": True, "stream_options": {"\ud800": 1}},
                 "stream_options", "stream_options"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ka", "\ud800": 1}]},
                 "messages[0]", "messages"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ka"}], "metadata": {"\ud800": "x"}},
                 "metadata", "metadata")):
            r = c.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            err = r.json()["error"]                  # (json.dumps writes the escape; httpx's json= cannot)
            assert r.status_code == 400 and err["param"] == param
            assert err["message"] == (f'a key of {where}: "\\ud800" is not valid text (a lone surrogate, which '
                                      "UTF-8 cannot carry)")
        assert c.get("/health").status_code == 200


def test_a_lone_surrogate_is_refused_in_every_string_of_a_body():
    """A lone surrogate is no text (UTF-8 cannot carry it) wherever it is: it was refused in `prompt`,
    `messages`, `stop` and `metadata`, but taken in the fields no answer reads (`user`,
    `safety_identifier`, `prompt_cache_key`, a message's `name`), and in `model` it was looked up as a
    model's name (404). Each is now a 400 saying where, in the same words (a value's place is named
    as such, never "as a key or a value")."""
    chat = {"messages": [{"role": "user", "content": "ka"}], "max_tokens": 2}
    done = {"prompt": "ka", "max_tokens": 2}
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for path, body, where, param in (
                ("/v1/completions", {**done, "user": "\ud800"}, "user", "user"),
                ("/v1/completions", {**done, "model": "\ud800"}, "model", "model"),
                ("/v1/completions", {**done, "prompt": "\ud800"}, "prompt", "prompt"),
                ("/v1/completions", {**done, "prompt": ["\ud800"]}, "prompt[0]", "prompt"),
                ("/v1/completions", {**done, "stop": "\ud800"}, "stop", "stop"),
                ("/v1/chat/completions", {**chat, "safety_identifier": "\ud800"}, "safety_identifier",
                 "safety_identifier"),
                ("/v1/chat/completions", {**chat, "prompt_cache_key": "\ud800"}, "prompt_cache_key",
                 "prompt_cache_key"),
                ("/v1/chat/completions", {**chat, "metadata": {"k": "\ud800"}}, "metadata.k", "metadata"),
                ("/v1/chat/completions", {**chat, "stop": ["a", "\ud800"]}, "stop[1]", "stop"),
                ("/v1/chat/completions", {**chat, "messages": [{"role": "\ud800", "content": "ka"}]},
                 "messages[0].role", "messages"),
                ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "ka", "name": "\ud800"}]},
                 "messages[0].name", "messages"),
                ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "\ud800"}]},
                 "messages[0].content", "messages"),
                ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [{"type": "text",
                                                                                            "text": "\ud800"}]}]},
                 "messages[0].content[0].text", "messages")):
            r = c.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param, (where, r.text)
            assert err["message"] == (f'{where}: "\\ud800" is not valid text (a lone surrogate, which UTF-8 '
                                      "cannot carry)"), err["message"]
        for path, body in (("/v1/completions", {**done, "user": "\u00e9\U0001f600"}),
                           ("/v1/chat/completions", {**chat, "safety_identifier": "\ud83d\ude00"})):
            assert c.post(path, content=json.dumps(body), headers={"content-type": "application/json"}
                          ).status_code == 200


def test_a_text_part_that_is_no_object_is_refused_in_the_client_s_terms():
    """`content: ["ka"]` (a list of strings, not of text parts) was refused as "Input should be a
    valid dictionary or instance of _TextPart", the name of a class inside the server."""
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for part, shown in (("ka", '"ka"'), (5, "5"), (None, "null")):
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}]})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "messages"
            assert err["message"] == f"messages[0].content[0] must be an object, got {shown}"


def test_a_part_that_is_not_text_is_refused_as_such():
    """An image part was refused as "unsupported key 'image_url' in messages[0].content[0]", as if
    the key were misspelt; the part's type is what is not supported."""
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for part, shown in (({"type": "image_url", "image_url": {"url": "http://x/a.png"}}, '"image_url"'),
                            ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, '"input_audio"'),
                            ({"type": 5, "text": "ka"}, "5")):
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
                {"type": "text", "text": "ka"}, part]}], "max_tokens": 1})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "messages"
            assert err["message"] == ('messages[0].content[1]: only text parts are supported (type "text"), got type '
                                      + shown)


def test_a_k_v_budget_past_the_largest_float_is_refused_as_a_usage_error(capsys, monkeypatch):
    """`--kv-slots 10**400` (or `--max-bs`) ended in an OverflowError traceback while the memory
    check wrote how much the budget needs; it is the check's one-line refusal now."""
    from orca_torch.checks import check_fits_in_memory
    from orca_torch.serve.__main__ import main

    with pytest.raises(ValueError, match=r"^x needs 1\.000E\+391 GB of memory, but only 1 MB is available here$"):
        check_fits_in_memory("x", 10**400, available=10**6)
    monkeypatch.setattr("orca_torch.checks.available_memory_bytes", lambda: 10**10)   # (whatever this machine has)
    for flag, says in (("--kv-slots", "tokens (--kv-slots) needs 5.120E+393 GB of memory"),
                       ("--max-bs", "tokens (--max-bs x the context) needs 2.621E+396 GB of memory")):
        with pytest.raises(SystemExit) as e:
            main([flag, str(10**400), "--port", "0"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and "Traceback" not in err, err


def test_a_missing_serve_extra_is_refused_naming_the_extra(capsys, monkeypatch):
    """Without uvicorn (the `serve` extra not installed) the command ended on "No module named
    'uvicorn'" alone; the usage error now says which extra to install."""
    from orca_torch.serve.__main__ import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)      # (an import of it now fails, as when absent)
    with pytest.raises(SystemExit) as e:
        main(["--port", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "uvicorn" in err and "pip install 'orca-torch[serve]'" in err, err
    assert "Traceback" not in err, err


def test_a_compressed_body_is_refused_with_415_saying_so():
    """A body sent with `Content-Encoding: gzip` was read as it came: the client was told its body
    was not valid UTF-8 (and a plain body labelled gzip was served). It is refused with 415 now."""
    import gzip

    body = json.dumps({"prompt": "ka", "max_tokens": 1}).encode()
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for coding, content in (("gzip", gzip.compress(body)), ("gzip", body), ("identity, br", body)):
            r = c.post("/v1/completions", content=content,
                       headers={"content-type": "application/json", "content-encoding": coding})
            err = r.json()["error"]
            assert r.status_code == 415 and err["param"] is None
            assert err["message"] == ("the body must be sent uncompressed (no Content-Encoding, or identity); "
                                      f"got Content-Encoding {json.dumps(coding.split(', ')[-1])}")
        r = c.post("/v1/completions", content=body,
                   headers={"content-type": "application/json", "content-encoding": "identity"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


def test_a_nan_or_infinite_value_is_quoted_as_json_writes_it():
    """An error quotes a bad value as JSON writes it (true, null), but a NaN or infinite number
    came back as Python writes it ("got nan", "temperature=inf"), a word the client never sent."""
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for raw, says in (('{"prompt": "ka", "temperature": NaN}', "temperature=NaN is not supported"),
                          ('{"prompt": "ka", "top_p": [1e999, 0.5]}', "top_p=[Infinity, 0.5] is not supported"),
                          ('{"prompt": "ka", "max_tokens": -Infinity}',
                           "max_tokens: Input should be a valid integer, got -Infinity")):
            r = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(says), r.text


@pytest.mark.parametrize("where, text, says", [
    ("generation_config.json", '{"eos_token_id": "</s>"}',
     "generation_config.json: eos_token_id must be a token id (an integer >= 0), a list of them or null, got '</s>'"),
    ("generation_config.json", '{"eos_token_id": [2, true]}', "a list of them or null, got [2, True]"),
    ("config.json", '{"eos_token_id": -1}', "config.json: eos_token_id must be a token id"),
    ("generation_config.json", '{"eos_token_id": ', "generation_config.json is not valid JSON"),
    ("generation_config.json", "[2]", "generation_config.json must hold a JSON object, got list"),
])
def test_a_checkpoint_s_bad_eos_token_id_is_refused_as_a_usage_error(tmp_path, capsys, where, text, says):
    """The end-of-sequence ids a checkpoint's config files list are read before its weights; one
    that is no token id is refused naming the file, as a usage error of the command line."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from orca_torch.serve.__main__ import main

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                            unk_token="<unk>").save_pretrained(tmp_path)
    (tmp_path / where).write_text(text)
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tmp_path), "--port", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and "Traceback" not in err, err


@pytest.mark.parametrize("name, field, says", [
    ("config.json", {"initializer_range": "x"}, "StrictDataclassFieldValidationError: Validation error for field "
     "'initializer_range': TypeError: Field 'initializer_range' expected float, got str (value: 'x')"),
    ("tokenizer_config.json", {"tokenizer_class": 5}, "AttributeError: 'int' object has no attribute"),
])
def test_a_checkpoint_file_transformers_fails_to_load_the_tokenizer_from_is_a_usage_error(tmp_path, capsys, name,
                                                                                          field, says):
    """transformers' tokenizer loader fails on a malformed file in its own ways (its config class refuses a
    config.json field of the wrong type that the model's own checks never read, `initializer_range`): each
    said as a usage error naming the checkpoint, not a traceback."""
    import json

    from orca_torch.serve.__main__ import main

    tiny_checkpoint(tmp_path).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / name).read_text())
    (tmp_path / name).write_text(json.dumps({**cfg, **field}))
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tmp_path), "--port", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert f"error: cannot load the tokenizer in {str(tmp_path)!r}: {says}" in err.strip().splitlines()[-1], err


def test_an_end_of_sequence_id_outside_the_model_s_vocabulary_is_refused_before_serving():
    """A tokenizer whose eos id the model cannot produce does not match the model: refused at the
    start, not by every request's check."""
    from orca_torch.serve.live import LiveEngine
    from orca_torch.serve.metrics import Metrics
    from orca_torch.serve.server import build

    live, _ = build(ServeConfig(model="tiny"))
    live.stop()                                         # (only its engine is reused)
    vocab = live.engine.executor.model.spec.vocab
    with pytest.raises(ValueError, match=rf"^end-of-sequence ids \[{vocab}\] lie outside the model's vocabulary "
                                         rf"\[0, {vocab}\): the tokenizer and the model do not match$"):
        LiveEngine(live.engine, Metrics("tiny"), stop_token_ids=[2, vocab])


@pytest.mark.parametrize("window", ["keep_steps", "keep_requests"])
@pytest.mark.parametrize("value", [0, -5, 2.5])
def test_the_live_engine_s_inspection_windows_hold_at_least_one_record(window, value):
    """A window of no records (a deque of maxlen 0 keeps nothing; a negative one is Python's
    'maxlen must be non-negative') is refused naming the window, before the engine starts a run."""
    from orca_torch.serve.live import LiveEngine
    from orca_torch.serve.metrics import Metrics
    from orca_torch.serve.server import build

    live, _ = build(ServeConfig(model="tiny"))
    live.stop()                                         # (only its engine is reused)
    with pytest.raises(ValueError, match=rf"^{window} must be an integer >= 1, got {value!r}"):
        LiveEngine(live.engine, Metrics("tiny"), **{window: value})


UNHONOURED = [
    ({"store": True}, "store", "store=true is not supported (this server stores no completions: leave it out or "
                               "set false)"),
    ({"service_tier": "priority"}, "service_tier",
     'service_tier="priority" is not supported (this server has one processing tier: leave it out or set "auto" or '
     '"default")'),
    ({"service_tier": "flex"}, "service_tier", 'service_tier="flex" is not supported'),
    ({"modalities": ["text", "audio"]}, "modalities",
     'modalities=["text", "audio"] is not supported (only text is generated: leave it out or set ["text"])'),
    ({"metadata": {"run": 7}}, "metadata", "metadata.run: Input should be a valid string, got 7"),
    ({"metadata": {str(i): "x" for i in range(17)}}, "metadata", "metadata: Dictionary should have at most 16 items"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "metadata.k: String should have at most 512 characters"),
    ({"metadata": {"k" * 65: "v"}}, "metadata", "metadata." + "k" * 60 + "...: String should have at most 64 char"),
    ({"metadata": {"k" * 2**20: "v"}}, "metadata", "metadata." + "k" * 60 + "...: String should have at most 64 char"),
    ({"metadata": {"a[0]": "v" * 513}}, "metadata", "metadata.a[0]: String should have at most 512 characters"),
    ({"metadata": {"str": 7}}, "metadata", "metadata.str: Input should be a valid string, got 7"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", 'parallel_tool_calls: Input should be a valid boolean, '
                                                            'got "yes"'),
    ({"safety_identifier": 5}, "safety_identifier", "safety_identifier: Input should be a valid string, got 5"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options",
     "stream_options.include_obfuscation: Input should be False, got true"),
]


def test_a_value_of_a_keeping_or_routing_parameter_the_server_cannot_honour_is_refused():
    """`store: true` asks OpenAI to keep the answer, `service_tier: "priority"` for a faster tier:
    neither exists here, so each is refused naming the values taken, as is a `metadata` OpenAI
    itself refuses (16 pairs of strings at most, keys of 64 characters, values of 512), its key
    named as the client wrote it (one holding `[`, or named `str`, was left out of the place)."""
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for extra, param, says in UNHONOURED:
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ka"}], "max_tokens": 1,
                                                     **extra})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param, r.text
            assert err["message"].startswith(says) and len(err["message"]) < 500, err["message"][:1000]


def _raw(url: str, head: bytes, body: bytes) -> bytes:
    """What the server sends back, to its closing the connection, for a request sent as these bytes
    (a socket: an HTTP client would not send a Content-Length that is wrong)."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + head +
                     b"\r\n" + body)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


def test_a_body_sent_with_a_transfer_coding_other_than_chunked_is_refused_with_501_saying_so():
    """A body sent with `Transfer-Encoding: gzip, chunked` was read de-chunked but still compressed
    (uvicorn's httptools parser takes the chunks off; its h11 parser refuses such a request itself):
    the client was told its body was not valid JSON. A transfer coding the server does not
    implement is refused with 501 (as HTTP asks), naming it; `chunked` alone is served. (The app
    is called directly, so the test does not depend on which parser uvicorn picks.)"""
    import asyncio
    import gzip

    body = json.dumps({"prompt": "ka", "max_tokens": 1}).encode()

    async def post(app, coding: str, content: bytes) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as c:
            return await asyncio.wait_for(c.post("/v1/completions", content=content, headers={
                "content-type": "application/json", "transfer-encoding": coding}), 60)

    with serving(ServeConfig(model="tiny", port=0)) as (_, _, app):
        r = asyncio.run(post(app, "gzip, chunked", gzip.compress(body)))
        assert r.status_code == 501 and r.json()["error"]["message"] == (
            'the body must be sent with no transfer coding but chunked; got Transfer-Encoding "gzip"')
        r = asyncio.run(post(app, "chunked", body))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


def test_a_body_shorter_than_its_content_length_is_refused_with_408_and_the_connection_closed():
    """uvicorn waits on a body for ever: a client whose Content-Length promised 10 bytes more than
    it sent held its connection, and a handler, until it left. The body's wait is bounded now
    (`body_timeout_s`); the client gets a 408 error object, and the connection is closed, as the
    bytes that might still come are no request."""
    body = b'{"prompt": "ka", "max_tokens": 1}'
    with serving(ServeConfig(model="tiny", port=0, body_timeout_s=0.5)) as (url, _, _):
        for head, says in ((b"Content-Length: %d\r\n" % (len(body) + 10),
                            f"{len(body)} of the {len(body) + 10} bytes its Content-Length promised came; send as "
                            "many as it says"),
                           (b"Transfer-Encoding: chunked\r\n", "5 bytes came, and no end of the chunked body")):
            sent = body if head.startswith(b"Content") else b"5\r\nhello\r\n"
            status, _, rest = _raw(url, head, sent).partition(b"\r\n")
            headers, _, answer = rest.partition(b"\r\n\r\n")
            assert status == b"HTTP/1.1 408 Request Timeout" and b"connection: close" in headers.lower(), rest
            err = json.loads(answer)["error"]
            assert err["message"] == f"the body did not arrive within 0.5 s: {says}" and err["param"] is None
        assert httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                          timeout=60).status_code == 200


def test_a_stream_asked_over_http_1_0_is_refused_with_505_saying_so():
    """An HTTP/1.0 client reads no chunked body, but uvicorn's httptools protocol sent a stream to
    one chunked all the same (`Transfer-Encoding: chunked` and the chunks' sizes among the events),
    which it read as a broken stream. It is refused now, naming `stream`; a whole answer over
    HTTP/1.0 is still served."""
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _):
        for stream, status in ((True, b"HTTP/1.1 505 HTTP Version Not Supported"), (False, b"HTTP/1.1 200 OK")):
            body = json.dumps({"prompt": "ka", "max_tokens": 1, "stream": stream}).encode()
            out = _sent(url, b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            head, _, answer = out.partition(b"\r\n\r\n")
            assert head.startswith(status) and b"transfer-encoding" not in head.lower(), out
            if stream:
                err = json.loads(answer)["error"]
                assert err["param"] == "stream" and "needs HTTP/1.1" in err["message"], err


def _sent(url: str, *data: bytes) -> bytes:
    """What the server sends back, to its closing the connection, for these bytes sent on a new
    connection (and nothing after them); part i (from 0) is sent once i whole answers have come."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=60) as sock:
        out = b""
        for i, part in enumerate(data):
            while i and not _answered(out, i):
                out += sock.recv(65536)
            sock.sendall(part)
        while chunk := sock.recv(65536):
            out += chunk
    return out


def _answered(out: bytes, n: int) -> bool:
    """Whether `out` holds `n` whole answers (each its head and its Content-Length's bytes)."""
    for _ in range(n):
        head, sep, out = out.partition(b"\r\n\r\n")
        length = re.search(rb"content-length: (\d+)", head, re.I)
        if not sep or length is None or len(out) < int(length[1]):
            return False
        out = out[int(length[1]):]
    return True


def _answers(out: bytes, n: int) -> bytes:
    """`out` after its first `n` answers, each checked to be a 200 with one token."""
    for _ in range(n):
        head, _, out = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK"), head
        length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
        assert json.loads(out[:length])["usage"]["completion_tokens"] == 1
        out = out[length:]
    return out


WHOLE_BODY = b'{"prompt": "ka", "max_tokens": 1}'
WHOLE = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
         b"Content-Length: %d\r\n\r\n" % len(WHOLE_BODY) + WHOLE_BODY)


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_headers_that_never_end_are_refused_with_408_and_the_connection_closed(parser, monkeypatch):
    """uvicorn waits on a request's headers for ever (its keep-alive timeout starts only after an
    answer, and stops at the next byte): a connection that sent nothing, part of a request line
    or of its headers, or a whole request and then, after its answer, part of the next, was held
    until its client left. That wait is bounded by `body_timeout_s` too now: a 408 error object,
    the connection closed; a connection that sent no byte is closed with nothing sent, as uvicorn's
    keep-alive closes an idle one (no request began: a 408 there answers none). Both of uvicorn's
    parsers."""
    import uvicorn.protocols.http.auto as auto
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    monkeypatch.setattr(auto, "AutoHTTPProtocol", {"httptools": HttpToolsProtocol, "h11": H11Protocol}[parser])
    with serving(ServeConfig(model="tiny", port=0, body_timeout_s=0.5)) as (url, _, _):
        assert _sent(url, b"") == b""
        for sent in ((b"POS",), (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",),
                     (WHOLE, b"POST /v1/compl")):
            out = _answers(_sent(url, *sent), len(sent) - 1)
            status, _, rest = out.partition(b"\r\n")
            headers, _, answer = rest.partition(b"\r\n\r\n")
            assert status == b"HTTP/1.1 408 Request Timeout" and b"connection: close" in headers.lower(), (sent, out)
            err = json.loads(answer)["error"]
            assert err["message"] == ("the request's headers did not arrive within 0.5 s of the connection opening "
                                      "(or, after an answer on it, of their first byte)"), err
            assert err["type"] == "invalid_request_error"
        assert httpx.post(url + "/v1/completions", content=WHOLE_BODY, headers={"content-type": "application/json"},
                          timeout=60).status_code == 200


def test_headers_past_the_bound_are_refused_with_431_before_the_connection_closes():
    """uvicorn's httptools parser takes a request's headers without bound: one connection sending
    header lines until `body_timeout_s` grew the server's memory without end (300 MiB of them took
    some 350 MiB). A head past `MAX_HEAD_BYTES` gets a 431 error object now, read by the client before
    the connection closes, while a request whose headers are large but within it is served."""
    from orca_torch.serve.limits import MAX_HEAD_BYTES

    line = b"X-A: " + b"a" * 1000 + b"\r\n"
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _):
        out = _sent(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + line * (2**20 // len(line)))
        status, _, rest = out.partition(b"\r\n")
        headers, _, answer = rest.partition(b"\r\n\r\n")
        assert status == b"HTTP/1.1 431 Request Header Fields Too Large", out[:200]
        assert b"connection: close" in headers.lower()
        assert json.loads(answer)["error"]["message"] == (f"the request's line and headers passed {MAX_HEAD_BYTES} "
                                                          "bytes, the most this server takes")
        r = httpx.post(url + "/v1/completions", content=WHOLE_BODY, timeout=TIMEOUT,
                       headers={"content-type": "application/json", "x-pad": "a" * (MAX_HEAD_BYTES // 2)})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


def _hold_the_parse(srv, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """`srv`'s body parse held: (`entered`, set once a body reaches the parse; `go`, set to let it on)."""
    entered, go = threading.Event(), threading.Event()
    parse = srv.parse_body

    def held(raw: bytes, kind: str):
        entered.set()
        assert go.wait(TIMEOUT)
        return parse(raw, kind)

    monkeypatch.setattr(srv, "parse_body", held)
    return entered, go


def test_a_pipelined_head_past_the_bound_gets_its_431_after_the_answer_under_way(monkeypatch):
    """A head past `MAX_HEAD_BYTES` that comes, pipelined, while the answer to the request before it
    is under way is refused once that answer is sent: a 431 written at once would land among the
    answer's bytes (and the answer's own writes then fail on the half-closed connection). With the
    request's parse held until the oversized head has been read (32 MiB sent, more than the
    sockets' buffers hold), the client reads the whole answer, then the 431, then the close."""
    import socket
    from urllib.parse import urlsplit

    line = b"X-A: " + b"a" * 1000 + b"\r\n"
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, app):
        srv = app.state.server
        entered, go = _hold_the_parse(srv, monkeypatch)
        where = urlsplit(url)
        try:
            with socket.create_connection((where.hostname, where.port), timeout=TIMEOUT) as sock:
                sock.sendall(WHOLE)
                assert entered.wait(TIMEOUT)
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + line * (32 * 2**20 // len(line)))
                go.set()
                out = b""
                while chunk := sock.recv(65536):
                    out += chunk
        finally:
            go.set()
        status, _, rest = _answers(out, 1).partition(b"\r\n")
        assert status == b"HTTP/1.1 431 Request Header Fields Too Large", out[:300]
        assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_an_idle_kept_alive_connection_is_closed_with_no_unasked_408(parser, monkeypatch):
    """With `body_timeout_s` below uvicorn's keep-alive (5 s), the bound on a request's headers was
    armed as an answer ended, so a connection kept alive and idle got a 408 nobody asked for: a
    client sending its next request on it at that moment would read it as that request's answer.
    Between an answer and the next byte the wait is uvicorn's keep-alive alone now, which closes
    the connection with nothing sent."""
    import uvicorn.protocols.http.auto as auto
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    monkeypatch.setattr(auto, "AutoHTTPProtocol", {"httptools": HttpToolsProtocol, "h11": H11Protocol}[parser])
    with serving(ServeConfig(model="tiny", port=0, body_timeout_s=0.5)) as (url, _, _):
        assert _answers(_sent(url, WHOLE), 1) == b""
        assert _answers(_sent(url, WHOLE + WHOLE), 2) == b""


def _bodies_held(url: str) -> float:
    """The bytes of request bodies the server says it holds (`/metrics`)."""
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return float(re.search(r"^orca:request_body_bytes_held(?:{.*})? (\S+)$", text, re.M)[1])


def test_bodies_past_the_memory_bound_are_refused_with_503_and_the_server_goes_on(monkeypatch):
    """Every body was held whole until the one parse thread reached it, with no bound on how many
    waited: clients sending large bodies faster than they are parsed could fill the memory. With the
    parse held and 3 MiB of a 4 MiB bound taken, a 2 MiB body is refused with 503 and Retry-After,
    sent with a Content-Length (refused before it is read) or chunked (as its bytes pass the bound);
    once the parse goes on, the held request is answered, the refused one sent again is too, and
    nothing is left held."""
    from orca_torch.serve.limits import MAX_BODY_BYTES

    def body(mib: int) -> bytes:
        head = b'{"prompt": "ka", "max_tokens": 1}'
        return head + b" " * (mib * 2**20 - len(head))

    def chunked(raw: bytes):
        for i in range(0, len(raw), 1 << 16):
            yield raw[i:i + (1 << 16)]

    json_type = {"content-type": "application/json"}
    with serving(ServeConfig(model="tiny", port=0, body_memory_mib=MAX_BODY_BYTES // 2**20)) as (url, _, app):
        srv = app.state.server
        entered, go = _hold_the_parse(srv, monkeypatch)
        first: dict = {}
        t = threading.Thread(target=lambda: first.update(r=httpx.post(url + "/v1/completions", content=body(3),
                                                                      headers=json_type, timeout=TIMEOUT)))
        t.start()
        try:
            assert entered.wait(TIMEOUT)
            assert _bodies_held(url) == 3 * 2**20
            for content in (body(2), chunked(body(2))):
                r = httpx.post(url + "/v1/completions", content=content, headers=json_type, timeout=TIMEOUT)
                err = r.json()["error"]
                assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                assert err["type"] == "service_unavailable" and err["message"] == (
                    "the server is busy: the request bodies it holds, being read or waiting to be parsed, would "
                    "pass its bound of 4 MiB with this one; send it again in a moment")
                assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
            assert _bodies_held(url) == 3 * 2**20
        finally:
            go.set()
            t.join(TIMEOUT)
        assert first["r"].status_code == 200 and first["r"].json()["usage"]["completion_tokens"] == 1
        r = httpx.post(url + "/v1/completions", content=body(2), headers=json_type, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
        assert _bodies_held(url) == 0


STOP_ALLOWED = ('stop must be a string or a list of at most 4 strings, each of 1 to 1000 characters (or null, "" or '
                "[] for none); ")
BAD_STOPS = [
    (5, "got 5"),
    (True, "got true"),
    ({"s": 1}, 'got {"s": 1}'),
    (["a", "b", "c", "d", "e"], "got a list of 5"),
    (["a", ""], "stop[1] is an empty string"),
    (["a", 3], "stop[1] is a number, 3"),
    ([None], "stop[0] is null, null"),
    ([["a"]], 'stop[0] is an array, ["a"]'),
    ("x" * 1001, "stop is a string of 1001 characters"),
    (["a", "x" * 2**20], "stop[1] is a string of 1048576 characters"),
]


def test_a_bad_stop_is_refused_saying_what_is_allowed():
    """`stop` takes what OpenAI's API takes: a string or a list of at most 4, none empty (and at
    most 1,000 characters each here); anything else is refused naming what is allowed and what
    came, on both endpoints. null, "" and [] are no stop strings, as clients send them."""
    bodies = {"/v1/completions": {"prompt": "ka", "max_tokens": 3},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "ka"}], "max_tokens": 3}}
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for path, body in bodies.items():
            for stop, says in BAD_STOPS:
                r = c.post(path, json={**body, "stop": stop})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == "stop" and err["code"] is None, r.text[:500]
                assert err["message"] == STOP_ALLOWED + says
            r = c.post(path, content=json.dumps({**body, "stop": ["\ud800"]}), headers={"content-type":
                                                                                        "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
            plain = c.post(path, json=body).json()["choices"][0]
            for none in (None, "", []):
                r = c.post(path, json={**body, "stop": none})
                assert r.status_code == 200 and r.json()["choices"][0] == plain, r.text
        assert c.get("/health").status_code == 200


def test_a_sampling_parameter_out_of_its_range_is_refused_saying_what_is_allowed():
    """temperature, top_p, top_k and seed are taken in their ranges (vLLM's: top_k -1 or 0 for all
    tokens); outside them, or not a JSON number, each is a 400 that names it and what it may be, on
    either endpoint, checked even where temperature 0 leaves it unused."""
    temperature = "(a number >= 0; 0 or left out is greedy decoding)"
    top_p = "(a number in (0, 1]; 1 or left out keeps every token)"
    top_k = "(an integer >= 1, or -1, 0 or left out for every token)"
    seed = "(an integer with 0 <= seed < 2**63)"
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for name, value, says in (("temperature", -0.1, f"temperature=-0.1 is not supported {temperature}"),
                                  ("temperature", "1", f'temperature="1" is not supported {temperature}'),
                                  ("temperature", True, f"temperature=true is not supported {temperature}"),
                                  ("top_p", 0, f"top_p=0 is not supported {top_p}"),
                                  ("top_p", 1.01, f"top_p=1.01 is not supported {top_p}"),
                                  ("top_k", -2, f"top_k=-2 is not supported {top_k}"),
                                  ("top_k", 2.0, f"top_k=2.0 is not supported {top_k}"),
                                  ("seed", -1, f"seed=-1 is not supported {seed}"),
                                  ("seed", 2**63, f"seed=9223372036854775808 is not supported {seed}")):
            for path, body in (("/v1/completions", {"prompt": "ka"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ka"}],
                                                         "temperature": 0})):
                r = c.post(path, json={**body, name: value, "max_tokens": 2})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == name and err["type"] == "invalid_request_error", r.text
                assert err["message"] == says, err["message"]
        for extra in ({"temperature": 0.7, "top_p": 1, "top_k": -1, "seed": 0}, {"top_k": 0, "top_p": 0.5},
                      {"temperature": 2, "top_k": 1, "seed": 2**63 - 1}):
            assert c.post("/v1/completions", json={"prompt": "ka", "max_tokens": 2, **extra}).status_code == 200, extra


def test_a_penalty_or_logit_bias_out_of_its_range_is_refused_naming_it():
    """presence_penalty and frequency_penalty are numbers from -2 to 2, repetition_penalty a number
    from 1e-6 to 1e6 (past them a seen token's logit divided or multiplied by it, then by the
    temperature, may overflow; 1e-300 made +inf and failed the engine's step), logit_bias an
    object of token ids (as strings, read as vLLM reads them, int(key), inside the vocabulary and
    each named once) to finite numbers, clamped to [-100, 100] as vLLM clamps them; any other
    value is a 400 naming the parameter and what it may be, on either endpoint, greedy or not. The
    edges, and the no-op values, are taken."""
    from orca_torch.serve.bodies import quoted_key

    pen = "(a number from -2 to 2; 0 or left out for none)"
    rep = "(a number from 1e-06 to 1e+06; 1 or left out for none)"
    bias = ('logit_bias must be an object mapping token ids, integers as strings ("42"), from 0 to 255, to finite '
            "numbers (clamped to [-100, 100])")
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for name, value, says in (("presence_penalty", 2.5, f"presence_penalty=2.5 is not supported {pen}"),
                                  ("presence_penalty", "1", f'presence_penalty="1" is not supported {pen}'),
                                  ("frequency_penalty", -2.01, f"frequency_penalty=-2.01 is not supported {pen}"),
                                  ("frequency_penalty", True, f"frequency_penalty=true is not supported {pen}"),
                                  ("repetition_penalty", 0, f"repetition_penalty=0 is not supported {rep}"),
                                  ("repetition_penalty", -1.5, f"repetition_penalty=-1.5 is not supported {rep}"),
                                  ("repetition_penalty", 1e-300, f"repetition_penalty=1e-300 is not supported {rep}"),
                                  ("repetition_penalty", 1e300, f"repetition_penalty=1e+300 is not supported {rep}"),
                                  ("repetition_penalty", 1.5e6, f"repetition_penalty=1500000.0 is not supported {rep}"),
                                  ("logit_bias", [1, 2], f"{bias}; got [1, 2]"),
                                  ("logit_bias", {"256": 1}, f"{bias}; the key '256' names token 256, outside the "
                                                             "vocabulary"),
                                  ("logit_bias", {"-1": 1}, f"{bias}; the key '-1' names token -1, outside the "
                                                            "vocabulary"),
                                  ("logit_bias", {"a": 1}, f"{bias}; the key 'a' is not an integer"),
                                  ("logit_bias", {"5.0": 1}, f"{bias}; the key '5.0' is not an integer"),
                                  ("logit_bias", {"1e2": 1}, f"{bias}; the key '1e2' is not an integer"),
                                  ("logit_bias", {"5" * 65: 1}, f"{bias}; the key {quoted_key('5' * 65)} has more "
                                                                "than 64 characters"),
                                  ("logit_bias", {"5": None}, f"{bias}; logit_bias['5'] is null"),
                                  ("logit_bias", {"5": "1"}, f"{bias}; logit_bias['5'] is \"1\""),
                                  ("logit_bias", {"5": 1, "05": 2}, f"{bias}; the keys '5' and '05' name one token"),
                                  ("logit_bias", {"5": 1, " +5 ": 2}, f"{bias}; the keys '5' and ' +5 ' name one "
                                                                      "token")):
            for path, body in (("/v1/completions", {"prompt": "ka"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ka"}],
                                                         "temperature": 0.5})):
                r = c.post(path, json={**body, name: value, "max_tokens": 2})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == name and err["type"] == "invalid_request_error", r.text
                assert err["message"] == says, err["message"]
        for extra in ({"presence_penalty": -2, "frequency_penalty": 2.0, "repetition_penalty": 1e-6},
                      {"repetition_penalty": 1e6, "temperature": 1e-5},
                      {"logit_bias": {"0": -100, "255": 100.0}}, {"logit_bias": {" 5": 101, "+6": -1e300}},
                      {"logit_bias": {}, "presence_penalty": 0, "repetition_penalty": 1, "temperature": 1}):
            assert c.post("/v1/completions", json={"prompt": "ka", "max_tokens": 2, **extra}).status_code == 200, extra
        assert c.get("/health").status_code == 200


def test_stop_token_ids_outside_the_vocabulary_or_not_ids_are_refused_naming_them():
    """`stop_token_ids` is a list of token ids inside the model's vocabulary (null or []: none), and
    not every id with `min_tokens` (none could be made before it); `include_stop_str_in_output` a
    boolean. Any other value is a 400 naming the parameter, on either endpoint."""
    ids = "stop_token_ids must be a list of token ids, integers from 0 to 255 (or null or [] for none)"
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for name, value, says in (("stop_token_ids", 5, f"{ids}; got 5"),
                                  ("stop_token_ids", [1, 256], f"{ids}; stop_token_ids[1] is 256"),
                                  ("stop_token_ids", [-1], f"{ids}; stop_token_ids[0] is -1"),
                                  ("stop_token_ids", [True], f"{ids}; stop_token_ids[0] is true"),
                                  ("stop_token_ids", ["3"], f'{ids}; stop_token_ids[0] is "3"'),
                                  ("include_stop_str_in_output", 1, "include_stop_str_in_output: Input should be a "
                                                                    "valid boolean, got 1")):
            for path, body in (("/v1/completions", {"prompt": "ka"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ka"}]})):
                r = c.post(path, json={**body, name: value, "max_tokens": 2})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == name, r.text
                assert err["message"] == says, err["message"]
        r = c.post("/v1/completions", json={"prompt": "ka", "max_tokens": 2, "min_tokens": 1,
                                            "stop_token_ids": list(range(256))})
        assert r.status_code == 400 and r.json()["error"] == {
            "message": "stop_token_ids hold every one of the 256 token ids, so none could be made before min_tokens=1; "
                       "leave a token out of them, or set min_tokens to 0",
            "type": "invalid_request_error", "param": "stop_token_ids", "code": None}
        for extra in ({"stop_token_ids": None}, {"stop_token_ids": []}, {"stop_token_ids": [0, 255]},
                      {"stop_token_ids": list(range(256))}, {"include_stop_str_in_output": False}):
            assert c.post("/v1/completions", json={"prompt": "ka", "max_tokens": 2, **extra}).status_code == 200, extra
        assert c.get("/health").status_code == 200


def test_stop_token_ids_that_with_the_model_s_eos_leave_no_token_before_min_tokens_are_refused_naming_both(tmp_path):
    """A checkpoint's end-of-sequence ids are banned before `min_tokens` beside the client's own
    `stop_token_ids` (unless `ignore_eos`): the client's ids with them may hold the whole
    vocabulary. Such a body got past the body check, which counted the client's alone, and the
    engine's refused it as "request -1" (an id no client sees) with param max_tokens."""
    import asyncio

    from orca_torch.serve.app import create_app
    from orca_torch.serve.server import build

    tiny_checkpoint(tmp_path).save_pretrained(tmp_path)
    live, tok = build(ServeConfig(model=str(tmp_path)))
    body = {"prompt": "w4 w5", "max_tokens": 2, "min_tokens": 1, "stop_token_ids": [t for t in range(300) if t != 2]}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(live, tok, "ckpt")),
                                     base_url="http://x", timeout=TIMEOUT) as c:
            return [await c.post("/v1/completions", json={**body, **extra})
                    for extra in ({}, {"n": 2}, {"ignore_eos": True}, {"min_tokens": 0})]

    try:
        refused, refused_n, *taken = asyncio.run(run())
    finally:
        live.stop()
    for r in (refused, refused_n):
        assert r.status_code == 400 and r.json()["error"] == {
            "message": "stop_token_ids and the model's end-of-sequence ids [2] (banned with them unless ignore_eos) "
                       "hold every one of the 300 token ids, so none could be made before min_tokens=1; leave a "
                       "token out of them, set ignore_eos, or set min_tokens to 0",
            "type": "invalid_request_error", "param": "stop_token_ids", "code": None}, r.text
    assert [r.status_code for r in taken] == [200, 200], [r.text for r in taken]


def test_a_request_the_engine_refuses_before_submission_is_called_the_request():
    """`LiveEngine.check` of a request `new_request` made, not yet given its id at `submit`: the
    engine's refusal named it "request -1"; it is "the request", and still says what was wrong."""
    from orca_torch.serve.server import build

    live, _ = build(ServeConfig(model="tiny"))
    try:
        ctx = live.engine.max_context
        for req, says in ((live.new_request([0] * ctx, 1), f"the request: prompt_len + output_len = {ctx} + 1 = "
                                                           f"{ctx + 1} exceeds the max context {ctx}"),
                          (live.new_request([0], 2, min_tokens=1, stop_token_ids=range(256)),
                           "the request: its stop_token_ids hold every one of the 256 token ids, so none could be "
                           "made before min_tokens=1; leave a token out of them, or set min_tokens=0")):
            with pytest.raises(ValueError) as e:
                live.check(req)
            assert str(e.value) == says
    finally:
        live.stop()


def test_echo_with_logprobs_or_not_a_boolean_is_refused_naming_it():
    """Completions' `echo` is a boolean, and not taken with `logprobs` (the prompt's tokens' log
    probabilities are not computed); chat does not take it."""
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for body, says in (
                ({"echo": True, "logprobs": 0}, "echo with logprobs is not supported (it would list the prompt's "
                                                "tokens' log probabilities, which this server does not compute): "
                                                "leave one of them out"),
                ({"echo": 1}, "echo: Input should be a valid boolean, got 1")):
            r = c.post("/v1/completions", json={"prompt": "ka", "max_tokens": 2, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
            assert r.json()["error"]["message"] == says
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ka"}], "echo": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
        for extra in ({"echo": False, "logprobs": 1}, {"echo": None}, {"echo": True, "logprobs": None}):
            assert c.post("/v1/completions", json={"prompt": "ka", "max_tokens": 2, **extra}).status_code == 200, extra


def test_a_logprobs_value_outside_its_range_is_refused_saying_what_is_allowed():
    """Completions' `logprobs` is an integer 0 to 5 (null or false: none); chat's `logprobs` true or
    false, its `top_logprobs` an integer 0 to 20, and more than 0 only with `logprobs: true`; each
    other value is a 400 naming the parameter and what it may be, and the edges are taken."""
    lp_int = ("(an integer from 0 to 5: how many most likely tokens to list beside each token's own log probability; "
              "null or false for none)")
    lp_bool = "(true to return each token's log probability, false or null for none)"
    top = "(an integer from 0 to 20: how many most likely tokens to list beside each token's own, with logprobs: true)"
    chat = {"messages": [{"role": "user", "content": "ka"}]}
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for path, body, param, says in (
                ("/v1/completions", {"prompt": "ka", "logprobs": 6}, "logprobs",
                 f"logprobs=6 is not supported {lp_int}"),
                ("/v1/completions", {"prompt": "ka", "logprobs": -1}, "logprobs",
                 f"logprobs=-1 is not supported {lp_int}"),
                ("/v1/completions", {"prompt": "ka", "logprobs": True}, "logprobs",
                 f"logprobs=true is not supported {lp_int}"),
                ("/v1/completions", {"prompt": "ka", "logprobs": 2.0}, "logprobs",
                 f"logprobs=2.0 is not supported {lp_int}"),
                ("/v1/chat/completions", {**chat, "logprobs": 1}, "logprobs", f"logprobs=1 is not supported {lp_bool}"),
                ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
                 f"top_logprobs=21 is not supported {top}"),
                ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": -1}, "top_logprobs",
                 f"top_logprobs=-1 is not supported {top}"),
                ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": "2"}, "top_logprobs",
                 f'top_logprobs="2" is not supported {top}'),
                ("/v1/chat/completions", {**chat, "top_logprobs": 2}, "top_logprobs",
                 "top_logprobs=2 needs logprobs: true (it lists the most likely tokens beside each token's own log "
                 "probability, which logprobs asks for)"),
                ("/v1/chat/completions", {**chat, "logprobs": False, "top_logprobs": 1}, "top_logprobs",
                 "top_logprobs=1 needs logprobs: true (it lists the most likely tokens beside each token's own log "
                 "probability, which logprobs asks for)")):
            r = c.post(path, json={**body, "max_tokens": 2})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error", r.text
            assert err["message"] == says, err["message"]
        for path, body in (("/v1/completions", {"prompt": "ka", "logprobs": 5}),
                           ("/v1/completions", {"prompt": "ka", "logprobs": 0}),
                           ("/v1/completions", {"prompt": "ka", "logprobs": False}),
                           ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 20}),
                           ("/v1/chat/completions", {**chat, "logprobs": False, "top_logprobs": 0})):
            r = c.post(path, json={**body, "max_tokens": 2})
            assert r.status_code == 200, (body, r.text)


def test_a_bad_n_or_best_of_is_refused_saying_what_is_allowed():
    """`n` is an integer 1 to 16 on either endpoint (null: 1); completions' `best_of` is taken only
    at n (no answers are ranked here); with a seed, choice i draws with seed + i, so seed + n - 1
    must be a seed. Each other value is a 400 naming the parameter and what it may be, and the
    edges are taken."""
    n_allowed = "(an integer from 1 to 16: how many choices to return, each its own request)"
    bodies = {"/v1/completions": {"prompt": "ka", "max_tokens": 2},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "ka"}], "max_tokens": 2}}
    with serving(ServeConfig(model="tiny", port=0)) as (url, _, _), httpx.Client(base_url=url, timeout=60) as c:
        for path, body in bodies.items():
            for extra, param, says in (
                    ({"n": 0}, "n", f"n=0 is not supported {n_allowed}"),
                    ({"n": 17}, "n", f"n=17 is not supported {n_allowed}"),
                    ({"n": 2.0}, "n", f"n=2.0 is not supported {n_allowed}"),
                    ({"n": "2"}, "n", f'n="2" is not supported {n_allowed}'),
                    ({"n": True}, "n", f"n=true is not supported {n_allowed}"),
                    ({"n": 2, "temperature": 1, "seed": 2**63 - 1}, "seed",
                     "seed=9223372036854775807 with n=2 is not supported (choice i draws with seed + i, so "
                     "seed + n - 1 must stay below 2**63)")):
                r = c.post(path, json={**body, **extra})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error", r.text
                assert err["message"] == says, err["message"]
            for extra in ({"n": 16}, {"n": 1}, {"n": None}, {"n": 2, "temperature": 1, "seed": 2**63 - 2}):
                r = c.post(path, json={**body, **extra})
                assert r.status_code == 200 and len(r.json()["choices"]) == (extra["n"] or 1), (extra, r.text)
        for best_of, n in ((2, None), (1, 3), (4, 3), (3.0, 3)):
            r = c.post("/v1/completions", json={**bodies["/v1/completions"], "best_of": best_of, "n": n})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "best_of", r.text
            assert err["message"] == (f"best_of={json.dumps(best_of)} is not supported (answers are not ranked here to "
                                      f"keep the best n: leave it out or set {n or 1}, the request's n)")
        r = c.post("/v1/completions", json={**bodies["/v1/completions"], "best_of": 3, "n": 3})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text


def test_n_choices_that_cannot_fit_the_k_v_memory_together_are_refused_naming_n():
    """Each of n choices is a request of its own, with its own K/V (no prompt is shared): n x
    (prompt + max_tokens) tokens must fit the K/V memory together (here --kv-slots 100), or the
    request is refused naming n and what set the limit; one that fits is served, and chat's
    default max_tokens is the choices' share of the memory."""
    with serving(ServeConfig(model="tiny", port=0, kv_slots=100)) as (url, live, _), \
            httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 32, "n": 3})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "n", r.text
        assert err["message"] == ("n=3 choices of 34 tokens each (2 in the prompt and 32 to generate: each choice is "
                                  "a request of its own, sharing no prompt) do not fit the K/V memory together: it "
                                  "holds 3 of at most 33 tokens each (set by --kv-slots); ask for fewer choices or "
                                  "tokens")
        r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 31, "n": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 93, r.text
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ka"}], "n": 4,
                                                 "ignore_eos": True})
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        assert u["completion_tokens"] == 4 * (25 - u["prompt_tokens"])


def test_n_choices_are_counted_in_the_paged_memory_s_whole_blocks():
    """With --memory paged, each choice holds whole blocks: 10 blocks of 16 tokens hold 3 choices of
    at most 49 tokens each (48 stored, 3 blocks; one more token takes a 4th block each), though 3 x
    53 tokens would fit as tokens. 3 x 49 is served with no choice preempted (they run side by side),
    3 x 50 is refused naming n, and chat's default max_tokens is the 49 less the prompt. 11 choices
    fit at no length (each holds a block): the refusal said "it holds 11 of at most 1 tokens each";
    it says how many choices fit."""
    with serving(ServeConfig(model="tiny", port=0, memory="paged", kv_slots=160, block_size=16)) as (url, live, _), \
            httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 48, "n": 3})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "n", r.text
        assert err["message"] == ("n=3 choices of 50 tokens each (2 in the prompt and 48 to generate: each choice is "
                                  "a request of its own, sharing no prompt) do not fit the K/V memory together: it "
                                  "holds 3 of at most 49 tokens each (set by --kv-slots, --block-size); ask for fewer "
                                  "choices or tokens")
        r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 47, "n": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3 * 47, r.text
        assert live.metrics.preemptions == 0
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ka"}], "n": 3,
                                                 "ignore_eos": True})
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        assert u["completion_tokens"] == 3 * (49 - u["prompt_tokens"]) and live.metrics.preemptions == 0
        for path, body in (("/v1/completions", {"prompt": [1], "max_tokens": 1}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ka"}]})):
            r = c.post(path, json={**body, "n": 11})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
            assert r.json()["error"]["message"] == (
                "n=11 choices do not fit the K/V memory together even at their shortest (each a request of its own, "
                "of at least 2 tokens: 1 in the prompt and 1 to generate): it holds at most 10 side by side (set by "
                "--kv-slots, --block-size); ask for at most 10 choices")
        r = c.post("/v1/completions", json={"prompt": [1], "max_tokens": 1, "n": 10})
        assert r.status_code == 200 and len(r.json()["choices"]) == 10, r.text


def _until(url: str, status: int) -> httpx.Response:
    """A one-token completion, on a new connection each time, sent until it gets `status` (at most
    `TIMEOUT` s: a connection its client closed leaves the server's count once the server reads the
    close, a moment later)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        r = httpx.post(url + "/v1/completions", content=WHOLE_BODY, headers={"content-type": "application/json"},
                       timeout=TIMEOUT)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_connections_past_max_connections_get_503_and_the_server_goes_on():
    """Nothing capped the connections served at once, each a file descriptor: clients keeping
    connections open could take every one. With max_connections=3 and three connections held open
    (sending nothing), a request on a fourth gets 503, an error object as every other refusal is
    (uvicorn's own is the plain text "Service Unavailable", which an OpenAI client cannot read as
    one) naming max_connections, with Retry-After, and its connection closed; with one of them
    closed, a request is served, and once all are closed too."""
    import socket
    from urllib.parse import urlsplit

    with serving(ServeConfig(model="tiny", port=0, max_connections=3)) as (url, _, _):
        where = urlsplit(url)
        held = [socket.create_connection((where.hostname, where.port), timeout=TIMEOUT) for _ in range(3)]
        try:
            r = _until(url, 503)
            assert r.status_code == 503 and r.headers["connection"] == "close", (r.status_code, r.text)
            assert r.headers["content-type"] == "application/json" and r.headers["retry-after"] == "1", r.headers
            err = r.json()["error"]
            assert err["type"] == "service_unavailable" and err["param"] is None, err
            assert err["message"] == ("the server serves at most 3 connections at once (--max-connections) and has "
                                      "as many open; send the request again in a moment"), err["message"]
            held.pop().close()
            r = _until(url, 200)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
        finally:
            for sock in held:
                sock.close()
        assert _until(url, 200).status_code == 200


def test_max_connections_is_refused_outside_1_to_what_the_open_file_limit_leaves(monkeypatch, capsys):
    """max_connections (`--max-connections`) is an integer from 1 to the connections the process's
    open-file limit leaves room for (here made 100); its default is 1000, or that room where less."""
    import orca_torch.serve.limits as limits
    import orca_torch.serve.server as server
    from orca_torch.serve.__main__ import parse

    for module in (server, limits):                 # (the check's, and the default's: limits.default_connections)
        monkeypatch.setattr(module, "connection_room", lambda: None)
    assert ServeConfig().connections == 1000 and ServeConfig(max_connections=5000).connections == 5000
    for module in (server, limits):
        monkeypatch.setattr(module, "connection_room", lambda: 100)
    assert ServeConfig().connections == 100 and ServeConfig(max_connections=100).connections == 100
    for value, says in ((0, "max_connections must be an integer >= 1, got 0"),
                        (2.0, "max_connections must be an integer >= 1, got 2.0"),
                        (101, "max_connections=101 is more than this process's open-file limit leaves room for: 100 "
                              "(ulimit -n, less 64 files the server keeps for its own use); give at most that, or "
                              "raise the limit")):
        with pytest.raises(ValueError) as e:
            ServeConfig(max_connections=value)
        assert str(e.value) == says
    for argv, says in ((["--max-connections", "0"], "argument --max-connections: must be an integer >= 1, got '0'"),
                       (["--max-connections", "101"], "error: --max-connections 101 is more than this process's "
                                                      "open-file limit leaves room for: 100")):
        with pytest.raises(SystemExit) as e:
            parse(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err
