"""Samples on demand (issue 44): a tenant's prompts answered by chosen adapters of a finished task
and by its base model. The request's body (SampleRequestSettings, bounded like SampleSettings), and
the internal API's messages: a node daemon claims a request under a lease (SampleClaim ->
SampleWork), renews it while the completions are made, then reports them (SampleResult) or why
not (SampleFailure). Imports the contract's base and settings only."""

from __future__ import annotations

from typing import Annotated

from contract.base import Field, Message
from contract.protocol import Sample
from contract.settings import INT32_MAX, MAX_PROMPTS, Decoding, Prompt

JobId = Annotated[str, Field(min_length=1, max_length=40)]
MAX_JOBS = 8


class SampleRequestSettings(Decoding):
    """What a tenant asks for: its prompts, the configurations that answer them (job ids, or the
    top k by best validation loss; neither: the top 3), the base model beside them, and the
    decoding (as the task's end-of-task SampleSettings)."""

    prompts: list[Prompt] = Field(min_length=1, max_length=MAX_PROMPTS, description=(
        "The prompts (the chat template is applied where the base model's tokenizer has one)."))
    job_ids: list[JobId] | None = Field(
        default=None, min_length=1, max_length=MAX_JOBS,
        description="Jobs of the task whose adapters answer, each once; each must have one (its "
                    "best or final adapter). Not with top_k.")
    top_k: int | None = Field(default=None, ge=0, le=MAX_JOBS, description=(
        "Instead of job_ids: the k jobs of the best validation loss that have an adapter (3 when "
        "neither is given; 0: the base model alone)."))
    include_base: bool = Field(default=True, description="The base model answers too (job_id null).")


class SampleClaim(Message):
    """A node asks for a sample request to run: node_id, and the base models its warm shared
    executors serve (a request of those models goes to them first)."""

    node_id: str = Field(min_length=1, max_length=40)
    warm_models: list[Annotated[str, Field(max_length=200)]] = Field(default_factory=list,
                                                                      max_length=64)


class SampleAdapter(Message):
    job_id: str
    files: list[str] = Field(description="URLs of the adapter's files (worker token): "
                                         "adapter_config.json, adapter_model.safetensors.")


class SampleWork(Message):
    """A claimed request, all the node needs to run it (the reply to SampleClaim)."""

    request_id: str
    lease_token: str
    lease_s: float = Field(description="Renew the lease well within this.")
    task_id: str
    attempt: int
    base_model: str
    base_model_path: str
    prompts: list[Prompt] = Field(max_length=MAX_PROMPTS)
    adapters: list[SampleAdapter] = Field(max_length=MAX_JOBS)
    include_base: bool = True
    max_new_tokens: int = Field(ge=1, le=1024)
    temperature: float = Field(ge=0, le=2)
    top_p: float = Field(gt=0, le=1)
    seed: int = Field(ge=0, le=INT32_MAX)


class SampleLease(Message):
    lease_token: str = Field(min_length=1, max_length=40)


class SampleResult(Message):
    """The completions: per prompt, the base model's row (job_id null) and each adapter's."""

    lease_token: str = Field(min_length=1, max_length=40)
    samples: list[Sample] = Field(max_length=MAX_PROMPTS * (MAX_JOBS + 1))


class SampleFailure(Message):
    """Why the node could not make them: retryable (the node or its executor went away: the
    request is queued again, within its attempts) or not (it fails with this message, which
    names no path and holds no traceback)."""

    lease_token: str = Field(min_length=1, max_length=40)
    error: str = Field(min_length=1, max_length=1000)
    retryable: bool = False


class SampleAck(Message):
    state: str = Field(description="The request's state after the report.")
    mine: bool = Field(description="False: the lease was no longer this claim's (nothing stored).")
