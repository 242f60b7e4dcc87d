"""The backfill driver (``charserve backfill``) against a real gateway with the deterministic
test engine: dialogue shape, user turns played by the model, resumability, bad lines,
context-window trimming, and both output formats."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from cluster.backfill.driver import Options, backfill
from cluster.backfill.plan import Plan, parse_spec, plan_dialogue, prompt_for
from tests.gateway.conftest import Gateway

CARD = {
    "spec": "chara_card_v2",
    "spec_version": "2.0",
    "data": {
        "name": "Captain Mira Vance",
        "description": "{{char}} commands the starship Wayfarer and trusts {{user}}.",
        "personality": "sharp-tongued, kind",
        "scenario": "The Wayfarer drifts near the Kessler Belt.",
        "first_mes": "Welcome aboard, {{user}}.",
        "mes_example": "",
        "creator_notes": "",
        "system_prompt": "",
        "post_history_instructions": "Stay in character as {{char}}.",
        "alternate_greetings": [],
        "tags": [],
        "creator": "",
        "character_version": "1",
        "extensions": {},
    },
}
PERSONA = {"name": "Sam", "description": "A nervous cadet on their first voyage."}


def dialogue(dialogue_id: str, **fields: Any) -> str:
    return json.dumps(
        {"id": dialogue_id, "character": CARD, "persona": PERSONA, "turns": 2, "seed": 1, **fields}
    )


def options(gateway: Gateway, **kw: Any) -> Options:
    values: dict[str, Any] = {
        "base_url": gateway.base_url,
        "api_key": None,
        "model": None,
        "concurrency": 4,
        "max_tokens": 3,
        "user_max_tokens": 2,
        "progress": False,
    }
    values.update(kw)
    return Options(**values)


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x]


def expected(n: int) -> str:
    return "".join(f" t{i}" for i in range(n)).strip()


def test_the_model_plays_the_user_with_the_roles_swapped() -> None:
    plan = plan_dialogue(parse_spec(dialogue("p"), 1), CARD)
    assert plan.greeting == "Welcome aboard, Sam."
    persona = plan.head[0]["content"]
    assert "Captain Mira Vance commands the starship Wayfarer and trusts Sam." in persona
    assert "Scenario: The Wayfarer drifts near the Kessler Belt." in persona
    assert plan.tail == [{"role": "system", "content": "Stay in character as Captain Mira Vance."}]
    history = [
        {"role": "assistant", "content": "Welcome aboard, Sam."},
        {"role": "user", "content": "Thank you, Captain."},
        {"role": "assistant", "content": "Stow your gear."},
    ]
    user_prompt = prompt_for(plan, history)
    assert user_prompt[0]["role"] == "system"
    assert user_prompt[0]["content"].startswith("You are Sam. A nervous cadet")
    assert "chatting with Captain Mira Vance" in user_prompt[0]["content"]
    assert [(m["role"], m["content"]) for m in user_prompt[1:]] == [
        ("user", "Welcome aboard, Sam."),
        ("assistant", "Thank you, Captain."),
        ("user", "Stow your gear."),
    ]
    character_prompt = prompt_for(plan, history[:2])
    assert character_prompt == [*plan.head, *history[:2], *plan.tail]
    # A scenario on the line replaces the card's.
    other = plan_dialogue(parse_spec(dialogue("q", scenario="A mutiny brews."), 1), CARD)
    assert "Scenario: A mutiny brews." in other.head[0]["content"]
    assert "Kessler" not in other.head[0]["content"]
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))).head == plan.head


async def test_backfill_writes_dialogues_then_a_rerun_does_no_new_work(
    gateway: Gateway, tmp_path: Path
) -> None:
    engine = gateway.engine
    source = tmp_path / "in.jsonl"
    out = tmp_path / "out.jsonl"
    source.write_text(
        "\n".join(
            [
                dialogue("greeted", turns=2, seed=1),
                dialogue("opened", turns=2, seed=2, opening="Captain, a word?"),
                dialogue("long", turns=3, seed=3, max_tokens=4),
            ]
        )
        + "\n"
    )
    before = len(engine.started)
    report = await backfill(source, out, options(gateway))
    assert (report.completed, report.failed, report.skipped) == (3, 0, 0)
    records = {r["id"]: r for r in read(out)}
    assert set(records) == {"greeted", "opened", "long"}

    greeted = records["greeted"]["messages"]
    assert greeted[0]["role"] == "system" and "Wayfarer" in greeted[0]["content"]
    assert [m["role"] for m in greeted[1:]] == [
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert greeted[1]["content"] == "Welcome aboard, Sam."
    # Character turns are max_tokens long, user turns user_max_tokens (the test engine).
    assert [m["content"] for m in greeted[2:]] == [expected(2), expected(3)] * 2

    opened = records["opened"]["messages"]
    assert [m["role"] for m in opened[1:]] == ["user", "assistant", "user", "assistant"]
    assert opened[1]["content"] == "Captain, a word?"
    assert [m["content"] for m in records["long"]["messages"][3::2]] == [expected(4)] * 3

    usage = records["greeted"]["usage"]
    assert usage["requests"] == 4 and usage["completion_tokens"] == 2 * 3 + 2 * 2
    assert report.requests == 4 + 3 + 6
    jobs = [engine.jobs[j] for j in engine.started[before:]]
    assert len(jobs) == report.requests
    assert {j.priority_class for j in jobs} == {"batch"}
    assert len({j.sampling["seed"] for j in jobs}) == len(jobs)  # a seed per request

    # A rerun skips every finished id: no request at all, output untouched.
    text = out.read_text()
    again = await backfill(source, out, options(gateway))
    assert (again.completed, again.skipped, again.requests) == (0, 3, 0)
    assert len(engine.started) == before + report.requests
    assert out.read_text() == text

    # After a crash mid-write (a torn last line) and with a new dialogue added, a rerun
    # cuts the torn line and does only the missing work.
    with out.open("a") as f:
        f.write('{"id": "torn", "mess')
    with source.open("a") as f:
        f.write(dialogue("added", turns=1) + "\n")
    third = await backfill(source, out, options(gateway))
    assert (third.completed, third.skipped) == (1, 3)
    assert [r["id"] for r in read(out)][-1] == "added"


async def test_bad_lines_go_to_the_errors_file_and_the_rest_goes_on(
    gateway: Gateway, tmp_path: Path
) -> None:
    source = tmp_path / "in.jsonl"
    out = tmp_path / "out.jsonl"
    huge = json.loads(json.dumps(CARD))
    huge["data"]["description"] = "word " * 3000
    source.write_text(
        "\n".join(
            [
                dialogue("ok-1"),
                "{not json",
                dialogue("ghost", character=None, character_id="char_nope"),
                json.dumps({"id": "both", "persona": PERSONA}),
                dialogue("too-long", character=huge),
                dialogue("ok-1"),
                dialogue("ok-2"),
            ]
        )
        + "\n"
    )
    report = await backfill(source, out, options(gateway))
    assert (report.completed, report.failed) == (2, 5)
    assert sorted(r["id"] for r in read(out)) == ["ok-1", "ok-2"]
    errors = {e["line"]: e for e in read(tmp_path / "out.errors.jsonl")}
    assert {n: e["code"] for n, e in errors.items()} == {
        2: "invalid_json",
        3: "unknown_character",
        4: "invalid_line",
        5: "context_length_exceeded",
        6: "duplicate_id",
    }
    assert errors[3]["id"] == "ghost" and "char_nope" in errors[3]["reason"]


async def test_stored_characters_and_the_sharegpt_format(
    gateway: Gateway, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    created = await http.post("/v1/characters", json=CARD)
    assert created.status_code == 200, created.text
    character_id = created.json()["id"]
    source = tmp_path / "in.jsonl"
    out = tmp_path / "out.jsonl"
    source.write_text(dialogue("stored", character=None, character_id=character_id) + "\n")
    report = await backfill(source, out, options(gateway, format="sharegpt"))
    assert report.completed == 1
    [record] = read(out)
    assert record["id"] == "stored"
    froms = [c["from"] for c in record["conversations"]]
    assert froms == ["system", "gpt", "human", "gpt", "human", "gpt"]
    assert "Wayfarer" in record["conversations"][0]["value"]


async def test_a_conversation_longer_than_the_window_keeps_going_with_recent_turns(
    gateway: Gateway, tmp_path: Path
) -> None:
    """The test gateway's window is 512 tokens; 8 turns of 40 tokens cannot all fit, so the
    oldest exchanges leave the prompt (never the transcript) and the dialogue completes."""
    engine = gateway.engine
    source = tmp_path / "in.jsonl"
    out = tmp_path / "out.jsonl"
    source.write_text(dialogue("marathon", turns=8, max_tokens=40) + "\n")
    before = len(engine.started)
    report = await backfill(source, out, options(gateway, user_max_tokens=40, concurrency=1))
    assert report.completed == 1, (tmp_path / "out.errors.jsonl").read_text()
    [record] = read(out)
    assert len(record["messages"]) == 1 + 1 + 16  # persona, greeting, 8 exchanges
    jobs = [engine.jobs[j] for j in engine.started[before:]]
    assert max(len(j.prompt_token_ids) + j.max_tokens for j in jobs) <= 512
    # The transcript alone is over the window: prompts must have left turns out.
    assert record["usage"]["completion_tokens"] > 512


@pytest.mark.parametrize("raw", ['{"id": "x", "character_id": "c", "turns": 0}', "[1, 2]"])
def test_parse_spec_refuses_bad_lines(raw: str) -> None:
    from cluster.backfill.plan import LineError

    with pytest.raises(LineError):
        parse_spec(raw, 1)


async def test_replicas_that_cannot_honour_seeds_make_an_unseeded_run(
    gateway: Gateway, tmp_path: Path
) -> None:
    engine = gateway.engine
    engine.seeds = False  # as vLLM's CPU engine: the gateway refuses seeds at the door
    try:
        await asyncio.sleep(0.6)  # the next heartbeats say so
        source = tmp_path / "in.jsonl"
        out = tmp_path / "out.jsonl"
        source.write_text("".join(dialogue(f"d{n}", turns=1, seed=n) + "\n" for n in range(3)))
        before = len(engine.started)
        report = await backfill(source, out, options(gateway))
    finally:
        engine.seeds = True
    assert (report.completed, report.failed) == (3, 0)
    jobs = [engine.jobs[j] for j in engine.started[before:]]
    assert jobs and all("seed" not in j.sampling for j in jobs)
