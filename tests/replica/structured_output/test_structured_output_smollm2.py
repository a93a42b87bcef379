"""Structured output with the real SmolLM2 on CPU: 50 seeded schemas in one batch, every answer valid,
and the official openai client's ``chat.completions.parse`` against a standalone replica."""

from __future__ import annotations

import json

import jsonschema
import pytest
from server_helpers import ReplicaProcess
from structured_helpers import schema_chat, seeded_schemas

from prefixserve.replica.entrypoints.llm import LLM
from prefixserve.replica.sampling_params import SamplingParams
from prefixserve.replica.structured_output.params import StructuredOutputsParams

pytestmark = pytest.mark.slow


def test_fifty_seeded_schemas_all_validate():
    schemas = seeded_schemas(50, seed=29)
    with LLM("smollm2", max_num_seqs=64, max_model_len=1024) as llm:
        params = [
            SamplingParams(temperature=0.0, max_tokens=192, structured_outputs=StructuredOutputsParams(json=s))
            for s in schemas
        ]
        outputs = llm.chat([schema_chat(s) for s in schemas], params)
    for schema, out in zip(schemas, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def test_openai_client_parse_returns_a_parsed_object(tmp_path):
    openai = pytest.importorskip("openai")
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=24)
        country: str = pydantic.Field(max_length=24)
        population_millions: int = pydantic.Field(ge=0, le=50)
        coastal: bool

    with ReplicaProcess("smollm2", "--max-model-len", "1024", log_dir=tmp_path) as proc:
        with openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
            completion = c.chat.completions.parse(
                model="smollm2",
                temperature=0,
                max_tokens=100,
                response_format=City,
                messages=[
                    {"role": "system", "content": "You answer in JSON."},
                    {"role": "user", "content": "Describe the city of Paris."},
                ],
            )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, City), message.content
