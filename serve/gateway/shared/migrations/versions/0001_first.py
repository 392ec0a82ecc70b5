"""The store as the first releases made it (SQLite): files, batches and their lines' answers. A store made before this
revision existed has these tables already, perhaps without the columns added since; they are added.

Revision ID: 0001
"""

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0001", None
TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at")
ADDED = {"files": ("expires_at",), "batches": ("output_expires_s",)}  # columns added since the first release


def upgrade() -> None:
    have = sa.inspect(op.get_bind())
    if not have.has_table("files"):
        op.create_table("files", sa.Column("id", sa.Text, primary_key=True),
                        *(sa.Column(c, sa.Text, nullable=False) for c in ("owner", "filename", "purpose")),
                        sa.Column("bytes", sa.Integer, nullable=False), sa.Column("created_at", sa.Integer, nullable=False),
                        sa.Column("expires_at", sa.Integer))
    if not have.has_table("batches"):
        op.create_table(
            "batches", sa.Column("id", sa.Text, primary_key=True),
            *(sa.Column(c, sa.Text, nullable=False) for c in ("owner", "endpoint", "input_file_id", "completion_window",
                                                              "model", "status")),
            sa.Column("total", sa.Integer, nullable=False),
            *(sa.Column(c, sa.Text) for c in ("metadata", "errors", "output_file_id", "error_file_id")),
            *(sa.Column(c, sa.Integer, nullable=False) for c in ("created_at", "expires_at")),
            *(sa.Column(c, sa.Integer) for c in (*TIMES, "output_expires_s")))
        op.create_index("batches_by_status", "batches", ["status", "created_at"])
    if not have.has_table("results"):
        op.create_table("results", sa.Column("batch_id", sa.Text, primary_key=True),
                        sa.Column("line", sa.Integer, primary_key=True), sa.Column("custom_id", sa.Text, nullable=False),
                        sa.Column("request_id", sa.Text), sa.Column("status_code", sa.Integer, nullable=False),
                        sa.Column("body", sa.LargeBinary, nullable=False))
    for table, columns in ADDED.items():
        present = {c["name"] for c in sa.inspect(op.get_bind()).get_columns(table)}
        for column in columns:
            if column not in present:
                op.add_column(table, sa.Column(column, sa.Integer))  # NULL: a file made before expiry never expires
