"""A prefill engine cannot know the decode engines' keys at start-up, so a `--frontend-keys`
folder holding decode's public key (beside the frontend's, but not prefill's own, which start-up
refuses) makes decode's key a frontend of prefill. Prefill then refuses every `PrefillMsg` that
names that decode key, the frontend ends decode's reservation at once, and the client gets an
error that says what to fix: the mistake shows at the first request, not after a key is stolen."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
from pd_servers import DECODE_FLAGS, KEYS, PREFILL_FLAGS, PdEngine, PdFrontend
from processes import WAIT_DEADLINE_S


def test_a_decode_key_on_prefills_frontend_list_fails_each_handoff_at_once(marker_dir: Path, tmp_path: Path) -> None:
    prefill = PdEngine("prefill", marker_dir, tmp_path, PREFILL_FLAGS)
    folder = tmp_path / "frontends"  # the mistake: decode's public key among the frontends'
    folder.mkdir()
    for name in ("frontend", "decode"):
        shutil.copy(prefill.keys.public(name), folder)
    prefill.argv += ["--frontend-keys", str(folder)]  # the last one counts
    # a reservation nobody ends would hold the client far past the wait below
    decode = PdEngine("decode", marker_dir, tmp_path, [*DECODE_FLAGS, "--reservation-timeout-s", "3600"])
    engines = [prefill.start(), decode.start()]
    frontend = None
    try:
        for engine in engines:
            engine.wait_ready()
        frontend = PdFrontend([prefill], [decode], marker_dir, tmp_path, KEYS).start().wait_healthy()
        response = httpx.post(f"{frontend.url}/v1/completions", headers={"authorization": "Bearer key-alice"},
                              json={"prompt": list(range(5, 13)), "max_tokens": 2}, timeout=WAIT_DEADLINE_S)
        assert response.status_code >= 500, response.text
        assert "decode_public_key is on this prefill engine's --frontend-keys" in response.json()["error"]["message"]
        assert "refused a malformed PrefillMsg" in prefill.log()
    finally:
        for process in [frontend, *engines]:
            if process is not None:
                process.kill()
