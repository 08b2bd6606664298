"""Structured output on the engine: every output matches its JSON schema,
even from random weights, because the grammar masks the logits.

The schemas are drawn by a seeded generator (nested objects, enums, arrays,
integers and numbers with bounds, booleans, required and optional fields)
and bounded (maxItems, maxLength, ranges) so a random model finishes well
inside ``max_tokens``; any "length" finish fails the test."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from paged_server.engine.core.llm_engine import LLMEngine
from paged_server.output_constraint import StructuredOutputsParams
from paged_server.sampling_params import SamplingParams

SELF_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
NUM_SCHEMAS = 60
MAX_TOKENS = 400


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A bounded JSON schema: an object at the top, nesting up to depth 2."""
    kinds = ["string", "integer", "number", "boolean", "enum", "array"]
    if depth < 2:
        kinds += ["object", "object"]
    kind = "object" if depth == 0 else rng.choice(kinds)
    if kind == "object":
        names = rng.sample(["id", "name", "score", "tags", "meta", "ok", "kind", "items"],
                           rng.randint(1, 4))
        props = {n: random_schema(rng, depth + 1) for n in names}
        required = [n for n in names if rng.random() < 0.7]
        return {"type": "object", "properties": props, "required": required,
                "additionalProperties": False}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 8)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True], rng.randint(1, 4))}
    return {"type": "array", "items": random_schema(rng, depth + 1),
            "minItems": 0, "maxItems": rng.randint(1, 3)}


def _drive(engine: LLMEngine, run_engine: Callable[..., Any],
           requests: list[tuple[str, Any, SamplingParams]]) -> Any:
    return run_engine(engine, requests, max_steps=20000)


def test_random_schemas_always_validate(make_engine: Callable[..., LLMEngine],
                                        run_engine: Callable[..., Any],
                                        prompt_of: Callable[[int, int], list[int]]) -> None:
    rng = random.Random(1234)
    schemas = [random_schema(rng) for _ in range(NUM_SCHEMAS)]
    engine = make_engine(max_model_len=512, max_batch_size=16, max_num_batched_tokens=512)
    requests = [
        (f"r{i}", prompt_of(8, i),
         SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i,
                        structured_outputs=StructuredOutputsParams(json=schema)))
        for i, schema in enumerate(schemas)
    ]
    run = _drive(engine, run_engine, requests)
    finishes = {}
    for i, schema in enumerate(schemas):
        choice = run.choices[(f"r{i}", 0)]
        finishes[choice.finish_reason] = finishes.get(choice.finish_reason, 0) + 1
        assert choice.finish_reason == "stop", (i, choice.finish_reason, choice.text, schema)
        jsonschema.validate(json.loads(choice.text), schema)
    assert finishes == {"stop": NUM_SCHEMAS}
    assert engine.audit() == []


def test_constrained_rows_batch_with_free_rows(make_engine: Callable[..., LLMEngine],
                                              run_engine: Callable[..., Any],
                                              prompt_of: Callable[[int, int], list[int]],
                                              greedy: Callable[..., SamplingParams]) -> None:
    """An unconstrained request gives the same tokens alone and beside
    constrained ones: the mask touches only its own rows."""
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}
    free = ("free", prompt_of(10, 7), greedy(max_tokens=20))
    alone = run_engine(make_engine(), [free]).tokens("free")
    json_params = SamplingParams(max_tokens=50, seed=3,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    mixed = run_engine(make_engine(), [free, ("json", prompt_of(6, 8), json_params)])
    assert mixed.tokens("free") == alone
    assert json.loads(mixed.choices[("json", 0)].text)["k"] in ("a", "b")


def test_n_choices_each_follow_their_own_grammar(make_engine: Callable[..., LLMEngine],
                                                 run_engine: Callable[..., Any],
                                                 prompt_of: Callable[[int, int], list[int]]) -> None:
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
              "minItems": 2, "maxItems": 4}
    params = SamplingParams(n=4, max_tokens=60, seed=5,
                            structured_outputs=StructuredOutputsParams(json=schema))
    run = run_engine(make_engine(), [("r", prompt_of(9, 1), params)])
    texts = [run.choices[("r", i)].text for i in range(4)]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1  # independent choices, not one matcher shared


def test_preemption_recompute_does_not_re_advance_the_grammar(
    make_engine: Callable[..., LLMEngine], run_engine: Callable[..., Any],
    prompt_of: Callable[[int, int], list[int]],
) -> None:
    """A pool too small for every sequence preempts and recomputes; the
    outputs equal those of a roomy pool and still validate."""
    schema = {"type": "object", "properties": {"xs": {"type": "array", "maxItems": 3,
              "items": {"type": "string", "maxLength": 6}}}, "required": ["xs"],
              "additionalProperties": False}

    def requests() -> list[tuple[str, list[int], SamplingParams]]:
        return [(f"r{i}", prompt_of(20, i),
                 SamplingParams(max_tokens=60, seed=i,
                                structured_outputs=StructuredOutputsParams(json=schema)))
                for i in range(6)]

    roomy = run_engine(make_engine(), requests())
    tight_engine = make_engine(num_gpu_blocks=32, enable_prefix_caching=False)
    tight = run_engine(tight_engine, requests())
    assert tight_engine.counters.preemptions > 0
    for i in range(6):
        assert tight.choices[(f"r{i}", 0)].text == roomy.choices[(f"r{i}", 0)].text
        jsonschema.validate(json.loads(tight.choices[(f"r{i}", 0)].text), schema)


def test_grammar_completes_even_with_ignore_eos(make_engine: Callable[..., LLMEngine],
                                                run_engine: Callable[..., Any],
                                                prompt_of: Callable[[int, int], list[int]]) -> None:
    params = SamplingParams(max_tokens=100, ignore_eos=True, seed=0,
                            structured_outputs=StructuredOutputsParams(json={"enum": ["yes", "no"]}))
    choice = run_engine(make_engine(), [("r", prompt_of(5, 2), params)]).choices[("r", 0)]
    assert choice.finish_reason == "stop" and json.loads(choice.text) in ("yes", "no")


def test_max_tokens_first_is_length(make_engine: Callable[..., LLMEngine],
                                    run_engine: Callable[..., Any],
                                    prompt_of: Callable[[int, int], list[int]]) -> None:
    schema = {"type": "array", "items": {"type": "string"}, "minItems": 50}
    params = SamplingParams(max_tokens=5, seed=0, structured_outputs=StructuredOutputsParams(json=schema))
    choice = run_engine(make_engine(), [("r", prompt_of(5, 2), params)]).choices[("r", 0)]
    assert choice.finish_reason == "length" and choice.text.startswith("[")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputsParams(json={"type": "string", "format": "no-such-format"}), "format"),
        (StructuredOutputsParams(json="{not json"), "not valid JSON"),
        (StructuredOutputsParams(grammar="start: ???"), "invalid grammar"),
        (StructuredOutputsParams(json={"type": "object"}, json_object=True), "exactly one"),
        # no finite output: a required property whose type is the object itself
        (StructuredOutputsParams(json=SELF_REQUIRED), "no output can ever complete"),
        (StructuredOutputsParams(grammar='start: item\nitem: "x" item\n'), "no output can ever complete"),
    ],
)
def test_bad_constraints_are_value_errors(make_engine: Callable[..., LLMEngine],
                                          spec: StructuredOutputsParams, message: str) -> None:
    with pytest.raises(ValueError, match=f"structured_outputs: .*{message}") as info:
        make_engine().add_request("r", [5, 6, 7], SamplingParams(structured_outputs=spec))
    assert "\n" not in str(info.value) and len(str(info.value)) < 300  # no parser state dump


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_tool_call_grammars_force_a_parsable_call(make_engine: Callable[..., LLMEngine],
                                                  run_engine: Callable[..., Any],
                                                  prompt_of: Callable[[int, int], list[int]],
                                                  parser: str) -> None:
    """The grammar for tool_choice=required makes the random model write
    calls in the family's format that its parser reads back."""
    from paged_server.entrypoints.openai.tool_calls import call_grammar, parse_tool_calls

    tools = [{"name": "get_time", "parameters": {"type": "object", "properties": {
                 "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}},
             {"name": "ping", "parameters": {"type": "object", "additionalProperties": False}}]
    grammar = call_grammar(parser, tools, parallel=False)
    requests = [(f"r{i}", prompt_of(6, i), SamplingParams(
        max_tokens=120, seed=i, structured_outputs=StructuredOutputsParams(grammar=grammar)))
        for i in range(4)]
    run = run_engine(make_engine(), requests)
    for i in range(4):
        choice = run.choices[(f"r{i}", 0)]
        assert choice.finish_reason == "stop", choice.text
        content, calls = parse_tool_calls(parser, choice.text)
        assert calls and content is None, choice.text
        for call in calls:
            args = json.loads(call.arguments)
            assert call.name in ("get_time", "ping") and isinstance(args, dict)
            if call.name == "get_time":
                assert args["zone"] in ("UTC", "CET")
