"""--api-key and --api-key-file: which keys a server takes, and the names their usage is counted under."""

from __future__ import annotations

import pytest

from strata.server.api_keys import load_api_keys
from strata.server.config import ServerConfig


def test_no_keys_and_the_single_key():
    assert load_api_keys(None, None) == {}
    assert load_api_keys("s3cret-key", None) == {"s3cret-key": "default"}


def test_a_key_file_names_each_key(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\n\nalice  key-of-alice-1\nbob\tkey-of-bob-22\n")
    assert load_api_keys("s3cret-key", str(path)) == {
        "s3cret-key": "default",
        "key-of-alice-1": "alice",
        "key-of-bob-22": "bob",
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("alice\n", "line 1: expected 'NAME KEY'"),
        ("alice key one-more\n", "line 1: expected 'NAME KEY'"),
        ("al/ice key-of-alice\n", "line 1: the name must be"),
        ("alice short\n", "line 1: the key of 'alice' is shorter than 8"),
        (
            "alice key-of-alice\nalice key-of-other\n",
            "line 2: the name 'alice' is used",
        ),
        (
            "a key-of-alice\nb key-of-alice\n",
            "line 2: the key of 'b' is also the key of 'a'",
        ),
        ("# nothing but a comment\n", "holds no key"),
        ("default key-of-alice\n", "the name 'default' is used twice"),
    ],
)
def test_a_bad_key_file_says_which_line_and_what_to_fix(tmp_path, text, message):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_api_keys("s3cret-key" if "default" in text else None, str(path))


def test_the_server_config_refuses_an_unreadable_or_bad_key_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read --api-key-file"):
        ServerConfig(api_key_file=str(tmp_path / "missing"))
    (tmp_path / "keys").write_text("alice\n")
    with pytest.raises(ValueError, match="line 1"):
        ServerConfig(api_key_file=str(tmp_path / "keys"))
