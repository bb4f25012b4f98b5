"""MODEL resolution (bundled id, alias, local directory, config.json path, hub) and its error messages."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from oomdoctor.errors import BadInput, ConfigErrors
from oomdoctor.model.load import bundled_ids, close_names, load_spec, registry_entry, spec_from_config

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------- bundled ids


def test_exact_id_resolves_to_bundled_config():
    s = load_spec("meta-llama/Llama-2-7b-hf")
    assert (s.source, s.family, s.model_type) == ("bundled", "llama-2", "llama")
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.vocab_size) == (4096, 32, 32, 32, 32000)
    assert s.num_params == 6_738_415_616
    assert s.name == "meta-llama/Llama-2-7b-hf"


def test_case_insensitive_id_and_alias():
    a = load_spec("META-LLAMA/llama-2-7B-HF")
    b = load_spec("meta-llama/Llama-2-7b-chat-hf")  # alias: same shapes as the base model
    assert a.source == b.source == "bundled"
    assert a.num_params == b.num_params == 6_738_415_616
    assert registry_entry("GPT2")["id"] == "openai-community/gpt2"
    assert registry_entry("nobody/nothing") is None


def test_bundled_ids_sorted_and_complete():
    ids = bundled_ids()
    assert ids == sorted(ids)
    assert "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T" in ids


# ---------------------------------------------------------------------------------------------- local paths


def test_local_directory_and_config_path(tmp_path, tiny_config):
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_config))
    from_dir = load_spec(str(d))
    from_file = load_spec(str(d / "config.json"))
    assert from_dir.source == from_file.source == "local"
    assert from_dir.published_params is None and from_dir.family == ""
    # Hand count for TINY_LLAMA: h=64, inter=176, 2 layers, 4 heads of 16, 2 KV heads, vocab 512, untied.
    h, inter, L, kv, V = 64, 176, 2, 2 * 16, 512
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * inter + 2 * h
    expected = V * h + L * per_layer + h + h * V
    assert from_dir.num_params == from_file.num_params == expected


def test_directory_without_config_json(tmp_path):
    with pytest.raises(BadInput) as e:
        load_spec(str(tmp_path))
    assert "without a config.json" in e.value.message
    assert e.value.hint


def test_missing_json_file(tmp_path):
    with pytest.raises(BadInput, match="no such file"):
        load_spec(str(tmp_path / "nope.json"))


def test_malformed_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"model_type": "llama",\n  "hidden_size": 64,,}')
    with pytest.raises(BadInput) as e:
        load_spec(str(p))
    assert "not valid JSON" in e.value.message and "line 2" in e.value.message


def test_non_object_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("[1, 2, 3]")
    with pytest.raises(BadInput, match="not an object"):
        load_spec(str(p))


def test_missing_fields_listed_in_one_error(tiny_config):
    cfg = dict(tiny_config)
    for k in ("hidden_size", "num_hidden_layers", "vocab_size"):
        del cfg[k]
    cfg["num_attention_heads"] = "four"
    with pytest.raises(ConfigErrors) as e:
        spec_from_config(cfg, name="broken")
    problems = e.value.problems
    assert len(problems) == 4
    for field in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"):
        assert any(field in p for p in problems), field
    assert isinstance(e.value, BadInput)  # the CLI maps it to exit code 2


def test_zero_and_bool_fields_rejected(tiny_config):
    with pytest.raises(ConfigErrors) as e:
        spec_from_config({**tiny_config, "num_hidden_layers": 0, "tie_word_embeddings": "yes"}, name="x")
    assert len(e.value.problems) == 2


def test_unknown_and_missing_model_type(tiny_config):
    with pytest.raises(BadInput) as e:
        spec_from_config({**tiny_config, "model_type": "rwkv7"}, name="x")
    assert "model kind 'rwkv7' is not supported" in e.value.message
    assert "close model kinds transformers knows: rwkv" in e.value.hint  # not transformers' list of every kind
    cfg = dict(tiny_config)
    del cfg["model_type"]
    with pytest.raises(BadInput, match="no model_type"):
        spec_from_config(cfg, name="x")


# ---------------------------------------------------------------------------------------------- unknown ids


def test_unknown_id_offline_lists_close_bundled_names(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BadInput) as e:
        load_spec("meta-llama/Llama-2-7b-instruct")
    assert "unknown model" in e.value.message
    assert "meta-llama/Llama-2-7b-hf" in e.value.hint
    assert "mistralai/Mistral-7B-v0.1" in close_names("mistral-7b")
    assert close_names("qwen2.5-14b")[0] == "Qwen/Qwen2.5-14B"


def test_unknown_id_with_nothing_close(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BadInput) as e:
        load_spec("zzzz/qqqq-xxxx")
    assert "oomdoctor models" in e.value.hint


# ---------------------------------------------------------------------------------------------- no torch


def test_spec_does_not_import_torch(tiny_config_path):
    code = (
        "import sys, oomdoctor.model.load as s\n"
        "s.load_spec('meta-llama/Llama-2-7b-hf'); s.load_spec('t5-small'); s.load_spec('gpt2')\n"
        f"s.load_spec({tiny_config_path!r})\n"
        "heavy = [m for m in ('torch', 'transformers', 'peft', 'bitsandbytes') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


# ---------------------------------------------------------------------------------------------- hub (local fake)

_TINY_CFG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 100,
}


class _FakeHub(http.server.BaseHTTPRequestHandler):
    """Answers like huggingface.co's ``/{repo}/resolve/{rev}/{file}`` endpoint for a few repositories."""

    requests: list[tuple[str, str]] = []

    def _answer(self, body: bool) -> None:
        _FakeHub.requests.append((self.command, self.path))
        if self.path == "/org/tiny/resolve/main/config.json":
            data = json.dumps(_TINY_CFG).encode()
            self.send_response(200)
            self.send_header("X-Repo-Commit", "a" * 40)
            self.send_header("ETag", '"tiny-etag"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)
            return
        code, err = {"gated": (401, "GatedRepo"), "noconfig": (404, "EntryNotFound")}.get(
            self.path.split("/")[2] if self.path.count("/") > 2 else "", (404, "RepoNotFound")
        )
        self.send_response(code)
        self.send_header("X-Error-Code", err)
        self.send_header("X-Error-Message", err)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self):  # http.server's method name
        self._answer(False)

    def do_GET(self):  # http.server's method name
        self._answer(True)

    def log_message(self, *args):
        pass


_HUB_CLIENT = """
import json
from oomdoctor.errors import BadInput
from oomdoctor.model.load import load_spec
out = {}
for m in ["org/tiny", "org/gated", "org/noconfig", "org/missing"]:
    try:
        s = load_spec(m)
        out[m] = [s.source, s.num_params]
    except BadInput as e:
        out[m] = ["error", e.message]
print(json.dumps(out))
"""


def test_hub_fetches_only_config_json(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _FakeHub.requests = []
    env = {
        **os.environ,
        "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
        "HF_HUB_CACHE": str(tmp_path),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("OOMDOCTOR_OFFLINE", None)
    try:
        out = subprocess.run(
            [sys.executable, "-c", _HUB_CLIENT], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
        )
    finally:
        server.shutdown()
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["org/tiny"] == ["hub", spec_from_config(_TINY_CFG).num_params]
    assert "gated" in res["org/gated"][1]
    assert "no config.json" in res["org/noconfig"][1]
    assert "no model 'org/missing' on the Hugging Face hub" in res["org/missing"][1]
    repo_requests = [p for _, p in _FakeHub.requests if p.startswith("/org/")]
    assert repo_requests and all(p.endswith("/resolve/main/config.json") for p in repo_requests)


def test_unreachable_hub_gives_a_clear_error(monkeypatch):
    """No HF_HUB_OFFLINE, but nothing listens at the endpoint: one connection attempt (no download retries), a clear
    message. How fast it answers: benchmarks/latency.py."""
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = "from oomdoctor.model.load import load_spec\ntry:\n    load_spec('org/some-7b')\nexcept Exception as e:\n    print(e)"
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("OOMDOCTOR_OFFLINE", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert "hub is not reachable" in out.stdout


# ---------------------------------------------------------------------------------------------- CLI


def test_models_command_json_and_table(capsys):
    from oomdoctor.cli import main

    with pytest.raises(SystemExit) as e:
        main(["models", "--json"])
    assert e.value.code in (0, None)
    rows = json.loads(capsys.readouterr().out)["models"]
    assert [r["id"] for r in rows] == bundled_ids()
    by_id = {r["id"]: r for r in rows}
    r = by_id["mistralai/Mixtral-8x7B-v0.1"]
    assert (r["params"], r["layers"], r["hidden"], r["vocab"], r["experts"]) == (46_702_792_704, 32, 4096, 32000, 8)
    assert by_id["meta-llama/Llama-2-7b-hf"]["aliases"][0] == "meta-llama/Llama-2-7b-chat-hf"

    with pytest.raises(SystemExit):
        main(["models", "GEMMA2", "--json"])  # model_type gemma2
    ids = [r["id"] for r in json.loads(capsys.readouterr().out)["models"]]
    assert ids == ["google/gemma-2-27b", "google/gemma-2-2b", "google/gemma-2-9b"]

    with pytest.raises(SystemExit):
        main(["models", "tinyllama"])
    out = capsys.readouterr().out
    assert "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T" in out and "1.10 B" in out


def test_decoder_sequence_classifier_gets_score_head(tiny_config):
    cfg = {**tiny_config, "architectures": ["LlamaForSequenceClassification"], "num_labels": 1}
    s = spec_from_config(cfg, name="reward-model")
    assert s.head_name == "score" and s.num_labels == 1 and s.head_group.out_features == 1
    assert "lm_head" not in {g.name for g in s.groups}
    causal = spec_from_config(tiny_config, name="lm")
    assert s.num_params == causal.num_params - causal.group("lm_head").total_numel + 64
