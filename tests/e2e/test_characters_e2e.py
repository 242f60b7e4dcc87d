"""Characters and sessions with the real engine: a card imported as a PNG, then a
five-turn session whose every reply is generated from the whole conversation so far."""

from __future__ import annotations

import httpx
import pytest

from cluster.characters.cards import card_to_png
from tests.e2e.conftest import Stack

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
CARD = {
    "spec": "chara_card_v2",
    "spec_version": "2.0",
    "data": {
        "name": "Captain Mira",
        "description": (
            "{{char}} captains the airship Kestrel and calls {{user}} 'deckhand'. She grew up "
            "in the cloud harbours of Vessa, won the Kestrel in a card game against a "
            "smuggler baron, and has flown her through three wars and a hundred storms. She "
            "is proud of her crew, keeps a brass compass from her mother, hates cowardice "
            "and loves terrible jokes. The Kestrel has copper sails, a leaking starboard "
            "engine and a cat named Biscuit who sleeps on the charts."
        ),
        "personality": "bold, teasing, loyal",
        "scenario": "A storm is coming; {{char}} needs {{user}}'s help on deck.",
        "first_mes": "There you are, {{user}}! Grab a rope, the storm is close.",
        "mes_example": "<START>\n{{user}}: Hello\n{{char}}: Ahoy, deckhand!",
        "system_prompt": "",
        "post_history_instructions": "Stay in character as {{char}}.",
        "alternate_greetings": [],
        "creator_notes": "",
        "tags": [],
        "creator": "",
        "character_version": "1",
        "extensions": {},
    },
}


async def test_five_turn_session_uses_its_history(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
        created = await http.post(
            "/v1/characters", files={"file": ("mira.png", card_to_png(CARD), "image/png")}
        )
        assert created.status_code == 200, created.text
        session = (
            await http.post(
                "/v1/sessions", json={"character_id": created.json()["id"], "user_name": "Ada"}
            )
        ).json()
        assert session["greeting"].startswith("There you are, Ada!")
        prompt_tokens: list[int] = []
        previous_completion = 0
        replies: list[str] = []
        for turn in ["Hi captain!", "What should I do?", "Is the ship safe?", "Okay.", "Thanks!"]:
            resp = await http.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "session_id": session["id"],
                    "messages": [{"role": "user", "content": turn}],
                    "max_tokens": 12,
                    "temperature": 0,
                },
            )
            assert resp.status_code == 200, resp.text
            body = resp.json()
            replies.append(body["choices"][0]["message"]["content"])
            usage = body["usage"]
            if prompt_tokens:
                # This prompt holds the previous prompt, its reply and the new message...
                assert usage["prompt_tokens"] > prompt_tokens[-1] + previous_completion
                # ...and vLLM's prefix cache already held the persona and earlier turns.
                assert usage["prompt_tokens_details"]["cached_tokens"] > 0
            prompt_tokens.append(usage["prompt_tokens"])
            previous_completion = usage["completion_tokens"]
        stored = (await http.get(f"/v1/sessions/{session['id']}")).json()["messages"]
    assert len(stored) == 11  # the greeting plus five exchanges
    assert [m["content"] for m in stored[2::2]] == replies
    assert all(reply.strip() for reply in replies)


# vLLM caches whole blocks of prompt tokens: at most this many of a prompt (its last,
# partial block) are computed again when the rest is cached (128 on the CPU, 16 on GPUs).
MAX_BLOCK_TOKENS = 128


async def test_swipe_continue_impersonate_and_branch_on_the_engine(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
        character = (await http.post("/v1/characters", json=CARD)).json()
        sid = (await http.post("/v1/sessions", json={"character_id": character["id"]})).json()["id"]
        greedy = {"max_tokens": 8, "temperature": 0}
        first = await http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "session_id": sid,
                "messages": [{"role": "user", "content": "Where is Biscuit?"}],
                **greedy,
            },
        )
        assert first.status_code == 200, first.text
        swipe = await http.post(f"/v1/sessions/{sid}/swipe", json={"max_tokens": 8})
        assert swipe.status_code == 200, swipe.text
        # The swipe asks exactly the first reply's prompt, and the engine's cache has it.
        asked, again = first.json()["usage"], swipe.json()["usage"]
        assert again["prompt_tokens"] == asked["prompt_tokens"]
        cached = again["prompt_tokens_details"]["cached_tokens"]
        assert cached >= asked["prompt_tokens"] - MAX_BLOCK_TOKENS, (cached, asked)
        messages = (await http.get(f"/v1/sessions/{sid}")).json()["messages"]
        assert len(messages[-1]["swipes"]) == 2
        shown = messages[-1]["content"]
        more = await http.post(f"/v1/sessions/{sid}/continue", json=greedy)
        assert more.status_code == 200, more.text
        continued = (await http.get(f"/v1/sessions/{sid}")).json()["messages"]
        assert len(continued) == len(messages)
        assert continued[-1]["content"] == shown + more.json()["choices"][0]["message"]["content"]
        line = await http.post(f"/v1/sessions/{sid}/impersonate", json=greedy)
        assert line.status_code == 200, line.text
        assert (await http.get(f"/v1/sessions/{sid}")).json()["messages"] == continued
        branch = await http.post(f"/v1/sessions/{sid}/branch", json={"at": 3})
        bid = branch.json()["id"]
        turn = await http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "session_id": bid,
                "messages": [{"role": "user", "content": "Never mind the cat."}],
                **greedy,
            },
        )
        assert turn.status_code == 200, turn.text
        # The branch shares the conversation up to its fork, which the cache holds (all
        # of the first prompt but its post-history instruction, about a dozen tokens).
        usage = turn.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= asked["prompt_tokens"] - (
            MAX_BLOCK_TOKENS + 32
        )
        stored = (await http.get(f"/v1/sessions/{bid}")).json()["messages"]
        assert stored[:3] == continued[:3] and len(stored) == 5
        assert (await http.get(f"/v1/sessions/{sid}")).json()["messages"] == continued


async def test_a_group_sessions_prefix_stays_cached_as_the_speaker_changes(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
        ids = []
        for name in ("Mira", "Rook", "Vale"):
            data = {**CARD["data"], "name": name, "post_history_instructions": ""}
            ids.append(
                (await http.post("/v1/characters", json={**CARD, "data": data})).json()["id"]
            )
        sid = (await http.post("/v1/sessions", json={"character_ids": ids})).json()["id"]
        previous = 0
        for n, speaker in enumerate([ids[1], ids[2], ids[0]]):
            resp = await http.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "session_id": sid,
                    "speaker": speaker,
                    "messages": [{"role": "user", "content": f"Your turn, number {n}."}],
                    "max_tokens": 8,
                    "temperature": 0,
                },
            )
            assert resp.status_code == 200, resp.text
            usage = resp.json()["usage"]
            if previous:
                # All of the previous prompt but its closing nudge is cached.
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                assert cached >= previous - MAX_BLOCK_TOKENS - 16, (cached, previous)
            previous = usage["prompt_tokens"]
        stored = (await http.get(f"/v1/sessions/{sid}")).json()["messages"]
        assert [m.get("name") for m in stored if m["role"] == "assistant"] == [
            "Mira",
            "Rook",
            "Vale",
            "Mira",
        ]
