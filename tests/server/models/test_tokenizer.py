"""The tokenizer wrapper against transformers' tokenizer on the same files:
chat templates render identically, ids round-trip, EOS and errors."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from paged_server.default_model import ensure_default_model
from paged_server.tokenizer import Tokenizer

# A template in the style of released checkpoints: system prompt, loops,
# raise_exception, tojson, namespace, trim/lstrip-sensitive whitespace.
RICH_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}{%- set rest = messages[1:] %}
{%- else %}
    {%- set system = 'You are helpful.' %}{%- set rest = messages %}
{%- endif %}
{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}
{%- set ns = namespace(turns=0) %}
{%- for message in rest %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}
{%- endfor %}
{%- if meta is defined %}{{ meta | tojson }}{% endif %}
{%- if tools is not none %}{{ raise_exception('tools must default to None') }}{% endif %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  Größe von 😀?  "},
        {"role": "assistant", "content": "Small."},
        {"role": "user", "content": "Why <|im_end|> though"},
    ],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_default_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def rich_dir(model_dir, tmp_path):
    path = tmp_path / "rich"
    shutil.copytree(model_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = RICH_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("which", ["default", "rich"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(which, generation_prompt, model_dir, rich_dir):
    path = model_dir if which == "default" else rich_dir
    ours, theirs = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    for messages in CONVERSATIONS:
        text = ours.apply_chat_template(messages, add_generation_prompt=generation_prompt)
        expected = theirs.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False
        )
        assert text == expected
        ids = ours.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True
        )
        assert ids == theirs(expected, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids, skip_special_tokens=False) == expected


def test_template_helpers_work(rich_dir):
    tok = Tokenizer.from_dir(rich_dir)
    text = tok.apply_chat_template(CONVERSATIONS[0], meta={"k": "ü"})
    assert '{"k": "ü"}' in text  # tojson without HTML escaping or ASCII escapes
    with pytest.raises(Exception, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_jinja_file_wins(model_dir, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(model_dir, path)
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    tok = Tokenizer.from_dir(path)
    assert tok.apply_chat_template(CONVERSATIONS[0]) == "[Hello there]"


def test_no_template_is_a_clear_error(model_dir, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(model_dir, path)
    (path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(path).apply_chat_template(CONVERSATIONS[0])


def test_encode_decode_round_trip_and_specials(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    text = "def f(x):\n    return x  # ünïcödé 😀 \t end"
    ids = tok.encode(text)
    assert ids == AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]
    assert tok.decode(ids) == text
    im_end = tok.token_to_id("<|im_end|>")
    assert tok.eos_token_id == im_end and im_end in tok.special_token_ids
    assert tok.decode([*ids, im_end]) == text
    assert tok.decode([*ids, im_end], skip_special_tokens=False) == text + "<|im_end|>"
