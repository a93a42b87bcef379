"""The one request object: the input processor builds a frozen PreparedRequest once, validated once,
and the engine core, its scheduler Request and the async engine's queue carry that same object."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.contract.request import EngineRequest
from prefixserve.replica.core.request import PreparedRequest
from prefixserve.replica.engine.async_engine import AsyncEngine
from prefixserve.replica.engine.request_runner import RequestRunner
from prefixserve.replica.errors import PromptTooLongError
from prefixserve.replica.sampling_params import SamplingParams

MAX_MODEL_LEN = 128
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def engine(ckpt):
    engine = AsyncEngine(EngineConfig(model=ckpt, max_model_len=MAX_MODEL_LEN, num_kv_blocks=64))
    yield engine
    asyncio.run(engine.shutdown())


def _prepare(engine, request: EngineRequest) -> PreparedRequest:
    """``request`` through the input processor's one factory, in this thread (no grammar: unconstrained)."""
    processor = engine.engine.input_processor
    return processor.build(request, processor.encode_request(request), None, arrival_time=time.monotonic())


@pytest.fixture
def validations(engine, monkeypatch):
    """Every call of the engine's one validation, with the prompt it checked."""
    processor = engine.engine.input_processor
    calls: list[tuple[int, ...]] = []
    validate = processor.validate

    def counting(prompt_ids, params, **kwargs):
        calls.append(tuple(prompt_ids))
        return validate(prompt_ids, params, **kwargs)

    monkeypatch.setattr(processor, "validate", counting)
    return calls


def test_the_prepared_request_is_frozen_and_holds_the_prompt_as_a_tuple(engine):
    request = EngineRequest("r-frozen", prompt=[5, 6, 7], sampling=SamplingParams(max_tokens=2), cache_salt="s")
    prepared = _prepare(engine, request)
    assert isinstance(prepared, PreparedRequest)
    assert prepared.prompt_token_ids == (5, 6, 7) and isinstance(prepared.prompt_token_ids, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.cache_salt = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.prompt_token_ids = (1,)  # type: ignore[misc]


def test_the_async_engine_queues_the_prepared_request_as_it_is(engine, monkeypatch):
    llm_engine = engine.engine
    prepared = _prepare(engine, EngineRequest("r-queued", prompt=[9, 10, 11], sampling=SamplingParams(max_tokens=1)))
    received: list[PreparedRequest] = []
    add_prepared = llm_engine.add_prepared

    def noting(request):
        received.append(request)
        return add_prepared(request)

    monkeypatch.setattr(llm_engine, "add_prepared", noting)

    async def main() -> list:
        return [d async for d in engine.stream(prepared)]

    deltas = asyncio.run(main())
    assert deltas and deltas[-1].finish_reason is not None
    assert len(received) == 1 and received[0] is prepared


def test_the_scheduler_request_reads_the_prepared_request_it_was_given(engine):
    """The core keeps the object as it is: the Request's fields are the PreparedRequest's, not copies."""
    llm_engine = engine.engine
    request = EngineRequest(
        "r-held", prompt=[9, 10, 11, 12], sampling=SamplingParams(max_tokens=1), cache_salt="salt", conversation=True
    )
    prepared = _prepare(engine, request)
    # The engine thread is idle (nothing queued): the core may be driven from here.
    held = llm_engine.add_prepared(prepared)
    try:
        assert held.prepared is prepared
        assert held.prompt_token_ids is prepared.prompt_token_ids  # the tuple, never copied
        assert (held.cache_salt, held.conversation, held.request_id) == ("salt", True, "r-held")
        # The sequence's own list (it grows with the output) starts as the prompt.
        assert held.seqs[0].token_ids == [9, 10, 11, 12]
    finally:
        assert llm_engine.abort_request("r-held")


@pytest.mark.parametrize(
    "request_",
    [
        EngineRequest(prompt=[17, 18, 19, 20], sampling=SamplingParams(max_tokens=2)),
        EngineRequest(prompt="a text prompt", sampling=SamplingParams(max_tokens=2)),
        EngineRequest(messages=CHAT, max_tokens_default=2),
    ],
    ids=["token-ids", "text", "chat"],
)
def test_a_request_is_validated_once_on_its_way_in(engine, validations, request_):
    """Through what every host runs (RequestRunner -> AsyncEngine.prepare -> the queue -> LLMEngine)."""
    runner = RequestRunner(engine)

    async def main() -> list:
        return [d async for d in runner.generate(request_)]

    deltas = asyncio.run(main())
    assert deltas and deltas[-1].finish_reason is not None
    assert len(validations) == 1, validations
    assert len(validations[0]) == deltas[0].num_prompt_tokens


def test_the_offline_path_and_generate_validate_once(engine, validations):
    llm_engine = engine.engine
    req = llm_engine.add_request(None, [21, 22, 23], SamplingParams(max_tokens=1))
    assert llm_engine.abort_request(req.request_id)
    assert len(validations) == 1

    async def main() -> None:
        async for _ in engine.generate("some text", SamplingParams(max_tokens=1)):
            pass

    asyncio.run(main())
    assert len(validations) == 2


def test_a_refused_request_is_refused_by_that_one_validation(engine, validations):
    runner = RequestRunner(engine)
    too_long = EngineRequest(prompt=[17] * (MAX_MODEL_LEN - 1), sampling=SamplingParams(max_tokens=8))

    async def main() -> None:
        async for _ in runner.generate(too_long):
            pass

    with pytest.raises(PromptTooLongError):
        asyncio.run(main())
    assert len(validations) == 1
    assert not engine.engine.requests
