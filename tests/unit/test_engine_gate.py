"""The generation gate after a weight update whose engine died: resume() fails, and the gate opens anyway.

Found by test_weight_broadcast's killed-engine test: the engine was SIGKILLed during a broadcast, /resume failed, the gate
stayed shut, and the agent's 16 generations waited at it for ever, so it never noticed the engine was gone nor used
the restarted one. Open, they are sent, fail, and the agent's engine-lost path takes over (test_agent_engine_lost.py).
"""

from __future__ import annotations

import socket

import pytest

from kuberl.runtime.inference.base import EngineError
from kuberl.runtime.inference.sglang import SGLangEngine
from kuberl.runtime.inference.vllm import VLLMEngine


def _closed_port() -> int:
    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("engine_cls", [VLLMEngine, SGLangEngine])
async def test_a_failed_resume_still_lets_generations_go(engine_cls):
    engine = engine_cls(url=f"http://127.0.0.1:{_closed_port()}")
    try:
        engine._gate.clear()  # as pause() leaves it
        with pytest.raises(EngineError):
            await engine.resume()
        assert engine._gate.is_set()
    finally:
        await engine.close()
