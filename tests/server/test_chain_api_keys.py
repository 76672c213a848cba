"""API keys as chain owners: several keys (repeated --api-key, --api-key-file), the owner is the
key's sha256, matching is by digest; the CLI collects the keys and reports a bad key file cleanly."""

from __future__ import annotations

import hashlib

import pytest

from kvc.runtime.cli import main
from kvc.runtime.errors import ConfigError
from kvc.runtime.server.auth import ApiKeys, owner_of, read_key_file


def test_owner_is_the_sha256_hex_of_the_key():
    assert owner_of("sk-1") == hashlib.sha256(b"sk-1").hexdigest()
    keys = ApiKeys(["sk-1", "sk-2", "sk-1"])
    assert len(keys) == 2 and keys
    assert keys.owner("Bearer sk-2") == owner_of("sk-2")
    assert keys.owner("bearer sk-1") == owner_of("sk-1")
    for header in ("", "Bearer", "Bearer ", "Basic sk-1", "Bearer sk-3", "sk-1"):
        assert keys.owner(header) is None, header
    assert not ApiKeys() and ApiKeys().owner("Bearer x") is None


def test_key_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team keys\nsk-a\n\n  sk-b  \n")
    assert read_key_file(str(f)) == ["sk-a", "sk-b"]
    f.write_text("# nothing\n\n")
    with pytest.raises(ConfigError, match="holds no keys"):
        read_key_file(str(f))
    f.write_text("sk a\n")
    with pytest.raises(ConfigError, match="whitespace"):
        read_key_file(str(f))
    with pytest.raises(ConfigError, match="cannot read"):
        read_key_file(str(tmp_path / "missing"))


@pytest.fixture
def captured(monkeypatch):
    import kvc.runtime.server.launch as launch

    calls = []
    monkeypatch.setattr(launch, "serve", lambda cfg, **kw: calls.append(kw) or 0)
    monkeypatch.delenv("KVC_API_KEY", raising=False)
    return calls


def test_serve_collects_repeated_keys_and_the_key_file(captured, tmp_path):
    f = tmp_path / "keys"
    f.write_text("sk-c\nsk-d\n")
    assert main(["serve", "--api-key", "sk-a", "--api-key", "sk-b", "--api-key-file", str(f)]) == 0
    assert captured[-1]["api_keys"] == ["sk-a", "sk-b", "sk-c", "sk-d"]
    assert main(["serve"]) == 0 and captured[-1]["api_keys"] == []


def test_serve_takes_the_key_from_the_environment(captured, monkeypatch):
    monkeypatch.setenv("KVC_API_KEY", "sk-env")
    assert main(["serve"]) == 0 and captured[-1]["api_keys"] == ["sk-env"]
    assert main(["serve", "--api-key", "sk-x"]) == 0 and captured[-1]["api_keys"] == ["sk-x"]


def test_bad_key_file_is_a_message_not_a_traceback(captured, tmp_path, capsys):
    assert main(["serve", "--api-key-file", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvc: error: cannot read the API key file") and "Traceback" not in err
    assert captured == []
