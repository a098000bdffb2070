"""The emulator stores a Secret as a real API server does: `stringData` is write-only, merged into `data`
(base64, winning over a `data` key of the same name) and never returned. The operator writes its Secrets
with stringData and reads them back (bus users, bus token, engine key): it must work on `data` alone."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import pytest
import requests

from kuberl.testing.emulator_server import EmulatorServer, default_crds

SECRETS = "/api/v1/namespaces/default/secrets"


@pytest.fixture(scope="module")
def emu() -> Iterator[EmulatorServer]:
    with EmulatorServer(default_crds()) as server:
        yield server


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_string_data_is_merged_into_data_and_never_returned(emu: EmulatorServer) -> None:
    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s1"}, "type": "Opaque",
            "data": {"kept": b64("old"), "both": b64("from-data")}, "stringData": {"both": "from-stringData", "new": "multi\nline"}}
    r = requests.post(emu.url + SECRETS, data=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 201, r.text
    got = requests.get(f"{emu.url}{SECRETS}/s1", timeout=30).json()
    assert "stringData" not in got
    assert got["data"] == {"kept": b64("old"), "both": b64("from-stringData"), "new": b64("multi\nline")}
    patch = {"stringData": {"kept": "patched"}}
    r = requests.patch(f"{emu.url}{SECRETS}/s1", data=json.dumps(patch), headers={"Content-Type": "application/merge-patch+json"}, timeout=30)
    assert r.status_code == 200, r.text
    assert "stringData" not in r.json() and r.json()["data"]["kept"] == b64("patched")
