"""The Files and Batch APIs' objects, in OpenAI's shapes (what the `openai` SDK reads)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class ExpiresAfter(BaseModel):
    """OpenAI's expiration policy for a file: deleted `seconds` after it was made (1 hour to 30 days)."""

    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=2_592_000)


class BatchCreate(BaseModel):
    input_file_id: str
    endpoint: str = Field(description="the route every line names in `url`, e.g. /v1/chat/completions")
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(None, max_length=16)
    output_expires_after: ExpiresAfter | None = Field(None, description="when the batch's output and error files "
                                                      "are deleted (default: the gateway's batch_files_expire_s)")


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchError(BaseModel):
    code: str | None
    message: str | None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                    "cancelled"]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool
